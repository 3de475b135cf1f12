"""Exact expected gradient of every KL placement x estimator, against the gradients of the two KLs.

No sampling: a tiny autoregressive policy over V tokens and T positions, whose logits are free
parameters (position 1: theta_1 [V]; position t > 1: theta_t [V, V], a row per previous token),
and a fixed reference of the same form. All V**T sequences are enumerated, so every expectation
over y ~ pi is an exact sum weighted by pi(y), detached (the sample is fixed, as in the trainer).
The penalty terms are computed with the trainer's own functions:

  loss term (kl.in_reward=false):  E_{y~pi}[ grad sum_t kl_per_token(log pi_t(y), log ref_t(y)) ]
  reward term (kl.in_reward=true): reward r(y) = -sum_t kl_t(y) (no gradient) through
                                   reinforce_token_loss: E_{y~pi}[ -r(y) grad log pi(y) ]

and compared with autograd on the exact sequence-level KL(pi||ref) and reverse KL(ref||pi), and
on their per-token forms sum_t E_{y<t ~ pi}[KL_t(.|y<t)] with the prefix weights detached (what a
per-token loss term can reach: it does not see how a token changes the later tokens' KL).

Run: python scripts/research/kl_gradient_table.py   (prints a markdown table)
"""

from __future__ import annotations

import itertools

import torch

from loorl.algo.kl import check_kl_placement, kl_per_token
from loorl.algo.objectives import reinforce_token_loss
from loorl.errors import ConfigError

ESTIMATORS = ("k1", "k2", "k3")
PLACEMENTS = ("reward", "loss")
# (name, V, T, reference seed, reference logit scale): near = ref a small perturbation of pi
SETTINGS = (("near", 4, 2, 1, 0.3), ("far", 4, 2, 2, 3.0), ("far", 4, 1, 2, 3.0))


def random_logits(seed: int, vocab: int, length: int, scale: float = 1.0) -> list[torch.Tensor]:
    """[theta_1 [V], theta_2 [V, V], ..., theta_T [V, V]] in float64."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(vocab,)] + [(vocab, vocab)] * (length - 1)
    return [scale * torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]


def perturbed(params: list[torch.Tensor], seed: int, scale: float) -> list[torch.Tensor]:
    """params + scale * noise (detached): a reference near (small scale) or far from the policy."""
    noise = random_logits(seed, params[0].shape[0], len(params))
    return [p.detach() + scale * n for p, n in zip(params, noise)]


def all_sequences(vocab: int, length: int) -> torch.Tensor:
    """Every sequence [V**T, T]."""
    return torch.tensor(list(itertools.product(range(vocab), repeat=length)), dtype=torch.long)


def step_logprobs(params: list[torch.Tensor], seqs: torch.Tensor) -> torch.Tensor:
    """log p(. | prefix) [N, T, V] at every position of every sequence."""
    n = seqs.shape[0]
    out = [torch.log_softmax(params[0], -1).expand(n, -1)]  # [N, V]
    for t in range(1, seqs.shape[1]):
        out.append(torch.log_softmax(params[t], -1)[seqs[:, t - 1]])  # [N, V]
    return torch.stack(out, dim=1)  # [N, T, V]


def token_logprobs(params: list[torch.Tensor], seqs: torch.Tensor) -> torch.Tensor:
    """log p(y_t | y_<t) [N, T]."""
    return step_logprobs(params, seqs).gather(-1, seqs.unsqueeze(-1)).squeeze(-1)


def flat_grad(value: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, params, retain_graph=True)])


def kl_gradients(params: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Exact gradients: sequence-level KL(pi||ref), KL(ref||pi), and their per-token forms."""
    seqs = all_sequences(params[0].shape[0], len(params))
    logp, ref_logp = token_logprobs(params, seqs).sum(-1), token_logprobs(ref, seqs).sum(-1)  # [N]
    fwd = (logp.exp() * (logp - ref_logp)).sum()
    rev = (ref_logp.exp() * (ref_logp - logp)).sum()
    # per position: the full next-token distributions given each sequence's prefix
    step, ref_step = step_logprobs(params, seqs), step_logprobs(ref, seqs)  # [N, T, V]
    weight = logp.exp().detach()  # [N] pi(y), the prefix weights held fixed
    fwd_tok = (weight * (step.exp() * (step - ref_step)).sum((-1, -2))).sum()
    rev_tok = (weight * (ref_step.exp() * (ref_step - step)).sum((-1, -2))).sum()
    return {
        "KL(pi||ref)": flat_grad(fwd, params),
        "KL(ref||pi)": flat_grad(rev, params),
        "per-token KL(pi||ref)": flat_grad(fwd_tok, params),
        "per-token KL(ref||pi)": flat_grad(rev_tok, params),
    }


def penalty_gradient(
    params: list[torch.Tensor], ref: list[torch.Tensor], estimator: str, in_reward: bool
) -> torch.Tensor:
    """Exact expected gradient of the KL penalty (coef 1) as the trainer computes it."""
    seqs = all_sequences(params[0].shape[0], len(params))
    logp = token_logprobs(params, seqs)  # [N, T]
    ref_logp = token_logprobs(ref, seqs).detach()  # [N, T]
    weight = logp.sum(-1).exp().detach()  # [N] pi(y): the sample is fixed
    if in_reward:  # the rollout's logprobs, no gradient: -coef * sum_t kl_t joins the reward
        reward = -kl_per_token(logp.detach(), ref_logp, estimator=estimator).sum(-1)  # [N]
        per_seq = reinforce_token_loss(logp, reward).sum(-1)  # [N] -r * log pi(y)
    else:  # coef * kl_t added to each token's loss
        per_seq = kl_per_token(logp, ref_logp, estimator=estimator).sum(-1)  # [N]
    return flat_grad((weight * per_seq).sum(), params)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def rel_error(a: torch.Tensor, target: torch.Tensor) -> float:
    return float((a - target).norm() / target.norm())


def accepted(estimator: str, in_reward: bool) -> bool:
    try:
        check_kl_placement(estimator, in_reward)
    except ConfigError:
        return False
    return True


# the KL each accepted combination's gradient belongs to (refused ones: measured against KL(pi||ref))
TARGETS = {("reward", "k1"): "KL(pi||ref)", ("loss", "k2"): "KL(pi||ref)", ("loss", "k3"): "KL(ref||pi)"}


def table_rows(settings=SETTINGS) -> list[dict]:
    rows = []
    for name, vocab, length, ref_seed, ref_scale in settings:
        params = [p.requires_grad_() for p in random_logits(0, vocab, length)]
        ref = perturbed(params, ref_seed, ref_scale)
        kls = kl_gradients(params, ref)
        for placement, estimator in itertools.product(PLACEMENTS, ESTIMATORS):
            in_reward = placement == "reward"
            grad = penalty_gradient(params, ref, estimator, in_reward)
            target = TARGETS.get((placement, estimator), "KL(pi||ref)")
            rows.append(
                {
                    "setting": f"{name} (V={vocab}, T={length})",
                    "placement": placement,
                    "estimator": estimator,
                    "cos_fwd": cosine(grad, kls["KL(pi||ref)"]),
                    "cos_rev": cosine(grad, kls["KL(ref||pi)"]),
                    "target": target,
                    "err_seq": rel_error(grad, kls[target]),
                    "err_tok": rel_error(grad, kls[f"per-token {target}"]),
                    "norm": float(grad.norm()),
                    "accepted": accepted(estimator, in_reward),
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    head = (
        "| setting | placement | estimator | cos vs grad KL(pi\\|\\|ref) | cos vs grad KL(ref\\|\\|pi) "
        "| compared with | rel. error (sequence KL) | rel. error (per-token KL) | check_kl_placement |"
    )
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        target = r["target"].replace("|", "\\|")
        lines.append(
            f"| {r['setting']} | {r['placement']} | {r['estimator']} | {r['cos_fwd']:+.4f} "
            f"| {r['cos_rev']:+.4f} | {target} | {r['err_seq']:.2e} | {r['err_tok']:.2e} "
            f"| {'accepted' if r['accepted'] else 'refused'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(table_rows()))
