"""The HF engine's decoding loop: left-padded prompts in, sampled tokens and their log-probs out.

The decoding loop (`decode`) is loorl's, not transformers' `generate`, for three reasons measured or
seen here: (1) `generate` samples with `torch.multinomial`, which on CPU draws an exponential
variate for every vocabulary entry of every row at every step (SmolLM2, 32 rows x 24 tokens: 0.7 s
of a 3.3 s rollout); inverse-CDF sampling from one uniform per row is the same distribution at a
fraction of the cost; (2) `generate` fills every setting left unset from the model's
`generation_config.json` (an instruct model's repetition penalty, temperature, top-p), a different
distribution from the one the trainer scores; here the sampler is `logprobs.filter_logits`, the
very function the trainer scores with; (3) the n samples of a prompt share one prefill.

The key/value cache is transformers' `DynamicCache` (grown at every token, stored in the compute
dtype) or a preallocated one (`loorl.rollout.engines.kv_cache`); `loorl.rollout.engines.hf_engine` picks which
(`rollout.hf_decode`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loorl.rollout.engines.kv_cache import StaticCachePool, growing_cache, preallocated_cache
from loorl.types import SamplingConfig
from loorl.util.hf_compat import with_cache

CACHE_BUCKET = 64  # a static cache's length is rounded up to this, so prompts of similar length share a graph
# Rows that ended leave the batch once they are this share of it: each leaving copies the whole cache,
# so rows leave in a few waves (SmolLM2's rollout on 2 cores: 272 tokens/s leaving at every end,
# 261-317 at a quarter; noisy), and fewer batch sizes fragment the kept heap less (2.01 GB after a
# validation and 4 rollouts against 2.15; 1.84 without leaving)
LEAVE_AT = 0.25


def sample_tokens(
    logp: torch.Tensor, generator: torch.Generator | None, rows: torch.Tensor | None = None, of: int = 0
) -> torch.Tensor:
    """One token per row [b] drawn from log-probabilities [b, V] by inverting the CDF at a uniform.

    The same distribution as `torch.multinomial`, from one random number per row instead of one
    per vocabulary entry. float64 sums, so that 150k small probabilities add up without drift.
    `rows` [b]: which rows of a batch of `of` these are (the others ended and left it); the uniforms
    are drawn for all `of` and these rows take theirs, so that each row draws what it drew with the
    whole batch present and a seed gives the same samples."""
    cdf = logp.exp().cumsum(-1, dtype=torch.float64)  # [b, V]
    draws = cdf.shape[0] if rows is None else of
    u = torch.rand(draws, 1, generator=generator, dtype=torch.float64, device=cdf.device)  # [draws, 1]
    u = u if rows is None else u[rows]  # [b, 1]
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [b, 1] first entry with cdf > u
    return picked.clamp(max=cdf.shape[-1] - 1).squeeze(-1)  # [b]


def one_token_logits(model, input_ids, position_ids, attention_mask, past_key_values) -> torch.Tensor:
    """The next-token logits [b, V] of one decoding step: `input_ids`, `position_ids` [b, 1] against
    the cache (what `rollout.hf_decode=compiled` turns into one CUDA graph)."""
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                 **with_cache(past_key_values), use_cache=True).logits[:, -1]  # fmt: skip


@dataclass(frozen=True)
class Step:
    """The loop's one-token step `fn` (`one_token_logits`'s arguments and result) and whether it is a
    compiled graph. The engine knows which it built (`rollout.hf_decode`) and says so here: the loop
    then rounds a static cache up to `CACHE_BUCKET` (a graph serves similar lengths) and on CUDA marks
    each replay, for a compiled step only, whatever function it is."""

    fn: Callable[..., torch.Tensor] = one_token_logits
    compiled: bool = False


EAGER = Step()  # `one_token_logits` as it is


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
    step: Step = EAGER,
    check_every: int = 1,
    caches: StaticCachePool | None = None,
    stop_sequences: list[list[int]] = (),
    keep: bool = False,
    drop_ended: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Completions of left-padded prompts `ids`, `mask` [b, P]: tokens and their log-probs [b, C].

    `sampling` None: greedy (argmax, log-probs 0). Otherwise each token is drawn from the sampler's
    distribution, softmax(logits / temperature) truncated to top-k / top-p by the trainer's own
    `filter_logits`, and its log-prob is under that distribution. Rows that ended (any EOS id)
    continue with padding until every row has ended or the limit is reached. `cache`: dynamic (a
    growing key/value cache; `prefill_group` > 1: rows come in groups of that many copies of a prompt,
    which share one prefill, `shared_prefill`) or static (preallocated; every row prefills). `step`:
    the one-token step and whether it is compiled (`Step`). `check_every`: tokens between
    checks that every row has ended (each one a host sync on CUDA); the samples do not depend on it.
    `caches`: where a static cache is taken from and kept for the next call (None: a new one).
    `stop_sequences`: token-id sequences that also end a row once its last tokens are one of them
    (a tool call's closing tag, `loorl.tools`); the caller cuts each row after its first stop.
    `keep`: also return the cache and its mask [b, T] (`decode_steps`), for the rows' next turn.
    `drop_ended`: with a dynamic cache and not `keep`, rows that ended leave the batch instead of
    decoding padding (`decode_steps`); the same samples for a seed.
    """
    b, prompt_length = ids.shape
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P] left padding does not shift them
    drop_ended = drop_ended and cache == "dynamic" and not keep
    if cache == "static":
        # L: rounded up to a bucket where a compiled step's graph is reused across lengths, else exact
        bucket = CACHE_BUCKET if step.compiled else 1
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
        # rows leaving: buffers of a bucketed length, which the next call of a similar length reuses
        capacity = static_cache_length(prompt_length, max_new_tokens) if drop_ended else None
        if prefill_group > 1 and prompt_length > 1:
            kv = shared_prefill(model, ids[::prefill_group], mask[::prefill_group], prefill_group,
                                capacity=capacity)  # fmt: skip
            fresh = {"input_ids": ids[:, -1:], "position_ids": positions[:, -1:]}  # the last prompt token
        else:
            kv = growing_cache(model.config, capacity)
            fresh = {"input_ids": ids, "position_ids": positions}
        logits = model(**fresh, attention_mask=mask, **with_cache(kv), use_cache=True,
                       logits_to_keep=1).logits[:, -1]  # fmt: skip  # [b, V]
    tokens, logprobs, mask = decode_steps(
        model, logits, kv, full_mask if cache == "static" else mask, positions[:, -1:] + 1,
        sampling=sampling, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id, generator=generator, step=step, check_every=check_every,
        stop_sequences=stop_sequences, static_start=prompt_length if cache == "static" else None,
        drop_ended=drop_ended,
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
    step: Step = EAGER,
    check_every: int = 1,
    stop_sequences: list[list[int]] = (),
    static_start: int | None = None,
    drop_ended: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The decoding loop of `decode` from a prefill's last logits [b, V], its cache `kv` and `mask`
    [b, T] (the cache's columns; a static cache's whole length, its columns from `static_start` on
    still to come) and each row's `next_position` [b, 1]. Returns tokens and their log-probs [b, C]
    and the mask of what the cache then holds: every token but the last was fed to it (a dynamic
    cache: [b, T + C - 1], 1 on the fed tokens, also those after a row ended).

    `drop_ended` (a dynamic cache only): at a check where at least `LEAVE_AT` of the batch has
    ended, those rows leave the batch and its cache instead of decoding padding to the end. Past
    its end a row's tokens are padding, as without it, and its log-probs 0 (nothing reads them: the
    engine cuts at the end). The cache then holds only the last live rows, so the mask returned is
    None (a cache kept for another turn needs every row: `keep` decodes without it)."""
    from loorl.algo.distribution import filter_logits

    if drop_ended and static_start is not None:
        raise ValueError("drop_ended needs a dynamic cache: a static one keeps its batch's shape")
    b = logits.shape[0]
    device = logits.device
    compiled_on_cuda = step.compiled and device.type == "cuda"
    stops = torch.tensor(eos_token_ids, device=device)
    sequences = [torch.tensor(q, device=device) for q in stop_sequences if q]  # each [m]
    live = torch.arange(b, device=device)  # [r] the rows still in the batch (all of them without drop_ended)
    ended = torch.zeros(b, dtype=torch.bool, device=device)  # [r]
    tokens = torch.full((b, max_new_tokens), pad_token_id, dtype=torch.long, device=device)  # [b, C]
    logprobs = torch.zeros(b, max_new_tokens, device=device)  # [b, C]
    for i in range(max_new_tokens):
        if sampling is None:
            token = logits.argmax(-1)  # [r]
            logp = torch.zeros(token.shape, device=device)  # [r]
        else:  # a profiler range: scripts/bench/bench_engines.py --profile reports sampling's share
            with torch.profiler.record_function("loorl/sample"):
                scaled = logits.float() / sampling.temperature  # [r, V]
                scaled = filter_logits(scaled, top_k=sampling.top_k, top_p=sampling.top_p)  # [r, V]
                all_logp = scaled.log_softmax(-1)  # [r, V]
                token = sample_tokens(all_logp, generator, live if drop_ended else None, of=b)  # [r]
                logp = all_logp.gather(-1, token[:, None]).squeeze(-1)  # [r]
        token = token.masked_fill(ended, pad_token_id)  # [r] ended rows continue with padding
        tokens[live, i] = token
        logprobs[live, i] = logp.masked_fill(ended, 0.0) if drop_ended else logp
        ended |= torch.isin(token, stops)
        for q in sequences:  # the row's last len(q) tokens are the sequence q
            if i + 1 >= len(q):
                ended |= (tokens[live, i + 1 - len(q) : i + 1] == q).all(-1)  # [r]
        checked = (i + 1) % check_every == 0
        if i == max_new_tokens - 1 or (checked and bool(ended.all())):
            break
        if drop_ended and checked and int(ended.sum()) >= LEAVE_AT * ended.numel():  # the ended rows leave
            stay = (~ended).nonzero().squeeze(-1)  # [r']
            kv.batch_select_indices(stay)
            live, mask, next_position, token = live[stay], mask[stay], next_position[stay], token[stay]
            ended = ended[stay]
        if static_start is not None:
            mask[:, static_start + i] = 1  # [b, L] in place
        else:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)  # [r, T + i + 1]
        if compiled_on_cuda:  # each replay of the CUDA graph starts a new step of its memory pool
            torch.compiler.cudagraph_mark_step_begin()
        logits = step.fn(model, token[:, None], next_position, mask, kv)  # [r, V]
        next_position = next_position + 1
    generated = i + 1  # [b, C], [b, C], [b, T'] (None: the rows left)
    return tokens[:, :generated], logprobs[:, :generated], None if drop_ended else mask


def shared_prefill(
    model, ids: torch.Tensor, mask: torch.Tensor, n: int, into=None, capacity: int | None = None
):
    """The key/value cache of each prompt's first P-1 tokens, computed once and repeated n times.
    `into`: a `preallocated_cache` of the g * n rows, filled in place (the prefill runs on a g-row
    one of the same length); None: a new growing cache (of that `capacity`: `growing_cache`).

    `ids`, `mask` [g, P]: one left-padded row per prompt. `generate` given this cache for the n*g
    expanded rows runs only their last prompt token and then decodes; the samples are those of a
    plain call with the same seed (the cache holds the same values). transformers' `generate`
    expands `num_return_sequences` before the prefill, so it would prefill every prompt n times.
    """
    if into is None:
        cache = growing_cache(model.config, capacity)
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
