"""The sampler's distribution over a model's logits: temperature, then top-k / top-p truncation with
the sampled token always kept; the log-probability and entropy of tokens under it.

The sampler draws from softmax(logits / temperature) truncated to its top-k / top-p set; every
log-prob the trainer computes (policy, reference, old policy) must be of that same distribution,
or importance ratios, KL values and mismatch metrics are of a different policy. The engines sample
with `filter_logits`; `loorl.algo.logprobs` and `loorl.algo.head_logprobs` score with it.
Shapes: N sequences, T positions, V vocabulary entries.
"""

from __future__ import annotations

import math

import torch

from loorl.errors import ConfigError


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ConfigError(f"temperature={temperature} must be a positive number")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 logsumexp over a big vocabulary loses the logprob); float64 stays."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def filter_logits(
    scaled: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Temperature-scaled logits [n, T, V] with the entries the sampler never draws set to -inf.

    The sampler's order (transformers' warpers and vLLM alike): top-k first, then top-p over the
    top-k-renormalised distribution, dropping the smallest probabilities whose cumulative sum stays
    <= 1 - top_p and always keeping the most likely entry; ties at the k-th logit are kept. `keep`
    [n, T] holds the sampled tokens, which always stay in (a token the sampler drew must not get a
    -inf log-probability because a bf16 or kernel difference moved it across the cut-off).
    The selection carries no gradient; the kept logits do.
    """
    if top_k <= 0 and top_p >= 1.0:
        return scaled
    with torch.no_grad():
        drop = torch.zeros_like(scaled, dtype=torch.bool)  # [n, T, V]
        if 0 < top_k < scaled.shape[-1]:
            kth = scaled.topk(top_k, dim=-1).values[..., -1:]  # [n, T, 1]
            drop = scaled < kth  # [n, T, V]
        if top_p < 1.0:
            sorted_logits, order = scaled.masked_fill(drop, -math.inf).sort(dim=-1)  # [n, T, V] ascending
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [n, T, V]
            drop_sorted = cumulative <= 1.0 - top_p  # [n, T, V]
            drop_sorted[..., -1] = False  # the most likely entry always stays
            drop = drop | drop_sorted.scatter(-1, order, drop_sorted)  # [n, T, V] back in vocabulary order
        if keep is not None:
            drop.scatter_(-1, keep.long().unsqueeze(-1), False)  # [n, T, V]
    return scaled.masked_fill(drop, -math.inf)  # [n, T, V]


def _sampler_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, keep: torch.Tensor | None
) -> torch.Tensor:
    """The logits [n, T, V] of the distribution the sampler drew from, in float32 (or float64)."""
    scaled = _upcast(logits)  # [n, T, V]
    if temperature != 1.0:
        scaled = scaled / temperature  # [n, T, V]
    return filter_logits(scaled, top_k=top_k, top_p=top_p, keep=keep)  # [n, T, V]


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int = 8,
) -> torch.Tensor:
    """log pi(token) [N, T] under the sampler's distribution, in float32 (or float64).

    That distribution is softmax(logits / temperature) restricted to the top-k / top-p set (see
    `filter_logits`): the temperature and truncation must be the sampler's, or the log-probs are
    of a different policy (biased importance weights, KL and mismatch metrics).
    Computed as gather - logsumexp instead of a full log_softmax: the latter keeps another
    [N, T, V] tensor alive for backward, the memory peak with 150k-entry vocabularies.
    Rows are processed `chunk_size` sequences at a time to bound the float32 temporaries.
    """
    _check_temperature(temperature)
    parts = []
    for start in range(0, logits.shape[0], max(1, chunk_size)):
        ids = tokens[start : start + chunk_size].long()  # [n, T]
        scaled = _sampler_logits(logits[start : start + chunk_size], temperature, top_k, top_p, ids)
        picked = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [n, T]
        parts.append(picked - torch.logsumexp(scaled, dim=-1))  # [n, T]
    if not parts:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)  # [0, T]
    return torch.cat(parts, dim=0)  # [N, T]


def token_entropy(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    tokens: torch.Tensor | None = None,
    chunk_size: int = 8,
) -> torch.Tensor:
    """Entropy [N, T] of the sampler's distribution (as in `token_logprobs`), with its gradient.

    `tokens` [N, T], the sampled tokens, stay in the truncated set as they do for the log-probs.
    Masked-out vocabulary entries (-inf logits) contribute 0, not NaN, to the value and the gradient.
    Keeps [n, T, V] temporaries of `chunk_size` rows for the backward: for monitoring call it under
    no_grad; the chunked head (`loorl.algo.head_logprobs`) trains on it without them.
    """
    _check_temperature(temperature)
    parts = []
    for start in range(0, logits.shape[0], max(1, chunk_size)):
        ids = None if tokens is None else tokens[start : start + chunk_size]  # [n, T]
        scaled = _sampler_logits(logits[start : start + chunk_size], temperature, top_k, top_p, ids)
        logp = torch.log_softmax(scaled, dim=-1)  # [n, T, V]
        kept = logp > -math.inf  # [n, T, V]
        logp = torch.where(kept, logp, 0.0)  # [n, T, V] no -inf: 0 * -inf would be a NaN gradient
        plogp = torch.where(kept, logp.exp() * logp, 0.0)  # [n, T, V]
        parts.append(-plogp.sum(dim=-1))  # [n, T]
    if not parts:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)  # [0, T]
    return torch.cat(parts, dim=0)  # [N, T]
