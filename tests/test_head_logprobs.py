"""Log-probs from hidden states in chunks (`loorl.algo.head_logprobs`) against the plain path over
the whole logits (`token_logprobs`, `token_entropy`): values and gradients of the hidden states,
the output weights and bias, for every truncation the sampler applies."""

from __future__ import annotations

import pytest
import torch

from loorl.algo.head_logprobs import head_logprobs
from loorl.algo.logprobs import token_entropy, token_logprobs

CASES = {  # sampler settings: temperature, top-k, top-p
    "plain": {},
    "temperature": {"temperature": 0.7},
    "top_k": {"temperature": 1.3, "top_k": 5},
    "top_p": {"temperature": 0.8, "top_p": 0.6},
    "top_k_top_p": {"top_k": 7, "top_p": 0.9},
}


def _inputs(*, n=3, t=5, h=16, v=37, dtype=torch.float32, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, h, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(v, generator=gen, dtype=dtype) * 0.1).requires_grad_() if bias else None
    tokens = torch.randint(v, (n, t), generator=gen)  # [n, t]
    return hidden, weight, b, tokens


def _reference(hidden, weight, bias, tokens, **sampling):
    logits = hidden @ weight.T + (0 if bias is None else bias)  # [n, t, V]
    logp = token_logprobs(logits, tokens, **sampling)  # [n, t]
    entropy = token_entropy(logits.detach(), tokens=tokens, **sampling)  # [n, t]
    return logp, entropy


def _grads(fn, params, upstream):
    for p in params:
        p.grad = None
    (fn() * upstream).sum().backward()
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk_tokens", [1, 4, 15, 1000])  # 15 tokens in chunks of 4: a ragged last chunk
def test_values_and_gradients_equal_the_plain_path(case, chunk_tokens):
    sampling = CASES[case]
    hidden, weight, bias, tokens = _inputs()
    want_logp, want_entropy = _reference(hidden, weight, bias, tokens, **sampling)
    logp, entropy = head_logprobs(
        hidden, weight, tokens, bias=bias, chunk_tokens=chunk_tokens, with_entropy=True, **sampling
    )
    torch.testing.assert_close(logp, want_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-6, atol=1e-6)
    assert not entropy.requires_grad
    upstream = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))  # [n, t]
    params = [hidden, weight, bias]
    want = _grads(lambda: _reference(hidden, weight, bias, tokens, **sampling)[0], params, upstream)
    got = _grads(
        lambda: head_logprobs(hidden, weight, tokens, bias=bias, chunk_tokens=chunk_tokens, **sampling)[0],
        params,
        upstream,
    )
    for name, g, w in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"d/d{name}")


def test_a_sampled_token_outside_the_filter_keeps_a_finite_logprob_and_its_gradient():
    """The sampler drew a token that the trainer's top-k would cut (a kernel difference moved it
    across): it stays in the set, exactly as the plain path keeps it."""
    hidden, weight, bias, tokens = _inputs(v=11)
    logits = hidden @ weight.T + bias  # [n, t, V]
    tokens = logits.argsort(-1)[..., 0].detach()  # [n, t] the least likely entry everywhere
    want, _ = _reference(hidden, weight, bias, tokens, top_k=2)
    got, _ = head_logprobs(hidden, weight, tokens, bias=bias, top_k=2, chunk_tokens=4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    g_want = torch.autograd.grad(want.sum(), weight)[0]
    g_got = torch.autograd.grad(got.sum(), weight)[0]
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)


def test_float64_gradcheck():
    hidden, weight, bias, tokens = _inputs(n=2, t=3, h=4, v=9, dtype=torch.float64)

    def fn(h, w, b):
        return head_logprobs(h, w, tokens, bias=b, temperature=0.9, top_k=6, chunk_tokens=4)[0]

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk_tokens", [1, 4, 1000])
def test_the_entropy_gradient_equals_the_plain_path_in_float64(case, chunk_tokens):
    """`entropy_grad=True` (an entropy term in the loss): the entropy's value and its gradient, alone
    and mixed with the log-probs' (as a loss `-A log p - c H` has them), equal the plain path's over
    the whole [n, t, V] logits to 1e-10, with no [n, t, V] tensor kept."""
    sampling = CASES[case]
    hidden, weight, bias, tokens = _inputs(dtype=torch.float64, seed=2)
    params = [hidden, weight, bias]
    gen = torch.Generator().manual_seed(3)
    up_logp, up_h = (
        torch.randn(tokens.shape, generator=gen, dtype=torch.float64),
        torch.randn(tokens.shape, generator=gen, dtype=torch.float64),
    )  # [n, t] each

    def plain(mix):
        logits = hidden @ weight.T + bias  # [n, t, V]
        logp = token_logprobs(logits, tokens, **sampling)
        return logp * up_logp * mix + token_entropy(logits, tokens=tokens, **sampling) * up_h

    def chunked(mix):
        logp, h = head_logprobs(
            hidden, weight, tokens, bias=bias, chunk_tokens=chunk_tokens, entropy_grad=True, **sampling
        )
        return logp * up_logp * mix + h * up_h

    for mix in (0.0, 1.0):  # the entropy's gradient alone, then with the log-probs'
        want = _grads(lambda mix=mix: plain(mix), params, torch.ones_like(up_h))
        got = _grads(lambda mix=mix: chunked(mix), params, torch.ones_like(up_h))
        for name, g, w in zip(("hidden", "weight", "bias"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"d/d{name} (mix {mix})")
    _, h = head_logprobs(
        hidden, weight, tokens, bias=bias, chunk_tokens=chunk_tokens, entropy_grad=True, **sampling
    )
    torch.testing.assert_close(
        h, token_entropy(hidden @ weight.T + bias, tokens=tokens, **sampling), rtol=1e-12, atol=1e-12
    )
    assert h.requires_grad


def test_the_entropy_float64_gradcheck():
    hidden, weight, bias, tokens = _inputs(n=2, t=3, h=4, v=9, dtype=torch.float64, seed=4)

    def fn(h, w, b):
        logp, entropy = head_logprobs(
            h, w, tokens, bias=b, temperature=0.9, top_k=6, chunk_tokens=4, entropy_grad=True
        )
        return logp + 0.5 * entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_bf16_autocast_matches_the_plain_path_under_autocast():
    """Under bf16 autocast the output layer's matmul runs in bf16 (as `nn.Linear` would) and the
    log-probs in float32: the values and gradients agree with the plain path run the same way to
    bf16 rounding (the tolerance the precision tests use)."""
    hidden, weight, _, tokens = _inputs(n=4, t=6, h=32, v=101, bias=False)
    upstream = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(2))

    def plain():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = torch.nn.functional.linear(hidden, weight)  # [n, t, V] bf16
        return token_logprobs(logits, tokens, temperature=0.7)

    def chunked():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return head_logprobs(hidden, weight, tokens, temperature=0.7, chunk_tokens=5)[0]

    want, got = plain(), chunked()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    g_want = _grads(plain, [hidden, weight], upstream)
    g_got = _grads(chunked, [hidden, weight], upstream)
    for g, w in zip(g_got, g_want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def _tracked_peak(fn) -> float:
    """The peak of live tensor bytes on the CPU while `fn` runs, from torch's own memory tracker
    (a dispatch mode that follows every storage; the CPU has no allocator statistics)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("rows", [2, pytest.param(16, marks=pytest.mark.slow)])
def test_the_extra_peak_is_a_chunk_not_the_batch(rows):
    """A rows x 512 pass (2 x 512: 4 chunks, whose logits at once would be twice the bound; 16 x 512 is
    slow: 40 s) over a 151,936-entry vocabulary (Qwen2.5's),
    measured with torch's memory tracker: a no-grad scoring pass (reference, old policy) stays
    under 2 chunks' float32 logits, top-p included; a training pass's forward and backward too,
    beyond its weight-sized buffers (the weight's gradient and the transposed copy the CPU matmul
    wants). The plain path's logits alone are 16 x 512 x 151,936 x 4 bytes = 4.6 GiB."""
    v, h, chunk = 151_936, 64, 256
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows * 512, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.1).requires_grad_()
    tokens = torch.randint(v, (rows * 512,), generator=gen)
    chunk_logits, weight_bytes = chunk * v * 4, weight.numel() * 4

    def score(**sampling):
        with torch.no_grad():
            head_logprobs(hidden, weight, tokens, chunk_tokens=chunk, with_entropy=True, **sampling)

    def train():
        logp, _ = head_logprobs(
            hidden, weight, tokens, temperature=0.7, chunk_tokens=chunk, with_entropy=True
        )
        logp.sum().backward()

    for sampling in ({"temperature": 0.7}, {"temperature": 0.7, "top_k": 50, "top_p": 0.9}):
        peak = _tracked_peak(lambda s=sampling: score(**s))
        assert peak < 2 * chunk_logits, f"{sampling}: {peak / 2**20:.0f} MiB"
    peak = _tracked_peak(train) - 2 * weight_bytes
    assert peak < 2 * chunk_logits, f"training: {peak / 2**20:.0f} MiB beyond the weight-sized buffers"
