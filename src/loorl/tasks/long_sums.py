"""`task=long_sums` and `task=chat_long_sums`: sums of four 3-digit numbers, the arithmetic a small
model does not do in its head and a calculator does exactly (issue 41: a task where the tool is the
difference).

The answer is what the completion says after the last tool result (`answer_after`, the tail of
`tools.result_format`), or the whole completion where it called no tool: a sample that calls the
calculator must still write the answer itself, and a result the tool printed is not an answer.

`task=long_sums` is plain text for the tiny model: `123+456+789+101=`, and the completion is the exact
number. Its warm start teaches both ways to answer: a share `tool_share` of the examples call the
calculator (`<calc>123+456+789+101</calc> <result>1469</result>1469`), the rest answer directly; the
result's tokens carry no loss there (`Segment`), as they carry none in RL, where the tool inserts them.
`task=chat_long_sums` asks the question in the policy's chat template, with a system prompt that
describes the calculator; its reward reads the number the answer ends with.

`require_tool`: a correct answer earns its reward only where a calculator call ran (status ok): the
variant that rewards the tool's use, not only the answer (`Task.grade_with_tools`).
"""

from __future__ import annotations

import numpy as np

from loorl.errors import ConfigError
from loorl.tasks.base import Task
from loorl.tasks.data import filter_by_length, format_prompt
from loorl.tasks.verifiers import check_answer_mode, extract_final_number
from loorl.types import Prompt, Segment

TOOL_SYSTEM_PROMPT = (
    "You can use a calculator: write <calc>expression</calc> and its value follows as <result>value</result>."
)
# One worked exchange before the question, on a smaller sum than those asked. Greedy
# SmolLM2-135M-Instruct on 32 four-term sums: with the system prompt alone it called the calculator
# 0 times; with this turn, 23 (22 with the whole sum); with a four-term turn, 32 of 32, which leaves
# RL nothing to teach (held-out accuracy 99.5% before training)
TOOL_EXAMPLES = (("What is 12 + 30?", "<calc>12+30</calc> <result>42</result> The answer is 42."),)


class LongSumsTask(Task):
    name = "long_sums"

    def __init__(
        self,
        *,
        name: str = "long_sums",
        terms: int = 4,
        min_operand: int = 100,
        max_operand: int = 999,
        eval_size: int = 200,
        eval_seed: int = 1234,
        max_new_tokens: int = 32,  # the default of rollout.max_new_tokens; unused here
        answer_after: str = "</result>",
        require_tool: bool = False,
        tool_share: float = 0.5,
        tool_call: str = "<calc>{expression}</calc>",
        tool_result: str = " <result>{result}</result>",
    ) -> None:
        if terms < 2:
            raise ConfigError(f"task.terms={terms}: a sum needs 2 terms or more")
        if max_operand < min_operand:
            raise ConfigError(f"task.max_operand={max_operand} is below task.min_operand={min_operand}")
        if not 0.0 <= tool_share <= 1.0:
            raise ConfigError(
                f"task.tool_share={tool_share} must lie in [0, 1] (the share of warm-start examples)"
            )
        if "{expression}" not in tool_call or "{result}" not in tool_result:
            raise ConfigError("task.tool_call must hold {expression} and task.tool_result {result}")
        if not answer_after:
            raise ConfigError("task.answer_after must be a non-empty string: the end of a tool result")
        self.name, self.terms = name, terms
        self.min_operand, self.max_operand = min_operand, max_operand
        self.answer_after, self.require_tool = answer_after, require_tool
        self.tool_share, self.tool_call, self.tool_result = tool_share, tool_call, tool_result
        rng = np.random.default_rng(eval_seed)
        self._eval = [self._draw(rng) for _ in range(eval_size)]
        self._held_out = set(self._eval)  # training draws skip these (4 terms: ~1 in 3e9 would collide)

    def _draw(self, rng: np.random.Generator) -> tuple[int, ...]:
        return tuple(int(x) for x in rng.integers(self.min_operand, self.max_operand + 1, size=self.terms))

    def _prompt(self, terms: tuple[int, ...]) -> Prompt:
        expression = "+".join(map(str, terms))
        return Prompt(text=f"{expression}=", answer=str(sum(terms)), meta={"expression": expression})

    def train_prompts(self, n: int, *, rng: np.random.Generator) -> list[Prompt]:
        out = []
        while len(out) < n:
            terms = self._draw(rng)
            if terms not in self._held_out:
                out.append(self._prompt(terms))
        return out

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(t) for t in self._eval]

    def final_text(self, completion: str) -> str:
        """What the completion says after its last tool result (all of it where it called none)."""
        at = completion.rfind(self.answer_after)
        return completion if at < 0 else completion[at + len(self.answer_after) :]

    def extract_answer(self, prompt: Prompt, completion: str) -> str | None:
        return self.final_text(completion).strip() or None

    def reward(self, prompt: Prompt, completion: str) -> float | None:
        return float(self.extract_answer(prompt, completion) == prompt.answer)

    def grade_with_tools(self, prompt: Prompt, completion: str, calls) -> tuple[float | None, bool]:
        reward, correct = self.grade(prompt, completion)
        if self.require_tool and not any(call.status == "ok" for call in calls):
            return 0.0, correct  # right without the tool: correct, and unrewarded
        return reward, correct

    def sft_examples(self, n: int, *, rng: np.random.Generator) -> list[tuple[str, object]]:
        """(prompt, target): a share `tool_share` call the calculator, with the result's tokens
        untrained (`Segment(..., trained=False)`); the rest answer directly."""
        prompts = self.train_prompts(n, rng=rng)
        use = rng.random(n) < self.tool_share
        out: list[tuple[str, object]] = []
        for p, tool in zip(prompts, use):
            if not tool:
                out.append((p.text, p.answer))
                continue
            call = self.tool_call.replace("{expression}", p.meta["expression"])
            result = self.tool_result.replace("{result}", p.answer)
            out.append((p.text, [Segment(call), Segment(result, trained=False), Segment(p.answer)]))
        return out


class ChatLongSumsTask(LongSumsTask):
    """`task=chat_long_sums`: the same sums asked in the policy's chat template, with a system prompt
    that describes the calculator (`system_prompt`); the reward reads the number the text after the
    last result ends with (`answer_mode`, as `task=chat_arithmetic`)."""

    name = "chat_long_sums"

    def __init__(
        self,
        *,
        name: str = "chat_long_sums",
        question: str = "What is {expression}?",
        chat_template: bool | str = "auto",
        system_prompt: str | None = TOOL_SYSTEM_PROMPT,
        examples=TOOL_EXAMPLES,
        answer_mode: str = "strict",
        max_new_tokens: int = 48,
        **kwargs,
    ) -> None:
        check_answer_mode(answer_mode)
        if "{expression}" not in question:
            raise ConfigError(f"task.question={question!r} must hold {{expression}}")
        self.examples = worked_examples(examples)
        self.question, self.answer_mode = question, answer_mode
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.tokenizer = None  # set by prepare(): prompts are plain text until then
        super().__init__(name=name, max_new_tokens=max_new_tokens, **kwargs)

    def prepare(self, tokenizer, *, max_prompt_length: int) -> None:
        self.tokenizer = tokenizer
        widest = self._prompt((self.max_operand,) * self.terms).text
        filter_by_length([widest], tokenizer, max_length=max_prompt_length, on_overflow="error")

    def _prompt(self, terms: tuple[int, ...]) -> Prompt:
        expression = " + ".join(map(str, terms))
        question = self.question.replace("{expression}", expression)
        text = format_prompt(question, tokenizer=self.tokenizer,
                             use_chat_template=self.chat_template if self.tokenizer is not None else False,
                             system_prompt=self.system_prompt, examples=self.examples,
                             tools=self.tools_for({}))  # fmt: skip
        return Prompt(text=text, answer=str(sum(terms)), meta={"expression": expression.replace(" ", "")})

    def extract_answer(self, prompt: Prompt, completion: str) -> str | None:
        return extract_final_number(self.final_text(completion), mode=self.answer_mode)


def worked_examples(examples) -> tuple[tuple[str, str], ...]:
    """`task.examples` as (question, answer) pairs, or a one-line error naming the bad entry."""
    pairs = []
    for i, pair in enumerate(examples or ()):
        if isinstance(pair, str) or len(pair) != 2 or not all(isinstance(x, str) for x in pair):
            raise ConfigError(
                f"task.examples[{i}]={pair!r} must be a [question, answer] pair of strings (or set "
                "task.examples=[] for none)"
            )
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)
