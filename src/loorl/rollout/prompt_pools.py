"""Pass-rate prompt pools (`rl.prompt_pools`): spend a step's samples on the prompts that still teach.

Each prompt's pass rate (or, for a procedural task, each difficulty level's: `Task.pass_rate_key`) is
kept from the steps that sampled it. A key whose groups were all right is *easy*, all wrong *hard*,
anything between (or never seen) *normal* (prime-rl's difficulty pools); a key whose pass rate reaches
`retire_at` is *retired* and never drawn again (ScaleRL's rule for prompts solved 90% of the time).
A step draws `candidates` x B prompts from the task with its usual seeded draw, sorts them into the
pools and fills its B slots one at a time: a pool picked by `weights` among the pools that still have
candidates, then that pool's next candidate.

Everything is a pure function of (run seed, step, round, the pools' state), the state is plain values
in every checkpoint, and the pools are updated from every rank's groups in rank order, so every rank
and a resumed run draw the same prompts. Written by hand: prime-rl's buffer is tied to its
orchestrator and its datasets, and no library keeps pass rates for procedurally generated prompts.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

from loorl.parallel.distributed import gather_rows
from loorl.rollout.dynamic_sampling import verdicts
from loorl.types import RolloutBatch

POOLS = ("easy", "normal", "hard")
_POOLS_STREAM = zlib.crc32(b"prompt_pools")  # keeps the pools' choices apart from the task's draw


class PromptPools:
    """The pools of one run. `settings`: `rl.prompt_pools` (`PromptPoolSettings`)."""

    def __init__(self, settings) -> None:
        self.s = settings
        self.records: dict[str, list[float]] = {}  # key -> [right, scored], decayed at each observation
        self.retired: set[str] = set()

    # ---- what a key is ---------------------------------------------------------------------------
    def pass_rate(self, key: str) -> float | None:
        right, scored = self.records.get(key, (0.0, 0.0))
        return right / scored if scored > 0 else None

    def pool_of(self, key: str) -> str:
        """retired | easy | normal | hard; a key never scored is normal."""
        if key in self.retired:
            return "retired"
        rate = self.pass_rate(key)
        if rate is None:
            return "normal"
        if rate >= self.s.easy_at:
            return "easy"
        return "hard" if rate <= self.s.hard_at else "normal"

    # ---- drawing -------------------------------------------------------------------------------
    def choose(
        self, keys: Sequence[str], n: int, *, seed: int, step: int, round: int
    ) -> tuple[list[int], dict[str, float]]:
        """The indices of the `n` candidates (given by their pass-rate `keys`) the step trains on, and
        what to log of the choice. A slot takes the next candidate of a pool drawn by `weights` among
        the pools with candidates left (a pool of weight 0 only once the others are empty); retired
        candidates only when nothing else is left (counted as `pools/retired_drawn`). With
        `grow_groups` G > 1 a hard candidate takes G slots in a row (its K grown G-fold; `merge_ids`
        makes them one group for the estimator), until the extra slots reach `grow_budget` of the
        step's (`pools/grown_groups`)."""
        queues: dict[str, list[int]] = {p: [] for p in (*POOLS, "retired")}
        for i, key in enumerate(keys):
            queues[self.pool_of(key)].append(i)
        rng = np.random.default_rng([seed, step, round, _POOLS_STREAM])
        weights = dict(zip(POOLS, (self.s.weights.easy, self.s.weights.normal, self.s.weights.hard)))
        chosen, drawn = [], dict.fromkeys((*POOLS, "retired"), 0)
        extra = int(self.s.grow_budget * n) if self.s.grow_groups > 1 else 0  # slots grown groups may take
        grown = 0
        while len(chosen) < n and any(queues.values()):
            open_pools = [p for p in POOLS if queues[p]]
            if not open_pools:
                pool = "retired"  # nothing else left: a retired prompt rather than a short step
            else:
                w = np.array([weights[p] for p in open_pools], dtype=np.float64)
                w = w / w.sum() if w.sum() > 0 else np.full(len(open_pools), 1 / len(open_pools))
                pool = open_pools[int(rng.choice(len(open_pools), p=w))]
            chosen.append(queues[pool].pop(0))
            drawn[pool] += 1
            if pool == "hard" and extra:  # its K grown: more groups of it, next to each other
                more = min(self.s.grow_groups - 1, extra, n - len(chosen))
                chosen += [chosen[-1]] * more
                extra, grown = extra - more, grown + more
        stats = {f"pools/drawn_{p}": float(drawn[p]) for p in POOLS}
        stats["pools/retired_drawn"] = float(drawn["retired"])
        stats["pools/grown_groups"] = float(grown)
        return chosen, stats

    # ---- learning the pass rates ---------------------------------------------------------------
    def observe(
        self, keys: Sequence[str], right: Sequence[float], scored: Sequence[float]
    ) -> dict[str, float]:
        """Every rank's groups of a round (`keys` [G], their right and scored samples [G]): each key's
        record decays by `decay` and adds its groups' counts; a key at or above `retire_at` (with at
        least `retire_after` scored samples behind it) retires. Returns the pools' sizes to log."""
        step_counts: dict[str, list[float]] = {}
        for key, r, n in zip(keys, right, scored):
            total = step_counts.setdefault(key, [0.0, 0.0])
            total[0], total[1] = total[0] + float(r), total[1] + float(n)
        for key, (r, n) in step_counts.items():
            old = self.records.get(key, [0.0, 0.0])
            self.records[key] = [self.s.decay * old[0] + r, self.s.decay * old[1] + n]
            rate = self.pass_rate(key)
            if (self.s.retire_at is not None and rate is not None and rate >= self.s.retire_at
                    and self.records[key][1] >= self.s.retire_after):  # fmt: skip
                self.retired.add(key)
        sizes = dict.fromkeys(POOLS, 0)
        for key in self.records:
            pool = self.pool_of(key)
            if pool in sizes:
                sizes[pool] += 1
        return {f"pools/{p}": float(v) for p, v in sizes.items()} | {
            "pools/retired": float(len(self.retired))
        }

    # ---- the run's state -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"records": {k: list(v) for k, v in self.records.items()}, "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        self.records = {k: [float(x) for x in v] for k, v in state.get("records", {}).items()}
        self.retired = set(state.get("retired", []))


def merge_ids(chosen: Sequence[int]) -> list[int]:
    """Each slot's merged group: the first of the step's slots holding the same candidate (a grown
    prompt's groups are one group of G x K samples for the estimator; global slots, so a grown prompt
    whose slots fall on two ranks is still one group once the learner gathers every rank's ids)."""
    first: dict[int, int] = {}
    return [first.setdefault(c, slot) for slot, c in enumerate(chosen)]


def group_counts(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's groups' right and scored samples ([W*B] each, in rank and group order) from the
    verifier's verdicts (`batch.correct`: 1, 0, NaN where it gave none). A collective."""
    correct = verdicts(batch)  # [B, K]
    scored = ~correct.isnan()  # [B, K]
    local = torch.stack([torch.where(scored, correct, 0.0).sum(-1), scored.sum(-1).float()], dim=-1)  # [B, 2]
    every = gather_rows(local)  # [W*B, 2]
    return every[:, 0], every[:, 1]
