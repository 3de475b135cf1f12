"""The rollout DataModule: the environment side of RL. One Lightning epoch = one RL iteration.

It draws the step's prompts, samples K completions per prompt from the rollout engine, grades
them (rewards and correctness from one verifier pass) and assembles the batch; the learner
(`PolicyGradientModule`) adds reference log-probs, the KL penalty and the advantages. It reads
nothing of the module: the engine follows the policy through `rollout.sync.EngineSync`.

The train loader yields one `Rollout` per epoch (`reload_dataloaders_every_n_epochs=1`); the
validation loader yields greedy correctness and reward, sampled pass@k and maj@k per batch of
held-out prompts (`heldout_results`).
Both generate lazily, as the loop fetches the batch: after the epoch's `on_*_start` hooks have
synced the engine.
"""

from __future__ import annotations

import zlib
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from loorl.algo import estimators
from loorl.algo.estimators import Estimator
from loorl.algo.sample_metrics import maj_at_k, pass_at_k
from loorl.errors import ConfigError
from loorl.parallel.distributed import (
    all_reduce,
    check_world_divides,
    gather_objects,
    rank_and_world,
    rank_block,
)
from loorl.rewards import TASK_VERIFIER, RewardComposer, WeightedReward, correctness
from loorl.rewards.shaping import overlong_penalty
from loorl.rollout.batch import assemble, concatenate
from loorl.rollout.dynamic_sampling import Choice, SetAside, choose_groups, groups_with_signal
from loorl.rollout.engines.base import RolloutEngine
from loorl.rollout.multi_turn import (
    environment_failures,
    environment_rewards,
    row_of,
    tool_calls_of,
    tool_counts,
    tool_stats,
    used_a_tool,
)
from loorl.rollout.step_stats import (
    gather_graded,
    prompt_digest,
    rollout_stats,
    source_index,
    source_outcomes,
    source_stats,
)
from loorl.settings import OverlongSettings, RLSettings, RolloutSettings
from loorl.tasks.base import Task
from loorl.types import Completion, Prompt, Rollout, RolloutBatch
from loorl.util.profiling import PhaseClock


def sampler_seed(run_seed: int, *phase: str | int, rank: int = 0) -> int:
    """The sampler's seed for one generation call: a pure function of the run's seed, the phase
    (rollout or validation, with its step and batch) and the rank, so every rank draws its own
    samples and a resumed run draws the ones the interrupted run would have."""
    key = [run_seed, *(zlib.crc32(p.encode()) if isinstance(p, str) else p for p in phase), rank]
    return int(np.random.default_rng(key).integers(2**62))


def engine_precision(engine: RolloutEngine, trainer) -> AbstractContextManager:
    """The context `engine.generate` runs in: the trainer's precision plugin's (autocast under
    bf16-mixed) for an engine that generates in the trainer's precision, else none. None for a
    DataModule used without a trainer."""
    if trainer is None or not engine.generates_in_trainer_precision:
        return nullcontext()
    return trainer.precision_plugin.forward_context()


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


def _own_generator() -> torch.Generator:
    """A DataLoader draws a seed for its workers when iterated, from the global torch RNG unless it
    has a generator of its own; the sampler's random stream must not depend on when that happens."""
    return torch.Generator()


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        *,
        task: Task,
        tokenizer,
        engine: RolloutEngine,
        rl: RLSettings,
        rollout: RolloutSettings,
        rewards: RewardComposer | None = None,
        seed: int = 0,
        pass_k: int = 0,  # validation: sampled pass@k and maj@k besides greedy accuracy; 0: off
        eval_samples: int | None = None,  # n >= pass_k samples per prompt for them; None: pass_k
        eval_split: str = "eval",  # eval: the task's held-out set | train: drawn training prompts
        eval_limit: int | None = None,  # at most this many validation prompts (split=train needs it)
        estimator: Estimator | None = None,  # dynamic sampling asks it which groups have signal; None: rloo
        overlong: OverlongSettings | None = None,  # reward.overlong; None: no overlong penalty
        completion_tokens: int | None = None,  # a sample's limit over all its turns; None: one turn's
    ) -> None:
        super().__init__()
        self.task, self.tokenizer, self.engine = task, tokenizer, engine
        self.rl, self.settings, self.seed, self.pass_k = rl, rollout, seed, pass_k
        self.eval_samples = pass_k if eval_samples is None else eval_samples
        if pass_k > self.eval_samples:
            raise ConfigError(
                f"pass@k with k={pass_k} needs at least k samples per prompt, not {eval_samples}"
            )
        self.eval_split, self.eval_limit = eval_split, eval_limit
        self.rewards = rewards or RewardComposer([WeightedReward("task", TASK_VERIFIER)], task=task)
        self.estimator = estimator or estimators.get("rloo")
        self.overlong = overlong or OverlongSettings()
        self.completion_tokens = completion_tokens or rollout.max_new_tokens  # the overlong penalty's limit
        # rollout.max_staleness > 0: the next steps' rollouts, sampled ahead (Submitted while the engine
        # samples them)
        self.pending: dict[int, Rollout | Submitted] = {}

    # ---- prompts -------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[Prompt]) -> list[list[int]]:
        ids = [self.tokenizer(p.text, add_special_tokens=False).input_ids for p in prompts]
        longest = max(map(len, ids))
        if longest > self.settings.max_prompt_length:
            raise ConfigError(
                f"a prompt has {longest} tokens, more than rollout.max_prompt_length="
                f"{self.settings.max_prompt_length}: raise the limit or shorten the task's prompts"
            )
        return ids

    def sampler_seed(self, *phase: str | int) -> int:
        return sampler_seed(self.seed, *phase, rank=rank_and_world()[0])

    def prompts_for_step(self, step: int, round: int = 0) -> list[Prompt]:
        """This rank's prompts of the step, a pure function of (seed, step): a resumed run draws the
        same ones. The step draws B prompts; each of the W ranks takes its block of B/W (together
        they are the B prompts of one process, no prompt twice, none left out). `round` > 0: a further
        round of dynamic sampling, B more prompts, a pure function of (seed, step, round)."""
        prompts = self.task.prompts_for_round(step, round, self.rl.prompts_per_step, seed=self.seed)
        return [prompts[i] for i in rank_block(len(prompts), *rank_and_world())]

    def held_out_prompts(self) -> list[Prompt]:
        """The validation prompts: the task's held-out set, or (`eval_split=train`) `eval_limit`
        training prompts drawn with the run's seed; at most `eval_limit` of them."""
        if self.eval_split == "train":
            if not self.eval_limit:
                raise ConfigError("eval.split=train draws training prompts: set eval.num_prompts to how many")
            return self.task.prompts_for_step(0, self.eval_limit, seed=self.seed)
        return self.task.eval_prompts()[: self.eval_limit]

    def setup(self, stage: str) -> None:
        if not getattr(self, "_prepared", False):
            self.task.prepare(self.tokenizer, max_prompt_length=self.settings.max_prompt_length)
            self._prepared = True
        rank, world = rank_and_world()
        # checked before launch where trainer.devices is a number; "auto" is known only now
        check_world_divides(self.rl.prompts_per_step, self.rl.prompts_per_minibatch, world, "as launched")
        self.eval_prompts = self.held_out_prompts()[rank::world]  # sharded; accuracy is reduced by the
        # learner's MeanMetric (sums and counts over ranks)
        self.encode_prompts(self.eval_prompts)  # fail early on over-long prompts
        if self.settings.max_staleness and stage in ("fit", "validate"):  # (the run validates step 0 first)
            self.engine.start()  # a sampler process of its own (rollout.devices) starts up meanwhile

    def detokenize(self, groups: list[list[Completion]]) -> list[list[str]]:
        """Completion texts [B][K], without the end-of-sequence token that ended them."""
        return [[self.tokenizer.decode(c.text_ids, skip_special_tokens=True) for c in g] for g in groups]

    # ---- one RL iteration ----------------------------------------------------------------------
    @torch.no_grad()
    def collect(self, step: int) -> Rollout:
        """Step `step`'s rollout. Synchronous (`rollout.max_staleness=0`): its prompts, K completions each
        from the engine's current weights (step `step`'s), their grades.

        Bounded staleness (`max_staleness=N`, N >= 1): the rollout that was asked for N steps before, with
        the weights of that step (N policy versions old; fewer in the first N steps), and step `step + N`'s
        asked for now, with these weights, kept for that step (and in the checkpoint: `state_dict`).
        N=1 is one step off. Each rollout's prompts and sampler seed are those of its own step, as in the
        synchronous loop, and its weights those of step `step - N`: the result does not depend on timing.
        The first step has nothing older and samples its own (lag 0), then asks for steps 1..N.
        A rollout older than N versions (a checkpoint's, resumed with a smaller N) is dropped, counted
        (`staleness/dropped_samples`) and sampled again with this step's weights."""
        bound = self.settings.max_staleness
        if not bound:
            rollout = self.fill(self._sample(step))
            rollout.stats |= self.weight_sync_stats()
            return rollout
        current = self.pending.pop(step, None)
        if isinstance(current, Submitted):
            current = self._receive(current)
        dropped = 0
        if current is not None and current.policy_lag > bound:
            dropped = current.batch.num_groups * current.batch.samples_per_prompt
            current = None
        if current is None:  # the first step (or a resume without a rollout ahead): its own, lag 0, sampled
            current = self._sample(step, policy_version=step)  # here while a sampler process starts up
        current.stats["staleness/dropped_samples"] = float(all_reduce(dropped))
        current.stats |= self.weight_sync_stats()
        current = self.fill(current)  # further rounds with this step's weights, before the next is asked for
        self._submit_ahead(step)
        return current

    def weight_sync_stats(self) -> dict[str, float]:
        """The last weight update's seconds and bytes, for an engine that copies weights to servers."""
        engine = getattr(self.engine, "inner", self.engine)  # (tools wrap the engine)
        if not hasattr(engine, "update_seconds"):
            return {}
        return {
            "perf/weight_sync_seconds": engine.update_seconds,
            "perf/weight_sync_bytes": float(engine.update_bytes),
        }

    def _submit_ahead(self, step: int) -> None:
        """Ask for the rollouts of steps `step + 1` .. `step + max_staleness` not yet asked for, with this
        step's weights; an engine that holds fewer requests at once (`max_in_flight`: a sampler process
        holds one) has its oldest received first."""
        last = min(step + self.settings.max_staleness, self.rl.steps - 1)
        for ahead in range(step + 1, last + 1):
            if ahead in self.pending:
                continue
            asked = sorted(s for s, p in self.pending.items() if isinstance(p, Submitted))
            if len(asked) >= self.engine.max_in_flight:
                self.pending[asked[0]] = self._receive(self.pending[asked[0]])
            self.pending[ahead] = self._submit(ahead, policy_version=step)

    def fill(self, first: Rollout) -> Rollout:
        """Dynamic sampling (`rl.dynamic_sampling`; the rollout itself when off): groups of `first` (the
        step's round 0) whose advantages would all be 0 are set aside, and further rounds of B prompts,
        K samples each from one generation call, are drawn with the engine's current weights until this
        step holds B groups with signal on every rank, or `max_rounds` rounds have run. The step then
        trains on B/W groups per rank: those with signal, and set-aside ones where too few had
        (`choose_groups`). The filter looks at the reward the estimator sees before any KL term
        (the task's, with `reward.overlong`): a KL-shaped reward almost always has a spread.

        One step off, round 0 was sampled a step behind (its lag is the rollout's) and the further
        rounds with this step's weights: the sampler's log-probs are each sample's own, so the
        importance ratio of every row is right. Rounds are a pure function of (seed, step, round) and
        the weights: a resumed run draws the same ones."""
        ds = self.rl.dynamic_sampling
        if not ds.enabled:
            return first
        step, quota = first.step, first.batch.num_groups
        rounds, signal = [first], [self._signal(first.batch)]

        def missing() -> float:  # groups with signal still lacking, on the rank that lacks the most
            return float(all_reduce(max(quota - sum(int(f.sum()) for f in signal), 0), "max"))

        while len(rounds) < ds.max_rounds and missing() > 0:
            r = len(rounds)
            prompts = self.prompts_for_step(step, r)
            rounds.append(self.rollout(prompts, seed=self.sampler_seed("rollout", step, r), step=step))
            signal.append(self._signal(rounds[-1].batch))
        self.engine.sleep()  # the rounds are over (grade leaves the engine awake under dynamic sampling)
        choice = choose_groups(signal, quota)
        pieces = [rounds[r].batch.select_groups([g]) for r, g in choice.trained]
        batch = concatenate(pieces, pad_token_id=self.tokenizer.pad_token_id)
        aside = sum(
            (SetAside.of(self._correct(rounds[r].batch)[~flags]) for r, flags in enumerate(signal)),
            start=SetAside(),
        )
        return replace(first, batch=batch, stats=self.round_stats(rounds, choice, aside))

    def _signal(self, batch: RolloutBatch) -> torch.Tensor:
        """[B] which groups of a round's batch have signal under the run's estimator."""
        return groups_with_signal(batch.rewards.view(-1, batch.samples_per_prompt), self.estimator)

    @staticmethod
    def _correct(batch: RolloutBatch) -> torch.Tensor:
        """[B, K] the verdicts; all NaN (counted as `other`) for a rollout checkpointed without them."""
        if batch.correct is None:
            return torch.full_like(batch.rewards, torch.nan).view(-1, batch.samples_per_prompt)
        return batch.correct.view(-1, batch.samples_per_prompt)

    def round_stats(self, rounds: list[Rollout], choice: Choice, aside: SetAside) -> dict[str, float]:
        """The step's statistics under dynamic sampling: round 0's rollout statistics (the policy on a
        fresh draw of prompts, as without it), the generation totals of every round, and the rounds'
        own counts, summed over ranks."""
        stats = dict(rounds[0].stats)
        totals = ("rollout/gen_tokens", "perf/gen_seconds", "perf/grade_seconds", "perf/sampler_gen_seconds")
        for key in totals:
            if key in stats:
                stats[key] = sum(r.stats.get(key, 0.0) for r in rounds)
        stats["perf/gen_tokens_per_s"] = stats["rollout/gen_tokens"] / max(stats["perf/gen_seconds"], 1e-9)
        mine = [len(choice.trained) - choice.fillers, choice.fillers, choice.surplus]
        counts = all_reduce(mine + [aside.all_right, aside.all_wrong, aside.other]).tolist()  # all ranks
        signal, fillers, surplus, right, wrong, other = counts
        stats |= {
            "dynamic/rounds": float(len(rounds)),
            "dynamic/prompts_drawn": float(len(rounds) * self.rl.prompts_per_step),
            "dynamic/groups_with_signal": signal,  # trained
            "dynamic/filler_groups": fillers,  # trained without signal: the rounds ran out
            "dynamic/surplus_groups": surplus,  # with signal, not trained: the last round brought more
            "dynamic/set_aside_all_right": right,
            "dynamic/set_aside_all_wrong": wrong,
            "dynamic/set_aside_other": other,
            "dynamic/gen_tokens_per_trained_group": stats["rollout/gen_tokens"] / max(signal, 1.0),
        }
        return stats

    def _sample(self, step: int, *, policy_version: int | None = None) -> Rollout:
        """Step `step`'s prompts, K completions each from the engine's current weights, their grades;
        `policy_version`: the step those weights belong to, when one step off (logged as the lag)."""
        rollout = self.rollout(
            self.prompts_for_step(step), seed=self.sampler_seed("rollout", step), step=step
        )
        return rollout if policy_version is None else lagged(rollout, policy_version)

    def _submit(self, step: int, *, policy_version: int) -> Submitted:
        """Start sampling step `step`'s rollout with the engine's current weights (those of step
        `policy_version`): in the background where the engine has a process of its own."""
        prompts = self.prompts_for_step(step)
        prompt_ids = self.encode_prompts(prompts)
        with engine_precision(self.engine, self.trainer):
            seed = self.sampler_seed("rollout", step)
            k = self.rl.samples_per_prompt
            ticket = self.engine.submit(prompt_ids, n=k, seed=seed, **self.rows(prompts))
        return Submitted(step, prompts, prompt_ids, policy_version, ticket)

    def _receive(self, submitted: Submitted) -> Rollout:
        """The rollout `submitted`, graded. Sampled in the background, its `perf/gen_seconds` is how long
        the trainer waited for it, `perf/sampler_gen_seconds` the sampler's."""
        groups, gen_seconds = self.engine.receive(submitted.ticket)
        rollout = self.grade(submitted.prompts, submitted.prompt_ids, groups, gen_seconds=gen_seconds,
                             step=submitted.step)  # fmt: skip
        lagged(rollout, submitted.policy_version, groups)
        if self.engine.wait_seconds is not None:  # sampled in the background: the step's gen phase is the
            # wait, and the sampler's own seconds (its tokens/s) are logged beside it
            rollout.stats["perf/sampler_gen_seconds"] = gen_seconds
            rollout.stats["perf/gen_seconds"] = self.engine.wait_seconds
        return rollout

    # the rollout sampled ahead (one step off) is part of the run's state: a resume trains on it. As plain
    # dicts of tensors and numbers: Lightning loads checkpoints with torch.load(weights_only=True)
    def state_dict(self) -> dict:
        state = {}
        if self.settings.max_staleness:
            for step, entry in sorted(self.pending.items()):  # a rollout still being sampled is waited for
                if isinstance(entry, Submitted):
                    self.pending[step] = self._receive(entry)
            mine = {step: rollout_to_dict(r) for step, r in self.pending.items()}
            # every rank's (ddp: Lightning builds the checkpoint on every rank and rank 0 writes it)
            state["pending_by_rank"] = gather_objects(mine)
        task = self.task.state_dict()  # after the rollout ahead was graded: its step is observed too
        if task:  # (a curriculum's levels)
            state["task"] = task
        return state

    def load_state_dict(self, state: dict) -> None:
        self.task.load_state_dict(state.get("task", {}))
        if not self.settings.max_staleness or not state.get("pending_by_rank", state.get("pending")):
            self.pending = {}  # a synchronous run's
            return
        rank, world = rank_and_world()
        every = state.get("pending_by_rank", [state.get("pending", {})])
        if len(every) != world:
            raise ConfigError(
                f"the checkpoint holds the one-step-off rollouts of {len(every)} training processes, and "
                f"this run has {world}: resume with {len(every)} (trainer.devices x trainer.num_nodes)"
            )
        self.pending = {int(step): rollout_from_dict(d) for step, d in every[rank].items()}

    def teardown(self, stage: str) -> None:
        """After fit (every checkpoint written): a rollout sampled ahead that no step will train on is
        dropped, and a sampler process ends."""
        if stage == "fit":
            self.pending.clear()
            self.engine.close()

    @torch.no_grad()
    def rollout(self, prompts: list[Prompt], *, seed: int, step: int = 0) -> Rollout:
        """K completions of each prompt sampled with `seed`, graded and assembled into a batch."""
        prompt_ids = self.encode_prompts(prompts)
        clock = PhaseClock()
        with clock.phase("gen"):
            groups = self.generate(prompt_ids, n=self.rl.samples_per_prompt, seed=seed, **self.rows(prompts))
        return self.grade(prompts, prompt_ids, groups, gen_seconds=clock.seconds["gen"], step=step)

    def grade(self, prompts: list[Prompt], prompt_ids: list[list[int]], groups: list[list[Completion]], *,
              gen_seconds: float, step: int) -> Rollout:  # fmt: skip
        """The completions [B][K] of `prompts` graded and assembled into the step's rollout."""
        clock = PhaseClock()
        if not self.rl.dynamic_sampling.enabled:  # else `fill` puts it to sleep once the rounds are over
            self.engine.sleep()
        with clock.phase("grade"):
            graded = self.rewards(prompts, self.detokenize(groups), tool_calls_of(groups))  # [B, K]
            graded = environment_rewards(graded, groups)  # [B, K] an environment's get_reward()
        rewards = graded.rewards  # [B, K]
        finished = torch.tensor([[c.finished for c in g] for g in groups])  # [B, K]
        if self.settings.truncated == "zero":
            rewards = torch.where(finished | rewards.isnan(), rewards, torch.zeros_like(rewards))
        sizes = torch.tensor([[len(c.token_ids) for c in g] for g in groups], dtype=torch.float)  # [B, K]
        inserted = torch.tensor([[c.inserted for c in g] for g in groups], dtype=torch.float)  # [B, K]
        lengths = sizes - inserted  # [B, K] the tokens each sample generated (without tool results)
        if self.overlong.buffer:  # against the sample's limit, which counts inserted tool results too
            penalty = overlong_penalty(sizes, max_len=self.completion_tokens, buffer=self.overlong.buffer,
                                       penalty=self.overlong.penalty)  # fmt: skip
            rewards = rewards + penalty  # [B, K] NaN stays NaN
        batch = assemble(
            [g[0].prompt_ids or ids for g, ids in zip(groups, prompt_ids)],  # reset's text placed in some
            groups,
            pad_token_id=self.tokenizer.pad_token_id,
            rewards=rewards,
            loss_on_truncated=self.settings.truncated != "mask",
            correct=graded.correct,
        )
        everyone = gather_graded(graded, lengths, finished)  # the whole step's, over all ranks
        stats = rollout_stats(*everyone, gen_seconds=float(all_reduce(gen_seconds, "max")))
        stats["rollout/prompt_digest"] = prompt_digest(prompts)
        if self.overlong.buffer:  # the mean penalty over the step's samples (all ranks)
            total, count = all_reduce(torch.stack([penalty.sum(), torch.tensor(penalty.numel())])).tolist()
            stats["rollout/overlong_penalty"] = total / count
        names = self.task.source_names
        if names:  # task=mix, task=reasoning_gym: per source
            index = source_index(prompts, names)  # [W*B] one all-gather for both
            stats |= source_stats(index, everyone[0], names)
        else:  # one source, the task itself
            index, names = torch.zeros(len(everyone[0].correct), dtype=torch.long), [self.task.name]  # [W*B]
        stats |= self.task.observe(step, source_outcomes(index, everyone[0], names))  # a curriculum moves
        flat = [c for g in groups for c in g]
        if any(c.policy_mask is not None for c in flat):  # multi-turn rollouts with tools (all ranks)
            stats |= tool_stats(all_reduce(tool_counts(flat)).tolist())
        stats["perf/grade_seconds"] = clock.seconds["grade"]
        return Rollout(step=step, batch=batch, stats=stats)

    def train_dataloader(self) -> DataLoader:
        """One item: this epoch's rollout, collected when the loop fetches it."""
        step = self.trainer.current_epoch
        return DataLoader([step], batch_size=None, collate_fn=self.collect, generator=_own_generator())

    def rows(self, prompts: list[Prompt]) -> dict:
        """`{"rows": ...}` for an engine that resets an environment per sample with its prompt's row
        (`takes_rows`: `environment._target_`); {} for any other."""
        return {"rows": [row_of(p) for p in prompts]} if getattr(self.engine, "takes_rows", False) else {}

    def generate(self, prompt_ids: list[list[int]], **kwargs) -> list[list[Completion]]:
        """The engine's `generate`, inside the trainer's precision context (bf16-mixed: autocast) only
        for an engine that asks for it (`generates_in_trainer_precision`: the HF engine, which samples
        with the live policy in training_step's dtype). Grading and reward models run outside it."""
        with engine_precision(self.engine, self.trainer):
            return self.engine.generate(prompt_ids, **kwargs)

    # ---- held-out evaluation -------------------------------------------------------------------
    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.eval_prompts,
            batch_size=self.settings.eval_batch_size,
            collate_fn=self.heldout_results,
            generator=_own_generator(),
        )

    @torch.no_grad()
    def heldout_results(self, prompts: list[Prompt]) -> dict:
        """Held-out metrics of a batch of prompts, per prompt: greedy correctness `correct` [n] and
        reward `reward` [n] (NaN: unscorable), the greedy `completions`; with `pass_k` = k > 0 also
        the unbiased pass@k and maj@k [n] of `eval_samples` (n >= k) sampled completions each.
        The validation loop and `src/eval.py` both run this."""
        ids = self.encode_prompts(prompts)
        completions = self.generate(ids, n=1, greedy=True, **self.rows(prompts))  # [n][1]
        greedy = self.detokenize(completions)  # [n][1]
        graded = self.rewards(prompts, greedy, tool_calls_of(completions))  # [n, 1]
        graded = environment_rewards(graded, completions)  # [n, 1]
        results = {
            "prompts": [p.text for p in prompts],
            "completions": [g[0] for g in greedy],
            "correct": graded.correct.view(-1),  # [n] NaN: unscorable (left out of val/accuracy)
            "reward": graded.rewards.view(-1),  # [n]
            "unscorable": graded.correct.view(-1).isnan().float(),  # [n] counted in val/unscorable
            "tool_used": used_a_tool(completions),  # [n] None without tools
            # [n] samples whose environment instance failed; None without an environment
            "env_failures": environment_failures(completions) if self.rows(prompts) else None,
            "pass_k": None,
            "maj_k": None,
            "sources": [p.meta.get("source") for p in prompts],  # task=mix: each prompt's source
            "source_names": self.task.eval_source_names,
            # [n] the prompts the overall val/* metrics cover (task.eval_levels' sets: their source's only)
            "in_overall": torch.tensor([p.meta.get("in_overall", True) for p in prompts]),
        }
        if self.pass_k > 0:
            step = self.trainer.global_step if self.trainer is not None else 0
            seed = self.sampler_seed("validation", step, prompts[0].text)  # this batch's own stream
            sampled = self.generate(ids, n=self.eval_samples, seed=seed, **self.rows(prompts))
            if results["env_failures"] is not None:
                results["env_failures"] = results["env_failures"] + environment_failures(sampled)  # [n]
            sampled = self.detokenize(sampled)  # [n][N]
            correct = correctness(self.task, prompts, sampled)  # [n, N] NaN: unscorable
            scorable = ~correct.isnan()  # [n, N]
            results["pass_k"] = pass_at_k(
                scorable.sum(-1), correct.nansum(-1), self.pass_k
            )  # [n] of the scorable
            answers = [[self._answer(p, t) for t in row] for p, row in zip(prompts, sampled)]
            majority = maj_at_k(answers, correct, self.pass_k)  # [n]
            voted = torch.tensor([self.task.votes_on_answers(p) for p in prompts])  # [n]
            results["maj_k"] = torch.where(voted, majority, torch.nan)  # [n] NaN: not a votable task
        return results

    def _answer(self, prompt: Prompt, text: str) -> str | None:
        """The task's extracted answer; None where the extractor fails on odd text."""
        try:
            return self.task.extract_answer(prompt, text)
        except Exception:  # noqa: BLE001 - as a failing verifier: that sample has no answer
            return None
