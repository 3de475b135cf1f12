"""The one-step-off sampler in a process of its own (`rollout.max_staleness=1`, `rollout.devices`).

With `max_staleness=1` step t+1's rollout is sampled with step t's weights while step t trains. For the
two to run at the same time they must not share an interpreter (the GIL) nor a pool of threads: the
engine runs in a spawned process, `serve`, on cores (or a GPU) of its own, and the trainer keeps the
rest. What crosses between the two:

- the weights, once per step, through shared memory: at the first request the trainer makes a copy
  of the policy whose tensors live in shared memory (`shared_copy`; a LoRA policy's merged weights)
  and hands it to the process, which samples with it in place; at each later request the trainer
  copies the live weights into it (`copy_weights`: one memcpy per tensor, 0.1 s for SmolLM2's 135M
  float32 weights here). The copy is only ever written while the process is idle: the trainer writes
  it just before it sends a request, after it has received the previous one.
- a request (prompt ids, samples per prompt, seed, the trainer's autocast dtype) and its answer (the
  completions and the seconds they took), pickled through a pipe: a few kB per step.

The samples are those the same engine would draw in the trainer's process with the same weights, seed
and threads: the process runs the run's own engine object (pickled before its first sync), in the
trainer's autocast (read when the request is sent), and the timing of the two processes decides
nothing (tested: a run with its sampler in a process of its own logs the same metrics as one with it in
the training process, `rollout.devices=trainer`, both with one thread).

Why a process with a copy of the HF engine, not vLLM's own engine-core process (V1 multiprocessing):
on this CPU the HF engine is the faster sampler (docs/how-to/rollout-engines.md: ~2x vLLM-CPU's tokens/s
on the tiny model), a shared-memory copy costs a memcpy where vLLM's engine core takes the weights
through its RPC (pickled, then loaded), and one mechanism serves every engine class: the process
runs whatever `rollout.engine` names, vLLM included (it then copies the shared weights into itself).

Validation samples in the training process (`generate`), with the current weights, on the trainer's
cores and the sampler's: the rollout in flight is waited for first, so the sampler is idle while its
cores are lent and the thread count never depends on timing.

The process ignores SIGINT, SIGTERM and SIGUSR1 (the trainer's `GracefulStop` owns them and may
still need the rollout in flight for its last checkpoint) and ends when its pipe closes: at `close`,
or when the trainer's process dies. On CUDA (`rollout.devices=cuda:N`) the copy is a CUDA tensor
shared through CUDA IPC: written but untested, no GPU was lent.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from loorl.errors import ConfigError
from loorl.rollout.engines.base import PolicyWeights, RolloutEngine
from loorl.types import Completion

log = logging.getLogger(__name__)

DEVICES_HELP = "auto | trainer | cpu:<cores, e.g. 1 or 2-3 or 0,2> | cuda:<gpu index>"


@dataclass(frozen=True)
class Placement:
    """Where the sampler runs: `device` cpu (on `cores`) or cuda (GPU `gpu`); `trainer_cores`: the
    cores the training process keeps (CPU only; None: left as they are)."""

    device: str
    cores: tuple[int, ...] = ()
    gpu: int | None = None
    trainer_cores: tuple[int, ...] | None = None

    def describe(self) -> str:
        return f"GPU {self.gpu}" if self.device == "cuda" else cores_text(self.cores)


def cores_text(cores: tuple[int, ...]) -> str:
    """(1,) -> 'core 1'; (2, 3) -> 'cores 2,3'."""
    return f"core{'s' if len(cores) > 1 else ''} {','.join(map(str, cores))}"


def parse_cores(text: str, setting: str = "rollout.devices") -> tuple[int, ...]:
    """'1' | '2-3' | '0,2,4-5' -> sorted core ids."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    except ValueError:
        cores = set()
    if not cores:
        raise ConfigError(f"{setting}=cpu:{text} names no cores: give them as cpu:1, cpu:2-3 or cpu:0,2")
    return tuple(sorted(cores))


def sampler_placement(devices: str, *, max_staleness: int, cuda: bool, cpus: set[int], gpu: int | None = None,
                      several_processes: bool = False) -> Placement | None:  # fmt: skip
    """`rollout.devices` -> the sampler process's placement, or None: the sampler runs in the training
    process. `cpus`: the cores this process may use; `gpu`: the trainer's CUDA device (None: the
    current one when the sampler starts, for auto); `several_processes`: a data-parallel run (ddp),
    where each rank has a sampler of its own.

    auto: with `max_staleness=1`, a process of its own on the upper half of the cores (on CUDA the
    trainer's GPU, which the two share); in the training process when synchronous or with one core,
    and, with several training processes, on CPU (their cores are already shared out among them)."""
    devices = str(devices).strip()
    if devices == "trainer" or (devices == "auto" and not max_staleness):
        return None
    if not max_staleness:
        raise ConfigError(
            f"rollout.devices={devices} places the one-step-off sampler in a process of its own, but "
            "rollout.max_staleness=0 samples between training steps: set rollout.max_staleness=1, or drop "
            "rollout.devices"
        )
    if several_processes and devices != "auto":
        raise ConfigError(
            f"rollout.devices={devices} places one sampler, but a data-parallel run has one per rank: use "
            "rollout.devices=auto (on CUDA each beside its rank, on its GPU) or rollout.devices=trainer"
        )
    if devices == "auto":
        if cuda:
            return Placement("cuda", gpu=gpu)
        if several_processes:
            log.info("rollout.devices=auto: several training processes on the CPU share its cores already, "
                     "so each rank samples one step off in its own process, not overlapped")  # fmt: skip
            return None
        if len(cpus) < 2:
            log.info("rollout.devices=auto: one core, so the sampler stays in the training process")
            return None
        ordered = sorted(cpus)
        return Placement(
            "cpu", tuple(ordered[len(ordered) // 2 :]), None, tuple(ordered[: len(ordered) // 2])
        )
    kind, _, rest = devices.partition(":")
    if kind == "cuda" and rest.isdigit():
        return Placement("cuda", gpu=int(rest))
    if kind != "cpu" or not rest:
        raise ConfigError(f"rollout.devices={devices} is not one of: {DEVICES_HELP}")
    cores = parse_cores(rest)
    missing = sorted(set(cores) - cpus)
    if missing:
        raise ConfigError(
            f"rollout.devices={devices} names core {missing[0]}, which this process may not use (its cores: "
            f"{','.join(map(str, sorted(cpus)))}): pick the sampler's cores among them"
        )
    if cuda:
        return Placement("cpu", cores)  # the trainer computes on its GPU: its cores are left as they are
    left = tuple(sorted(cpus - set(cores)))
    if not left:
        raise ConfigError(
            f"rollout.devices={devices} takes every core this process may use, leaving none for training: "
            "leave the trainer at least one (e.g. rollout.devices=auto)"
        )
    return Placement("cpu", cores, None, left)


def shared_copy(weights: PolicyWeights, device: torch.device | None = None) -> torch.nn.Module:
    """A frozen copy of the policy (a LoRA policy's merged into its base model) whose tensors live in
    shared memory (a CUDA copy: shareable through CUDA IPC), to hand to the sampler process."""
    from loorl.models.lora import is_lora

    module = copy.deepcopy(weights.module)
    if is_lora(module):
        module = module.merge_and_unload()
    module.requires_grad_(False)
    if device is not None:
        module.to(device)
    copy_weights(module, weights)
    return module.share_memory()


@torch.no_grad()
def copy_weights(target: torch.nn.Module, weights: PolicyWeights) -> None:
    """Write the policy's weights into `target` in place, by name (every name must be there)."""
    state = target.state_dict(keep_vars=True)
    for name, tensor in weights:
        if name not in state:
            raise RuntimeError(f"the sampler's copy of the policy has no weight named {name}")
        state[name].data.copy_(tensor)


@dataclass(frozen=True)
class Request:
    prompt_ids: list[list[int]]
    n: int
    seed: int | None
    version: int | None
    autocast: torch.dtype | None  # the trainer's autocast dtype when the request was sent (None: off)
    options: dict  # what else the engine's generate takes (`rows`, for an environment's)


def serve(conn, engine: RolloutEngine, placement: Placement, threads: int) -> None:
    """The sampler process: receive the shared copy of the policy (`model`), then answer each request with
    the completions of `engine` sampling from it; end when the pipe closes or carries None."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)  # the trainer decides when this process ends
    if placement.device == "cpu":
        os.sched_setaffinity(0, placement.cores)
    else:
        torch.cuda.set_device(placement.gpu)
    torch.set_num_threads(threads)
    # the bulk of unpickling the model's imports, done while the trainer validates step 0, not when the
    # first rollout is asked for
    import transformers.modeling_utils  # noqa: F401

    try:
        model = conn.recv()
    except EOFError:
        return
    if model is None:
        return
    device = next(model.parameters()).device
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if request is None:
            return
        try:
            start = time.perf_counter()
            engine.sync(PolicyWeights(model), version=request.version)
            autocast = torch.autocast(
                device.type, dtype=request.autocast, enabled=request.autocast is not None
            )
            with autocast:
                groups = engine.generate(
                    request.prompt_ids, n=request.n, seed=request.seed, **request.options
                )
            engine.sleep()
            answer = ("ok", groups, time.perf_counter() - start)
        except Exception:  # noqa: BLE001 - the trainer raises it with this traceback
            answer = ("error", traceback.format_exc(), 0.0)
        try:
            conn.send(answer)
        except (BrokenPipeError, ConnectionResetError):  # the trainer is gone
            return


@contextmanager
def _entry_script_hidden():
    """A spawned process runs the parent's entry script again (as `__mp_main__`) before its target, so
    that functions defined there can be unpickled; `serve` and its arguments live in loorl, and the
    training script's imports (Lightning, Hydra: ~4 s of the process's start on this CPU) are not
    needed there. With the script's path and module name out of sight, multiprocessing skips it."""
    main = sys.modules["__main__"]
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


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
        self.takes_rows = getattr(inner, "takes_rows", False)  # an environment's: its instances live there
        self.sampling, self.eos_token_ids = inner.sampling, inner.eos_token_ids
        self.pad_token_id = inner.pad_token_id
        self.process = self.conn = self.model = None
        self.weights: PolicyWeights | None = None
        self.version: int | None = None
        self.waiting = False  # a request was sent and its answer not yet received
        self.answer: tuple | None = None  # its answer, when validation took it off the pipe first
        self.wait_seconds = 0.0  # how long the last `receive` waited for the process

    # ---- the RolloutEngine interface (in this process: validation) -----------------------------
    def sync(self, weights: PolicyWeights, version: int | None = None, *, force: bool = False) -> None:
        self.weights, self.version = PolicyWeights.of(weights), version
        self.inner.sync(weights, version, force=force)

    def sleep(self) -> None:
        self.inner.sleep()

    def weight_sync_stats(self) -> dict[str, float]:
        return self.inner.weight_sync_stats()

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
        with _entry_script_hidden():
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
