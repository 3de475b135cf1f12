"""A rollout step's statistics: the whole step's (every rank's) grades gathered, their summaries,
and the per-source ones of a task that mixes sources (`task=mix`, `task=reasoning_gym`)."""

from __future__ import annotations

import zlib

import torch

from loorl.algo.masked import masked_std
from loorl.parallel.distributed import gather_objects, gather_rows, is_distributed
from loorl.rewards import Graded
from loorl.types import Prompt


def rollout_stats(
    graded: Graded, lengths: torch.Tensor, finished: torch.Tensor, gen_seconds: float
) -> dict[str, float]:
    """The environment's statistics of a rollout (the reward mean is logged by the learner).
    `lengths` [B, K]: completion lengths; `finished` [B, K]: the completions that ended with EOS."""
    rewards = graded.rewards  # [B, K]
    scorable = ~rewards.isnan()  # [B, K]
    group_std = masked_std(rewards, scorable, dim=-1)  # [B] 0 with < 2 scorable
    parts = {f"rollout/reward_{name}": float(v.nanmean()) for name, v in graded.parts.items()}
    stats = {
        "rollout/reward_std": float(masked_std(rewards, scorable)),
        "rollout/accuracy": float(graded.correct.nanmean()),  # of the scorable samples
        "rollout/completion_len": float(lengths.mean()),
        **length_by_verdict(graded.correct, lengths),
        "rollout/gen_tokens": float(lengths.sum()),  # the step's generated tokens (all ranks)
        "rollout/samples": float(lengths.numel()),  # the step's sampled completions (all ranks)
        "rollout/truncated_frac": float((~finished).float().mean()),
        "rollout/zero_std_group_frac": float((group_std == 0).float().mean()),
        "rollout/unscorable": float(graded.unscorable),
        "perf/gen_seconds": gen_seconds,
        **(parts if len(parts) > 1 else {}),
    }
    return stats | {"perf/gen_tokens_per_s": gen_tokens_per_s(stats)}


def gen_tokens_per_s(stats: dict[str, float]) -> float:
    """The step's generation throughput: every token generated in `perf/gen_seconds`, ReMax's greedy
    completions (`rollout/greedy_gen_tokens`, drawn in the same call or a second one) included."""
    tokens = stats["rollout/gen_tokens"] + stats.get("rollout/greedy_gen_tokens", 0.0)
    return tokens / max(stats["perf/gen_seconds"], 1e-9)


def length_by_verdict(correct: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """The mean completion length of the correct and of the wrong samples (`correct` [B, K]: 1, 0 or
    NaN for unscorable, left out of both); a key is absent when no sample has that verdict. Dr. GRPO's
    claim is about the second: per-sequence normalisation lets wrong answers grow long."""
    stats = {}
    for name, verdict in (("correct", 1.0), ("wrong", 0.0)):
        chosen = correct == verdict  # [B, K]
        if chosen.any():
            stats[f"rollout/completion_len_{name}"] = float(lengths[chosen].float().mean())
    return stats


def prompt_digest(prompts: list[Prompt]) -> float:
    """A fingerprint of the step's prompts, every rank's in rank order: two runs whose digests agree at
    every step drew the same prompts in the same order (the study checks its seeds are paired with it).
    A 24-bit CRC, so that it survives logging as float32 exactly. A collective."""
    texts = gather_objects([p.text for p in prompts])  # [W][B/W]
    return float(zlib.crc32("\x1e".join(t for rank in texts for t in rank).encode()) & 0xFFFFFF)


def gather_graded(
    graded: Graded, lengths: torch.Tensor, finished: torch.Tensor
) -> tuple[Graded, torch.Tensor, torch.Tensor]:
    """The whole step's grades, lengths and EOS flags (every rank's groups, in rank order), so that its
    statistics are those of all B groups, not means of per-rank statistics. One all-gather."""
    if not is_distributed():
        return graded, lengths, finished
    names = list(graded.parts)
    columns = [graded.rewards, graded.correct.float(), lengths.float(), finished.float()]
    every = gather_rows(torch.stack(columns + [graded.parts[n] for n in names], dim=-1))  # [W*B, K, F]
    rewards, correct, lengths, finished = every[..., 0], every[..., 1], every[..., 2], every[..., 3].bool()
    parts = {n: every[..., 4 + i] for i, n in enumerate(names)}
    return Graded(rewards, correct, int(rewards.isnan().sum()), parts), lengths, finished


def source_index(prompts: list[Prompt], names: list[str]) -> torch.Tensor:
    """[W*B] each prompt's source, as its index in `names`, over every rank's prompts (rank order)."""
    return gather_rows(torch.tensor([names.index(p.meta["source"]) for p in prompts]))


def source_stats(index: torch.Tensor, graded: Graded, names: list[str]) -> dict[str, float]:
    """Per-source reward and accuracy of a mixed-source step. `index` [W*B]: `source_index`;
    `graded`: the whole step's (every rank's prompts, in rank order)."""
    stats = {}
    for i, name in enumerate(names):
        rows = index == i  # [W*B]
        if rows.any():
            stats[f"rollout/reward/{name}"] = float(graded.rewards[rows].nanmean())
            stats[f"rollout/accuracy/{name}"] = float(graded.correct[rows].nanmean())
    return stats


def source_outcomes(index: torch.Tensor, graded: Graded, names: list[str]) -> dict[str, list[int]]:
    """Each source's samples of the whole step as 1 (correct) or 0, in rank, prompt and sample order;
    unscorable samples are left out. The same on every rank. `index` [W*B]: `source_index`."""
    out = {}
    for i, name in enumerate(names):
        verdicts = graded.correct[index == i].flatten()  # [n_i * K]
        out[name] = [int(v) for v in verdicts[~verdicts.isnan()].tolist()]
    return out
