"""`task=reasoning_gym`: a weighted mixture of reasoning-gym's procedural datasets, scored by each
dataset's own `score_answer`, with an optional difficulty curriculum (`loorl.tasks.curriculum`).

Problems: reasoning-gym generates item `idx` of a dataset from `random.Random(seed + idx)` under the
dataset's config, so a problem is a pure function of (config, seed, idx), the same on every machine.
The held-out set of a dataset is its first distinct problems from its own seed (`eval_seed`), at its
starting level; `eval_levels` adds one such set per further level (the same seed: the starting level's
set is the same with or without them), logged as the pseudo-source `<name>@L<level>` and left out of
the overall `val/*` metrics (`meta["in_overall"]`). A training draw whose question is held out at any
level is drawn again, so training and held-out problems are disjoint by construction, whatever the
seeds and levels. A step's B prompts are split over the datasets by weight (largest remainders) and
shuffled, a pure function of (seed, step) and the levels. `curriculum.fixed_levels` trains a dataset
at another level than its starting one, the held-out sets and worked examples unchanged.

Answers: the prompt teaches `<answer>...</answer>` (`system_prompt`, reasoning-gym's own prompts by
name); the answer is the last such tag's text (reasoning-gym's `extract_answer`), and the dataset's
`score_answer(answer, entry)` scores it. reasoning-gym's default scorer gives `len(oracle)/len(answer)`
to an answer that merely contains the right one, which a policy can exploit by padding ("3 4 5 6"
scores 1/7 where 3 is right, a wrong answer 0): `scoring=exact` (the default) rewards 1 where the
score is 1 and 0 otherwise; `scoring=library` passes the score through, partial credit included.

reasoning-gym is an optional extra, imported only when this task is built. The settings are checked in
`loorl.tasks.reasoning_gym_settings`.
"""

from __future__ import annotations

import zlib

import numpy as np

from loorl.errors import ConfigError
from loorl.tasks.base import Task
from loorl.tasks.curriculum import Curriculum
from loorl.tasks.data import format_prompt
from loorl.tasks.mixed import quotas
from loorl.tasks.reasoning_gym_settings import (
    Source,
    curriculum_settings,
    import_reasoning_gym,
    max_level,
    parse_eval_levels,
    parse_fixed_levels,
    parse_source,
)
from loorl.types import Prompt

SCORING = ("exact", "library")
MAX_REDRAWS = 1000  # draws of one training problem before its dataset is called exhausted
SIZE = 2**31  # the virtual size of a dataset: indices are drawn below it


def stable_seed(*parts: int | str) -> int:
    """A 31-bit seed from ints and strings, the same in every process (no Python `hash`)."""
    key = [zlib.crc32(p.encode()) if isinstance(p, str) else int(p) for p in parts]
    return int(np.random.default_rng(key).integers(2**31))


class ReasoningGymTask(Task):
    name = "reasoning_gym"

    def __init__(
        self,
        *,
        name: str = "reasoning_gym",
        datasets: dict,
        curriculum: dict | None = None,
        eval_size: int = 50,
        eval_seed: int = 1234,
        eval_levels: list[int] | None = None,
        system_prompt: str | None = "direct",
        chat_template: bool | str = "auto",
        answer_tag: str = "answer",
        shots: int = 1,
        scoring: str = "exact",
        max_new_tokens: int = 64,  # the default of rollout.max_new_tokens; unused here
    ) -> None:
        import_reasoning_gym()
        from reasoning_gym.coaching.base_curriculum import DefaultCurriculumContext, RangeAttributeMode
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if scoring not in SCORING:
            raise ConfigError(f"task.scoring={scoring!r} is not one of: {', '.join(SCORING)}")
        if not datasets:
            raise ConfigError(
                "task.datasets is empty: name at least one reasoning-gym dataset {weight, config}"
            )
        if shots < 0:
            raise ConfigError(f"task.shots={shots} must be 0 (none) or more worked examples")
        if eval_size < 1:
            raise ConfigError(f"task.eval_size={eval_size} must be at least 1 problem per dataset")
        self.name, self.eval_size, self.eval_seed = name, eval_size, eval_seed
        self.scoring, self.answer_tag, self.chat_template = scoring, answer_tag, chat_template
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt, system_prompt) if system_prompt else None
        cur = curriculum_settings(curriculum)
        self.context = DefaultCurriculumContext(mode=RangeAttributeMode(cur["range_mode"]))
        self.sources = [parse_source(n, spec) for n, spec in datasets.items() if spec is not None]
        if not self.sources:  # (a null entry leaves a dataset out: an experiment's way to drop the base's)
            raise ConfigError("task.datasets has no dataset left (every entry is null): name at least one")
        self.datasets: dict[tuple[str, int | None, str], object] = {}  # (name, level, split) -> dataset
        leveled = {s.name: s.level for s in self.sources if s.level is not None}
        self.eval_levels = parse_eval_levels(eval_levels, leveled)
        self.fixed_levels = parse_fixed_levels(cur["fixed_levels"], leveled, enabled=bool(cur["enabled"]))
        for name, level in self.fixed_levels.items():  # reasoning-gym's refusal of the level, now
            self.dataset(self._by_name(name), level, "train")
        self.curriculum = None
        if cur["enabled"]:
            if not leveled:
                raise ConfigError(
                    "task.curriculum.enabled=true moves levels, and no dataset of task.datasets has one: "
                    "give a dataset a starting level (task.datasets.<name>.level=0)"
                )
            self.curriculum = Curriculum.from_settings(
                cur, levels=leveled, max_levels={n: max_level(n) for n in leveled}
            )
        self.tokenizer, self.max_prompt_length = None, None  # set by prepare()
        self.skipped_long = 0  # training draws left out: their prompt was over the length limit
        self._heldout = {s.name: self._heldout_entries(s, s.level) for s in self.sources}
        self._extra_heldout = {  # (name, level) -> its held-out set at a further level (eval_levels)
            (s.name, level): self._heldout_entries(s, level)
            for s in self.sources
            for level in self.extra_levels(s)
        }
        self._heldout_questions = {n: {e["question"] for e in es} for n, es in self._heldout.items()}
        for (name, _), entries in self._extra_heldout.items():  # excluded from training at every level
            self._heldout_questions[name] |= {e["question"] for e in entries}
        self._shots = {s.name: self._shot_entries(s, shots) for s in self.sources}

    # ---- configuration ---------------------------------------------------------------------------
    def extra_levels(self, source: Source) -> list[int]:
        """The further levels `source` is held out at (`eval_levels`): those it has, but its starting one."""
        if source.level is None:
            return []
        top = max_level(source.name)
        return [lv for lv in self.eval_levels if lv <= top and lv != source.level]

    def config_at(self, source: Source, level: int | None, *, seed: int) -> object:
        """The dataset's config object at `level` (reasoning-gym's curriculum over the user's config)."""
        from reasoning_gym.factory import DATASETS, create_curriculum

        defaults = {**source.config, "seed": seed, "size": SIZE}
        try:
            if level is None:
                config = DATASETS[source.name][1](**defaults)
            else:
                curriculum = create_curriculum(source.name)
                curriculum.set_global_level(level)
                config = curriculum.generate_configuration(defaults, context=self.context)
            if hasattr(config, "validate"):  # not every dataset's config has one (power_function's)
                config.validate()
        except (TypeError, ValueError, AssertionError) as err:
            raise ConfigError(
                f"task.datasets.{source.name}: reasoning-gym refuses its config: {err}"
            ) from err
        return config

    def dataset(self, source: Source, level: int | None, split: str):
        """The reasoning-gym dataset of `source` at `level`, for `split` (train or eval: own seeds)."""
        key = (source.name, level, split)
        if key not in self.datasets:
            seed = stable_seed(self.eval_seed if split == "eval" else 0, source.name, split)
            from reasoning_gym.factory import DATASETS

            self.datasets[key] = DATASETS[source.name][0](config=self.config_at(source, level, seed=seed))
        return self.datasets[key]

    def _by_name(self, name: str) -> Source:
        return next(s for s in self.sources if s.name == name)

    # ---- problems --------------------------------------------------------------------------------
    @staticmethod
    def _distinct(ds, count: int, *, draws: int, exclude: set[str] = frozenset()) -> list[dict]:
        """The first `count` problems of a dataset's stream (indices 0, 1, ...) with distinct questions
        not in `exclude`; fewer where its first `draws` indices hold no more."""
        seen, out = set(exclude), []
        for idx in range(draws):
            if len(out) == count:
                break
            entry = ds[idx]
            if entry["question"] not in seen:
                seen.add(entry["question"])
                out.append(entry)
        return out

    def _heldout_entries(self, source: Source, level: int | None) -> list[dict]:
        """The first `eval_size` distinct problems of the dataset's eval stream at `level` (its starting
        one, or one of `eval_levels`: the stream's seed is the same at every level)."""
        ds = self.dataset(source, level, "eval")
        return self._distinct(ds, self.eval_size, draws=self.eval_size * 20)

    def _shot_entries(self, source: Source, shots: int) -> list[tuple[str, str]]:
        """The worked examples shown before each of the dataset's questions: the first `shots` distinct
        problems of its training stream at its starting level that are not held out."""
        ds = self.dataset(source, source.level, "train")
        return [(e["question"], self.tagged(e["answer"]))
                for e in self._distinct(ds, shots, draws=shots * 20 + 20,
                                        exclude=self._heldout_questions[source.name])]  # fmt: skip

    def tagged(self, answer) -> str:
        """An answer as the prompt teaches it: `<answer>42</answer>`."""
        return f"<{self.answer_tag}>{answer}</{self.answer_tag}>"

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def eval_source_names(self) -> list[str]:
        """The datasets, then each further held-out set (`eval_levels`) as `<name>@L<level>`."""
        return self.source_names + [f"{name}@L{level}" for name, level in self._extra_heldout]

    def level_of(self, name: str) -> int | None:
        """The dataset's current training level: the curriculum's, else `fixed_levels`' or its starting
        one."""
        if self.curriculum is not None and name in self.curriculum.levels:
            return self.curriculum.levels[name]
        return self.fixed_levels.get(name, self._by_name(name).level)

    def _prompt(self, source: Source, entry: dict, level: int | None, *, heldout_at: str = "") -> Prompt:
        text = format_prompt(
            entry["question"],
            tokenizer=self.tokenizer,
            use_chat_template=self.chat_template if self.tokenizer is not None else False,
            system_prompt=self.system_prompt,
            examples=self._shots[source.name],
            tools=self.tools_for({}),
        )
        meta = {"source": source.name + heldout_at, "dataset": source.name, "level": level}
        meta |= {"entry": entry, "question": entry["question"]}
        if heldout_at:  # a further level's held-out set: its own val/accuracy/<name>@L<level> only
            meta["in_overall"] = False
        return Prompt(text=text, answer=str(entry["answer"]), meta=meta)

    def _too_long(self, text: str) -> bool:
        if self.tokenizer is None or self.max_prompt_length is None:
            return False
        return len(self.tokenizer(text, add_special_tokens=False).input_ids) > self.max_prompt_length

    def _draw(
        self, source: Source, count: int, rng: np.random.Generator, level: int | None = None
    ) -> list[Prompt]:
        """`count` training problems of `source` at `level` (None: its current one), none of them held
        out at any level."""
        level = self.level_of(source.name) if level is None else level
        ds, held, out = self.dataset(source, level, "train"), self._heldout_questions[source.name], []
        while len(out) < count:
            for _ in range(MAX_REDRAWS):
                entry = ds[int(rng.integers(SIZE))]
                if entry["question"] in held:
                    continue
                prompt = self._prompt(source, entry, level)
                if self._too_long(prompt.text):
                    self.skipped_long += 1
                    continue
                out.append(prompt)
                break
            else:
                raise ConfigError(
                    f"task.datasets.{source.name}: {MAX_REDRAWS} draws at level {level} gave no problem that "
                    "is neither held out nor over rollout.max_prompt_length: lower task.eval_size or raise "
                    "the limit"
                )
        return out

    def train_prompts(self, n: int, *, rng: np.random.Generator, starting: bool = False) -> list[Prompt]:
        """`n` training prompts at the datasets' current levels (`starting`: their starting levels)."""
        out = []
        for source, count in zip(self.sources, quotas(n, [s.weight for s in self.sources])):
            out += self._draw(source, count, rng, source.level if starting else None)
        return [out[i] for i in rng.permutation(len(out))]

    def eval_prompts(self) -> list[Prompt]:
        """Each dataset's held-out set at its starting level, then those at `eval_levels` (its prompts'
        source `<name>@L<level>`, left out of the overall metrics: `meta["in_overall"]`)."""
        out = [self._prompt(s, e, s.level) for s in self.sources for e in self._heldout[s.name]]
        for (name, level), entries in self._extra_heldout.items():
            out += [self._prompt(self._by_name(name), e, level, heldout_at=f"@L{level}") for e in entries]
        return out

    def prepare(self, tokenizer, *, max_prompt_length: int) -> None:
        """Render prompts with the tokenizer from now on; held-out prompts must fit the length limit,
        and every character of them must be in the vocabulary (the tiny model's is printable ASCII)."""
        self.tokenizer, self.max_prompt_length = tokenizer, max_prompt_length
        unk = getattr(tokenizer, "unk_token_id", None)
        for p in self.eval_prompts():
            ids = tokenizer(p.text, add_special_tokens=False).input_ids
            if len(ids) > max_prompt_length:
                fix = "task.eval_levels" if p.meta.get("in_overall") is False else "its level"
                raise ConfigError(
                    f"a held-out {p.meta['source']} prompt (level {p.meta['level']}) has {len(ids)} tokens, "
                    f"more than rollout.max_prompt_length={max_prompt_length}: raise the limit or lower {fix}"
                )
            if unk is not None and unk in ids:
                bad = sorted({c for c in p.text if unk in tokenizer(c, add_special_tokens=False).input_ids})
                raise ConfigError(
                    f"task.datasets.{p.meta['dataset']}: the tokenizer has no token for {bad[:5]} in its "
                    "prompts: choose datasets whose text it covers, or a model with a byte-level tokenizer"
                )

    # ---- grading ---------------------------------------------------------------------------------
    def extract_answer(self, prompt: Prompt, completion: str) -> str | None:
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion, tag_name=self.answer_tag)

    def score(self, prompt: Prompt, answer: str | None) -> float:
        """reasoning-gym's own score of an extracted answer (the dataset's `score_answer`)."""
        source = self._by_name(prompt.meta.get("dataset", prompt.meta["source"]))
        return float(
            self.dataset(source, prompt.meta["level"], "train").score_answer(answer, prompt.meta["entry"])
        )

    def grade(self, prompt: Prompt, completion: str) -> tuple[float | None, bool]:
        score = self.score(prompt, self.extract_answer(prompt, completion))
        correct = score >= 1.0
        return (score if self.scoring == "library" else float(correct)), correct

    def reward(self, prompt: Prompt, completion: str) -> float | None:
        return self.grade(prompt, completion)[0]

    # ---- curriculum ------------------------------------------------------------------------------
    def observe(self, step: int, outcomes: dict[str, list[int]]) -> dict[str, float]:
        """A training step's outcomes per dataset move the curriculum; returns the levels to log."""
        if self.curriculum is not None:
            self.curriculum.observe(step, outcomes)
        stats = {f"curriculum/level/{s.name}": float(lv) for s in self.sources
                 if (lv := self.level_of(s.name)) is not None}  # fmt: skip
        if self.tokenizer is not None:
            stats["rollout/skipped_long_prompts"] = float(self.skipped_long)
        return stats

    def pass_rate_key(self, prompt: Prompt) -> str:
        """Generated questions rarely repeat: pass-rate pools (`rl.prompt_pools`) keep one pass rate per
        dataset and level, `<dataset>@L<level>` (`<dataset>` for one without levels)."""
        level = prompt.meta.get("level")
        return prompt.meta["dataset"] + ("" if level is None else f"@L{level}")

    def state_dict(self) -> dict:
        """The curriculum's state and the count of long prompts skipped so far (logged as a running
        total: a resumed run goes on counting from the checkpoint's)."""
        state = {"skipped_long": self.skipped_long}
        return state | ({} if self.curriculum is None else {"curriculum": self.curriculum.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        self.skipped_long = int(state.get("skipped_long", 0))
        if self.curriculum is not None and state.get("curriculum"):
            self.curriculum.load_state_dict(state["curriculum"])

    def run_facts(self) -> dict[str, str]:
        parts = [
            f"{s.name} (weight {s.weight:g}, level {s.level}, {len(self._heldout[s.name])} held out"
            + "".join(
                f", {len(self._extra_heldout[s.name, lv])} at level {lv}" for lv in self.extra_levels(s)
            )
            + (f"; trained at level {self.fixed_levels[s.name]}" if s.name in self.fixed_levels else "")
            + ")"
            for s in self.sources
        ]  # fewer than eval_size: the dataset has no more distinct ones
        facts = {"reasoning-gym": ", ".join(parts) + f"; scoring={self.scoring}"}
        if self.curriculum is not None:
            facts["curriculum"] = self.curriculum.describe()
        return facts

    def sft_examples(self, n: int, *, rng: np.random.Generator) -> list[tuple[str, str]]:
        """The tiny model's warm start: training problems at the starting levels (whatever the curriculum
        or `fixed_levels`, which the tiny model's cache key leaves out), answered in the taught format."""
        return [(p.text, self.tagged(p.answer)) for p in self.train_prompts(n, rng=rng, starting=True)]
