"""Bounded staleness (`rollout.max_staleness=N`, N >= 1; N=1 is one step off): the rollouts of the next
N steps, asked for with older weights while the trainer trains, and kept until their step.

`SampleAhead` owns them (`pending`) and their part of the checkpoint: a resume trains on the rollouts
the interrupted run had sampled ahead. A rollout sampled ahead is graded when it is received, and
observed by the task (`Task.observe`: a curriculum) only when its step takes it to train on: one
dropped for staleness is never observed, its replacement is.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from loorl.errors import ConfigError
from loorl.parallel.distributed import all_reduce, gather_objects, rank_and_world
from loorl.rollout.grading import Outcomes
from loorl.rollout.sampling import StepSampler
from loorl.types import Completion, Prompt, Rollout, RolloutBatch


def rollout_to_dict(rollout: Rollout) -> dict:
    """A rollout as plain values (tensors, numbers, strings), for a checkpoint."""
    return {"step": rollout.step, "policy_version": rollout.policy_version, "stats": dict(rollout.stats),
            "batch": {f.name: getattr(rollout.batch, f.name) for f in fields(rollout.batch)}}  # fmt: skip


def rollout_from_dict(d: dict) -> Rollout:
    return Rollout(d["step"], RolloutBatch(**d["batch"]), dict(d["stats"]), d["policy_version"])


@dataclass(frozen=True)
class Submitted:
    """A rollout the engine was asked for (`RolloutEngine.submit`) and has not yet answered."""

    step: int
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    policy_version: int
    ticket: int = 0  # the engine's handle on the request (`RolloutEngine.receive`)


@dataclass
class Received:
    """A rollout sampled ahead and graded, not yet trained on. `outcomes`: what the task observes when
    its step trains on it; None for one a checkpoint written before outcomes were kept holds (its task
    state had observed it)."""

    rollout: Rollout
    outcomes: Outcomes | None


def lagged(rollout: Rollout, policy_version: int, groups: list[list[Completion]] | None = None) -> Rollout:
    """`rollout`, marked as sampled by the weights of step `policy_version` (its lag logged). An engine
    that reports each sample's own oldest version (`Completion.version`: a server whose weights were
    updated while it sampled) moves the rollout's version to the oldest of them; the samples' lags are
    counted (`staleness/samples_lag_<k>`) and the samples that span two versions."""
    samples = [c for g in groups for c in g] if groups is not None else []
    versions = [policy_version if c.version is None else c.version for c in samples]
    if not samples:  # sampled here: every sample with these weights
        versions = [policy_version] * (rollout.batch.num_groups * rollout.batch.samples_per_prompt)
    rollout.policy_version = min(versions)
    rollout.stats["rollout/policy_lag"] = float(rollout.policy_lag)
    for lag in sorted({rollout.step - v for v in versions}):  # this rank's samples by their lag
        rollout.stats[f"staleness/samples_lag_{lag}"] = float(sum(rollout.step - v == lag for v in versions))
    rollout.stats["staleness/spanning_samples"] = float(sum(c.spans_versions for c in samples))
    return rollout


class SampleAhead:
    """The rollouts sampled ahead for the steps after this one, by step: `Submitted` while the engine
    samples them, `Received` once graded. `max_staleness`: N; `steps`: the run's (none asked for past
    its last)."""

    def __init__(self, sampler: StepSampler, *, max_staleness: int, steps: int) -> None:
        self.sampler, self.max_staleness, self.steps = sampler, max_staleness, steps
        self.pending: dict[int, Submitted | Received] = {}

    def take(self, step: int) -> Rollout:
        """Step `step`'s rollout: the one asked for N steps before, with the weights of that step (N
        policy versions old; fewer in the first N steps), observed by the task now. The first step has
        nothing older and samples its own (lag 0). A rollout older than N versions (a checkpoint's,
        resumed with a smaller N) is dropped unobserved, counted (`staleness/dropped_samples`) and
        sampled again with this step's weights. A collective: every rank calls it."""
        current = self.pending.pop(step, None)
        if isinstance(current, Submitted):
            current = self._receive(current)
        dropped = 0
        if current is not None and current.rollout.policy_lag > self.max_staleness:
            dropped = current.rollout.batch.num_groups * current.rollout.batch.samples_per_prompt
            current = None
        if current is None:  # the first step (or a resume without a rollout ahead): its own, lag 0, sampled
            rollout = lagged(self.sampler.sample_round(step), step)  # here while a sampler process starts up
        elif current.outcomes is None:  # observed before its checkpoint was written
            rollout = current.rollout
        else:
            rollout = self.sampler.observed(current.rollout, current.outcomes)
        rollout.stats["staleness/dropped_samples"] = float(all_reduce(dropped))
        return rollout

    def ask_ahead(self, step: int) -> None:
        """Ask for the rollouts of steps `step + 1` .. `step + max_staleness` not yet asked for, with this
        step's weights; an engine that holds fewer requests at once (`max_in_flight`: a sampler process
        holds one) has its oldest received first."""
        last = min(step + self.max_staleness, self.steps - 1)
        for ahead in range(step + 1, last + 1):
            if ahead in self.pending:
                continue
            asked = sorted(s for s, p in self.pending.items() if isinstance(p, Submitted))
            if len(asked) >= self.sampler.engine.max_in_flight:
                self.pending[asked[0]] = self._receive(self.pending[asked[0]])
            self.pending[ahead] = self._submit(ahead, policy_version=step)

    def _submit(self, step: int, *, policy_version: int) -> Submitted:
        """Start sampling step `step`'s rollout with the engine's current weights (those of step
        `policy_version`): in the background where the engine has a process of its own."""
        sampler = self.sampler
        prompts = sampler.prompts_for_step(step)
        prompt_ids = sampler.encode_prompts(prompts)
        with sampler.precision():
            seed = sampler.sampler_seed("rollout", step)
            k = sampler.rl.samples_per_prompt
            ticket = sampler.engine.submit(prompt_ids, n=k, seed=seed, **sampler.rows(prompts))
        return Submitted(step, prompts, prompt_ids, policy_version, ticket)

    def _receive(self, submitted: Submitted) -> Received:
        """The rollout `submitted`, graded (not yet observed). Sampled in the background, its
        `perf/gen_seconds` is how long the trainer waited for it, `perf/sampler_gen_seconds` the
        sampler's."""
        engine = self.sampler.engine
        groups, gen_seconds = engine.receive(submitted.ticket)
        rollout, outcomes = self.sampler.graded_rollout(
            submitted.prompts, submitted.prompt_ids, groups, gen_seconds=gen_seconds, step=submitted.step
        )
        lagged(rollout, submitted.policy_version, groups)
        if engine.wait_seconds is not None:  # sampled in the background: the step's gen phase is the
            # wait, and the sampler's own seconds (its tokens/s) are logged beside it
            rollout.stats["perf/sampler_gen_seconds"] = gen_seconds
            rollout.stats["perf/gen_seconds"] = engine.wait_seconds
        return Received(rollout, outcomes)

    # the rollouts sampled ahead are part of the run's state: a resume trains on them. As plain dicts of
    # tensors and numbers: Lightning loads checkpoints with torch.load(weights_only=True)
    def state_dict(self) -> dict:
        """Every rank's rollouts sampled ahead, graded (one still being sampled is waited for) and
        with their outcomes, which the task has not observed: it does when their step trains on them."""
        for step, entry in sorted(self.pending.items()):
            if isinstance(entry, Submitted):
                self.pending[step] = self._receive(entry)
        mine = {step: _received_to_dict(entry) for step, entry in self.pending.items()}
        # every rank's (ddp: Lightning builds the checkpoint on every rank and rank 0 writes it)
        return {"pending_by_rank": gather_objects(mine)}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("pending_by_rank", state.get("pending")):
            self.pending = {}  # a synchronous run's
            return
        rank, world = rank_and_world()
        every = state.get("pending_by_rank", [state.get("pending", {})])
        if len(every) != world:
            raise ConfigError(
                f"the checkpoint holds the one-step-off rollouts of {len(every)} training processes, and "
                f"this run has {world}: resume with {len(every)} (trainer.devices x trainer.num_nodes)"
            )
        self.pending = {int(step): _received_from_dict(d) for step, d in every[rank].items()}

    def clear(self) -> None:
        """Drop the rollouts sampled ahead (after fit: no step will train on them)."""
        self.pending.clear()


def _received_to_dict(entry: Received) -> dict:
    return rollout_to_dict(entry.rollout) | {"outcomes": entry.outcomes}


def _received_from_dict(d: dict) -> Received:
    outcomes = d.get("outcomes")  # absent from a checkpoint written before they were kept
    kept = None if outcomes is None else {name: list(v) for name, v in outcomes.items()}
    return Received(rollout_from_dict(d), kept)
