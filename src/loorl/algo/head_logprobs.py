"""Log-probs and entropies of sampled tokens from the final hidden states, without the logits.

The output layer turns hidden states [M, H] into logits [M, V]; with a 150k-entry vocabulary a
batch's float32 logits, the copy `logsumexp` keeps for the backward and the gradient buffers are
the training step's memory peak (9 GB a rank for one Qwen2.5 prompt of 5 x 1,024 tokens). Here the
output layer runs chunk by chunk over tokens: each chunk's logits live only while its log-probs and
entropy are computed, the backward recomputes them instead of keeping them, so the extra peak is
one chunk's logits, whatever the batch.

The distribution is the sampler's, exactly as `loorl.algo.distribution` defines it (temperature, then
top-k / top-p with the sampled token always kept), and the values and gradients equal the plain
path's to float rounding (`tests/test_head_logprobs.py`). Written by hand because the fused kernels
that do this (liger-kernel's fused linear cross-entropy, the peers' fused log-prob heads) neither
take the sampler's truncation nor run on a CPU; this is plain PyTorch on every device.

`ScoringHead` puts the computation inside the model's own forward (it stands in for the output
layer during a call), so that FSDP's hooks, peft's wrappers and transformers' `logits_to_keep`
work as they do for the logits.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from loorl.algo.distribution import _check_temperature, _upcast, filter_logits

DEFAULT_CHUNK_TOKENS = 512  # tokens per chunk of logits (see docs/performance/memory.md): 100 MB at V=49,152


def _row_blocks(n: int, chunk_tokens: int, parts: int = 8):
    """A chunk's rows in `parts` blocks for the element-wise work, so that its temporaries stay a
    fraction of the chunk's logits (the top-p filter's sort and masks are about 8 blocks' worth)."""
    step = max(1, chunk_tokens // parts)
    return [slice(start, min(n, start + step)) for start in range(0, n, step)]


def _transposed(weight: torch.Tensor) -> torch.Tensor:
    """weight.T [H, V] as a matmul operand: a view on CUDA; on the CPU a contiguous copy, made once
    per pass (the CPU matmul copies a transposed operand at every call, once per chunk)."""
    return weight.T if weight.is_cuda else weight.T.contiguous()


def _scaled_logits(hidden, weight_t, bias, tokens, *, temperature, top_k, top_p, chunk_tokens):
    """The sampler's logits [c, V] of one chunk (float32 or float64): output layer, temperature,
    truncation (the sampled tokens kept). `hidden` and `weight_t` [H, V] are in the compute dtype."""
    logits = hidden @ weight_t  # [c, V] compute dtype
    if bias is not None:
        logits += bias
    scaled = _upcast(logits)  # [c, V] float32 (the same tensor when the compute dtype is float32)
    del logits
    if temperature != 1.0:
        scaled.div_(temperature)
    if top_k > 0 or top_p < 1.0:
        for rows in _row_blocks(scaled.shape[0], chunk_tokens, parts=32):  # sort values, int64 order, masks
            scaled[rows] = filter_logits(scaled[rows], top_k=top_k, top_p=top_p, keep=tokens[rows])
    return scaled


def _chunk_statistics(scaled, ids, logp, lse, entropy) -> None:
    """Fill one chunk's log p(ids), log-normaliser and (where `entropy` is given) entropy [c] from its
    logits [c, V], which it overwrites: the only temporary is an eighth of a chunk of probabilities."""
    top = scaled.amax(-1, keepdim=True)  # [c, 1]
    for rows in _row_blocks(scaled.shape[0], scaled.shape[0]):
        shifted = scaled[rows].sub_(top[rows])  # [b, V] in place: <= 0, -inf where truncated
        weights = shifted.exp()  # [b, V] unnormalised probabilities
        log_z = weights.sum(-1).log()  # [b]
        lse[rows] = top[rows, 0] + log_z
        logp[rows] = shifted.gather(-1, ids[rows, None]).squeeze(-1) - log_z
        if entropy is not None:  # H = log z - sum(p * shifted); truncated entries: 0 * finite
            shifted.clamp_(min=torch.finfo(shifted.dtype).min)
            dot = (weights.unsqueeze(-2) @ shifted.unsqueeze(-1)).view(-1)  # [b] no [b, V] product
            entropy[rows] = log_z - dot / log_z.exp()
        del shifted, weights  # before the next block's exist


def _chunk_logit_grads(scaled, ids, lse, grad_logp, temperature, entropy=None, grad_entropy=None):
    """d loss / d logits [c, V] of one chunk, written over its sampler logits `scaled` [c, V]:
    d log p(id) / d scaled = onehot(id) - softmax(scaled), and where the entropy H [c] has a gradient
    d H / d scaled = -p * (log p + H); then the temperature's 1/T. Truncated entries (p = 0) get 0."""
    g = None if grad_logp is None else grad_logp.to(lse.dtype)  # [c]
    g_h = None if grad_entropy is None else grad_entropy.to(lse.dtype)  # [c]
    for rows in _row_blocks(scaled.shape[0], scaled.shape[0]):
        log_p = scaled[rows].sub_(lse[rows, None])  # [b, V] in place: log softmax, -inf where truncated
        probs = log_p.exp() if g_h is not None else log_p.exp_()  # [b, V] softmax, 0 where truncated
        if g is not None:
            grads = probs.mul(-g[rows, None]) if g_h is not None else probs.mul_(-g[rows, None])  # [b, V]
            grads.scatter_add_(-1, ids[rows, None], g[rows, None])
        else:
            grads = torch.zeros_like(probs)  # [b, V]
        if g_h is not None:  # a finite log p where p = 0, so that 0 * log p stays 0
            log_p.clamp_(min=torch.finfo(log_p.dtype).min).add_(entropy[rows, None])  # [b, V] log p + H
            grads.sub_(probs.mul_(log_p).mul_(g_h[rows, None]))
            scaled[rows] = grads
        if temperature != 1.0:
            scaled[rows].div_(temperature)
        del log_p, probs, grads
    return scaled


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """(hidden [M, H], weight [V, H], bias [V] | None, tokens [M]) -> log p(token) [M], entropy [M]."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, tokens, temperature, top_k, top_p, chunk_tokens, with_entropy, entropy_grad
    ):
        device = hidden.device.type
        # The matmul runs in autocast's dtype where autocast is on (as the output layer would), else
        # in the weights'; the casts are made once here and kept for the backward, as autograd keeps
        # the cast inputs of a linear layer.
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        h, w = hidden.to(dtype), weight.to(dtype)  # [M, H], [V, H]
        b = None if bias is None else bias.to(dtype)  # [V]
        n = h.shape[0]
        out_dtype = torch.promote_types(dtype, torch.float32)
        logp = torch.empty(n, dtype=out_dtype, device=h.device)  # [M]
        lse = torch.empty(n, dtype=out_dtype, device=h.device)  # [M] kept for the backward
        entropy = torch.zeros(n, dtype=out_dtype, device=h.device)  # [M]
        args = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "chunk_tokens": chunk_tokens}
        with torch.autocast(device, enabled=False):
            w_t = _transposed(w)  # [H, V]
            for start in range(0, n, chunk_tokens):
                part = slice(start, min(n, start + chunk_tokens))
                scaled = _scaled_logits(h[part], w_t, b, tokens[part], **args)  # [c, V]
                _chunk_statistics(
                    scaled, tokens[part], logp[part], lse[part], entropy[part] if with_entropy else None
                )
                del scaled  # before the next chunk's logits exist
        ctx.save_for_backward(h, w, b, tokens, lse, entropy if entropy_grad else None)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.args = args
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros: no work
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        h, w, b, tokens, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return (None,) * 10
        args, n = ctx.args, h.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None  # [M, H]
        accumulate = torch.promote_types(w.dtype, torch.float32)
        # The weight's gradient is summed over chunks in float32: as [V, H] on CUDA; on the CPU as
        # [H, V] = h^T @ grad, which keeps the chunk's gradient the untransposed operand (the CPU
        # matmul copies a transposed one: a second chunk of memory)
        transposed = need_w and not w.is_cuda
        grad_w = w.new_zeros(w.shape[::-1] if transposed else w.shape, dtype=accumulate) if need_w else None
        grad_b = None if b is None or not need_b else w.new_zeros(w.shape[0], dtype=accumulate)  # [V]
        device = h.device.type
        with torch.autocast(device, enabled=False):
            w_t = _transposed(w)  # [H, V]
            for start in range(0, n, args["chunk_tokens"]):
                part = slice(start, min(n, start + args["chunk_tokens"]))
                scaled = _scaled_logits(h[part], w_t, b, tokens[part], **args)  # [c, V] recomputed, not kept
                grad_logits = _chunk_logit_grads(
                    scaled, tokens[part], lse[part], None if grad_logp is None else grad_logp[part],
                    args["temperature"], None if grad_entropy is None else entropy[part],
                    None if grad_entropy is None else grad_entropy[part],
                )  # fmt: skip
                grad_logits = grad_logits.to(h.dtype)  # [c, V] in the compute dtype, as autograd casts it
                del scaled
                if need_h:
                    grad_h[part] = grad_logits @ w  # [c, H]
                if need_w:
                    left, right = (h[part].T, grad_logits) if transposed else (grad_logits.T, h[part])
                    if grad_w.dtype == grad_logits.dtype:
                        grad_w.addmm_(left, right)  # [H, V] or [V, H], in place
                    else:
                        grad_w += left @ right  # bf16 products summed in float32
                    del left, right  # they hold the chunk's gradient
                if grad_b is not None:
                    grad_b += grad_logits.sum(0).to(grad_b.dtype)
                del grad_logits
        if need_w:
            grad_w = (grad_w.T if transposed else grad_w).to(
                ctx.weight_dtype, memory_format=torch.contiguous_format
            )
        grad_h = None if grad_h is None else grad_h.to(ctx.hidden_dtype)
        grad_b = None if grad_b is None else grad_b.to(ctx.weight_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token) and the entropy [...] of the sampler's distribution at hidden states [..., H].

    Equal to `token_logprobs(hidden @ weight.T + bias, tokens, ...)` and `token_entropy(...)` (zeros
    unless `with_entropy`; with a gradient where `entropy_grad`, for an entropy term in the loss), with
    at most one chunk of `chunk_tokens` positions' logits alive at a time, forward and backward.
    """
    _check_temperature(temperature)
    shape = tokens.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [M, H]
    flat_ids = tokens.reshape(-1).long()  # [M]
    if flat_ids.numel() == 0:
        empty = flat_h.new_zeros(shape, dtype=torch.promote_types(flat_h.dtype, torch.float32))
        return empty + 0 * flat_h.sum(), empty + 0 * flat_h.sum() if entropy_grad else empty
    logp, entropy = _ChunkedHeadLogprobs.apply(
        flat_h, weight, bias, flat_ids, float(temperature), int(top_k), float(top_p),
        max(1, int(chunk_tokens)), bool(with_entropy or entropy_grad), bool(entropy_grad),
    )  # fmt: skip
    return logp.view(shape), entropy.view(shape)


# ---- inside a model's forward --------------------------------------------------------------------
class ScoringHead(torch.nn.Module):
    """Stands in for a model's output layer (`torch.nn.Linear`) during one forward: it returns the
    log-probs [n, t] of `targets` instead of logits [n, t, V], and keeps the entropies in
    `self.entropies`. `repeat`: each input row stands for that many target rows (a group's prompt run
    once for its K samples, `logprobs.shared_prompt_logits`)."""

    def __init__(
        self,
        linear: torch.nn.Linear,
        *,
        sampling_args: dict,
        chunk_tokens: int,
        with_entropy: bool,
        entropy_grad: bool = False,
    ):
        super().__init__()
        self.linear = linear
        self.sampling_args, self.chunk_tokens, self.with_entropy = sampling_args, chunk_tokens, with_entropy
        self.entropy_grad = entropy_grad
        self.targets: torch.Tensor | None = None  # [n, t] set before each call
        self.repeat = 1
        self.entropies: list[torch.Tensor] = []  # [n, t] of each call, in order

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.repeat > 1:
            hidden = hidden.repeat_interleave(self.repeat, dim=0)  # [n, t, H]
        logp, entropy = head_logprobs(
            hidden, self.linear.weight, self.targets, bias=self.linear.bias,
            chunk_tokens=self.chunk_tokens, with_entropy=self.with_entropy, entropy_grad=self.entropy_grad,
            **self.sampling_args,
        )  # fmt: skip
        self.entropies.append(entropy)
        return logp  # [n, t]


def output_layer(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.Linear] | None:
    """(parent, attribute name, layer) of the model's output layer where it is a plain linear layer
    (not a LoRA- or otherwise wrapped one); None where the scoring head cannot stand in for it."""
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    if type(layer) is not torch.nn.Linear:
        return None
    for name, module in model.named_modules():
        if module is layer:
            parent_name, _, attr = name.rpartition(".")
            return model.get_submodule(parent_name), attr, layer
    return None


@contextmanager
def scoring_head(
    model: torch.nn.Module,
    *,
    sampling_args: dict,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool = False,
):
    """The model with a `ScoringHead` in place of its output layer for the duration of the block."""
    parent, attr, layer = output_layer(model)
    head = ScoringHead(
        layer,
        sampling_args=sampling_args,
        chunk_tokens=chunk_tokens,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    setattr(parent, attr, head)
    try:
        yield head
    finally:
        setattr(parent, attr, layer)
