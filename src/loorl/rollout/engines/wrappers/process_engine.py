"""`ProcessEngine`: the run's engine with its one-step-off rollouts (`rollout.max_staleness=1`,
`rollout.devices`) sampled in a process of its own (`loorl.rollout.engines.sampler_process`: why, and
what crosses between the two), and validation in this one."""

from __future__ import annotations

import copy
import logging
import os
import time
from contextlib import contextmanager

import torch

from loorl.rollout.engines.base import PolicyWeights, RolloutEngine
from loorl.rollout.engines.sampler_process import (
    Placement,
    Request,
    copy_weights,
    cores_text,
    entry_script_hidden,
    serve,
    shared_copy,
)
from loorl.types import Completion

log = logging.getLogger(__name__)


class ProcessEngine(RolloutEngine):
    """A rollout engine whose one-step-off rollouts (`submit`, `receive`) are sampled in a process of its
    own, `serve`, placed by `rollout.devices`; `generate` (validation) runs the same engine in this
    process, with the live weights. Started by `start` (the DataModule's setup, else the first
    `submit`), ended by `close`. One request at a time: the DataModule receives it before the next."""

    max_in_flight = 1

    def __init__(self, inner: RolloutEngine, placement: Placement) -> None:
        self.inner, self.placement = inner, placement
        # what the process runs: the engine as built, before any sync (a synced HF engine holds the live
        # policy, which pickling would move into shared memory and hand to the process)
        self.blueprint = copy.deepcopy(inner)
        self.name = f"{inner.name} (sampler process on {placement.describe()})"
        self.generates_in_trainer_precision = inner.generates_in_trainer_precision
        self.sampling, self.eos_token_ids = inner.sampling, inner.eos_token_ids
        self.pad_token_id = inner.pad_token_id
        self.process = self.conn = self.model = None
        self.weights: PolicyWeights | None = None
        self.version: int | None = None
        self.waiting = False  # a request was sent and its answer not yet received
        self.answer: tuple | None = None  # its answer, when validation took it off the pipe first
        self.wait_seconds = 0.0  # how long the last `receive` waited for the process

    @property
    def takes_rows(self) -> bool:
        """An environment's (a `ToolEngine`'s): its instances live in the process."""
        return self.inner.takes_rows

    def weight_sync_stats(self) -> dict[str, float]:
        return self.inner.weight_sync_stats()

    # ---- the RolloutEngine interface (in this process: validation) -----------------------------
    def sync(self, weights: PolicyWeights, version: int | None = None, *, force: bool = False) -> None:
        self.weights, self.version = PolicyWeights.of(weights), version
        self.inner.sync(weights, version, force=force)

    def sleep(self) -> None:
        self.inner.sleep()

    def use_temperature(self, temperature: float) -> None:
        """In this process only (validation): the process samples at the temperature it was built with,
        so a schedule with `rollout.max_staleness > 0` is refused (`loorl.config`)."""
        self.inner.use_temperature(temperature)
        super().use_temperature(temperature)

    def generate(self, prompt_ids, *, n: int, greedy: bool = False, seed: int | None = None, **options):
        """In this process (validation), on every core: the request in flight is waited for first (the
        sampler is ahead of the trainer and mostly done by then), so that the process is idle while its
        cores are lent, and the thread count, and so the numerics, never depend on timing."""
        if self.waiting and self.answer is None:
            self.answer = self._answer()
        with self._all_cores():
            return self.inner.generate(prompt_ids, n=n, greedy=greedy, seed=seed, **options)

    @contextmanager
    def _all_cores(self):
        """The training process on its cores and the sampler's for the block (CPU placements)."""
        trainer_cores = self.placement.trainer_cores
        if self.process is None or trainer_cores is None:
            yield
            return
        every = trainer_cores + self.placement.cores
        os.sched_setaffinity(0, every)
        torch.set_num_threads(len(every))
        try:
            yield
        finally:
            os.sched_setaffinity(0, trainer_cores)
            torch.set_num_threads(len(trainer_cores))

    # ---- sampling ahead, in the process ------------------------------------------------------------
    def submit(self, prompt_ids: list[list[int]], *, n: int, seed: int | None = None, **options) -> int:
        """Send the weights of the last `sync` and a request; returns at once. Call it inside the trainer's
        precision context (as `generate`): its autocast dtype goes with the request. `options`: what else
        the engine's generate takes (`rows`: an environment's instances are reset and run there)."""
        if self.waiting:
            raise RuntimeError("ProcessEngine.submit: the previous request has not been received")
        if self.weights is None:
            raise RuntimeError("ProcessEngine.submit called before sync(policy)")
        self.start()
        if self.model is None:  # the first request: the shared copy goes first, the process keeps it
            device = torch.device("cuda", self.placement.gpu) if self.placement.device == "cuda" else None
            self.model = shared_copy(self.weights, device)
            self.conn.send(self.model)
        else:
            copy_weights(self.model, self.weights)
        device = "cuda" if self.placement.device == "cuda" else "cpu"
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        try:
            self.conn.send(Request(prompt_ids, n, seed, self.version, autocast, options))
        except (BrokenPipeError, ConnectionResetError):
            raise self._died("before it was sent a rollout") from None
        self.waiting = True
        return 0

    def receive(self, ticket: int | None = None) -> tuple[list[list[Completion]], float]:
        if not self.waiting:
            raise RuntimeError("ProcessEngine.receive: nothing was submitted")
        start = time.perf_counter()
        try:
            status, payload, seconds = self.answer or self._answer()
        finally:
            self.waiting, self.answer = False, None
        self.wait_seconds = time.perf_counter() - start
        if status == "error":
            raise RuntimeError(f"the sampler process failed:\n{payload}")
        return payload, seconds

    def _answer(self) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, ConnectionResetError):
            self.waiting = False
            raise self._died("while it generated a rollout") from None

    def start(self) -> None:
        """Spawn the process (its imports take seconds: the DataModule starts it at setup, so that they
        overlap the model's setup and the first validation) and move the trainer onto its own cores."""
        if self.process is not None:
            return
        import torch.multiprocessing as mp

        placement = self.placement
        if placement.device == "cuda" and placement.gpu is None:  # beside this rank, on its GPU
            placement = self.placement = Placement("cuda", gpu=torch.cuda.current_device())
        threads = len(placement.cores) if placement.device == "cpu" else torch.get_num_threads()
        context = mp.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=serve, args=(theirs, self.blueprint, placement, threads),
                                       daemon=True, name="loorl-sampler")  # fmt: skip
        with entry_script_hidden():
            self.process.start()
        theirs.close()
        kept = ""
        if placement.trainer_cores is not None:
            os.sched_setaffinity(0, placement.trainer_cores)
            torch.set_num_threads(len(placement.trainer_cores))
            kept = cores_text(placement.trainer_cores)
            kept = f"; training keeps {kept} with {len(placement.trainer_cores)} thread(s)"
        log.info("one step off: the sampler process (pid %d) runs on %s with %d thread(s)%s",
                 self.process.pid, placement.describe(), threads, kept)  # fmt: skip

    def _died(self, when: str) -> RuntimeError:
        self.process.join(timeout=5)
        return RuntimeError(f"the sampler process died (exit code {self.process.exitcode}) {when}: see its "
                            "output above; an exit code of -9 is often the out-of-memory killer")  # fmt: skip

    def close(self) -> None:
        """Stop the process (after the request in flight, if any, is answered or given up); the engine of
        this process (validation's) closes too."""
        self.inner.close()
        if self.process is None:
            return
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
        self.process = self.conn = self.model = self.answer = None
        self.waiting = False
