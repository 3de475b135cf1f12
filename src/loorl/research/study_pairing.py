"""A study's paired seeds, checked on its runs' own `rollout/prompt_digest` histories: run i of every
setting drew the same prompts at every step (pairing: prompts), and two seeds drew other prompts."""

from __future__ import annotations


def digests(history: dict) -> dict[int, float]:
    return {int(step): value for step, value in history.get("rollout/prompt_digest", [])}


def check_pairing(
    runs: dict[str, dict[int, dict]], prompts_per_step: dict[str, int], *, pairing: str = "prompts"
) -> list[str]:
    """From the runs' own `rollout/prompt_digest` histories (`runs`: label -> seed -> history): settings
    that draw the same number of prompts per step must have drawn the same prompts at every step for
    each seed, and two seeds must differ. With `pairing="seeds"` (settings that train on other problems
    by design, such as other levels) only the seeds must differ. Returns the finding per group as
    lines; raises ValueError on a broken pairing."""
    if pairing == "seeds":
        return [seeds_differ(runs)]
    lines = []
    groups: dict[int, list[str]] = {}
    for label, b in prompts_per_step.items():
        groups.setdefault(b, []).append(label)
    for b, labels in groups.items():
        seeds = sorted({s for label in labels for s in runs.get(label, {})})
        for seed in seeds:
            have = {label: digests(runs[label][seed]) for label in labels if seed in runs.get(label, {})}
            first_label, first = next(iter(have.items()))
            if not first:
                raise ValueError(
                    f"seed {seed}, {first_label}: no rollout/prompt_digest logged (a run from before it?)"
                )
            for label, d in have.items():
                common = sorted(set(first) & set(d))
                bad = [s for s in common if first[s] != d[s]]
                if bad or not common:
                    raise ValueError(
                        f"seed {seed}: {label!r} drew other prompts than {first_label!r} at step "
                        f"{bad[0] if bad else '(none in common)'}: the seeds are not paired"
                    )
        if len(seeds) > 1:
            label = next((lb for lb in labels if {seeds[0], seeds[1]} <= set(runs.get(lb, {}))), None)
            if label:
                check_seeds_differ(label, runs[label], seeds[:2])
        lines.append(
            f"{len(labels)} setting(s) with {b} prompts per step: for each of seeds {seeds}, every run drew "
            "the same prompts in the same order at every step (rollout/prompt_digest); the seeds differ."
        )
    return lines


def check_seeds_differ(label: str, by_seed: dict[int, dict], seeds: list[int]) -> None:
    """Raise where `label`'s runs of two `seeds` drew the same prompts at their first step: the seed did
    not reach the sampler (two seeds' first 96 prompts never coincide by chance)."""
    first = [digests(by_seed[s]) for s in seeds]
    if not all(first):
        raise ValueError(f"{label!r}: no rollout/prompt_digest logged (a run from before it?)")
    if first[0][min(first[0])] == first[1][min(first[1])]:
        raise ValueError(f"{label!r}: seeds {seeds[0]} and {seeds[1]} drew the same prompts")


def seeds_differ(runs: dict[str, dict[int, dict]]) -> str:
    """The finding of a part paired by seed only: within every setting, two seeds drew other prompts at
    their first step (the seed reached the sampler). Raises ValueError where they did not."""
    for label, by_seed in runs.items():
        if len(by_seed) >= 2:
            check_seeds_differ(label, by_seed, sorted(by_seed)[:2])
    return (
        "run i of every setting has RL seed i and the same starting policy; the settings train on other "
        "problems by design (pairing: seeds), and within each setting the seeds drew other prompts "
        "(rollout/prompt_digest)."
    )
