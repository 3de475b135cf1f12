"""Environments with TRL's `environment_factory` contract (`environment._target_`,
`loorl.tools.environment`): one instance per sample, `reset(**row)`, public methods as tools called
in the Hermes format, `get_reward()` as the reward; a hostile or failing call is an error result and
the run goes on. The policy is scripted (`Scripted`: each turn's text a function of the transcript),
so that every call is the one the test means; the masks are the calculator's, id for id."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loorl.errors import ConfigError
from loorl.models.tiny import build_char_tokenizer
from loorl.rewards import RewardComposer, WeightedReward
from loorl.rollout.datamodule import RolloutDataModule
from loorl.rollout.engines.base import RolloutEngine
from loorl.rollout.multi_turn import ToolEngine
from loorl.settings import RLSettings, RolloutSettings, ToolsSettings
from loorl.tasks.long_sums import LongSumsTask
from loorl.tools.base import ToolCall
from loorl.tools.environment import Environment, parse_call, tools_prompt
from loorl.tools.toolset import BoundTool, ToolSet, build_toolset
from loorl.types import Completion, SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "environments"
RESULT = "<tool_response>{result}</tool_response>"
ENTERED = threading.Event()  # set by `Hostile.hang` once it runs


class Counter:
    """A test environment: `reset` keeps the row, `add` adds, `get_reward` reads the state."""

    instances: list[Counter] = []
    private_calls = 0

    def __init__(self) -> None:
        self.row, self.total, self.calls = None, 0, 0
        Counter.instances.append(self)

    def reset(self, **row) -> str | None:
        self.row = row
        return None

    def add(self, a: int, b: int = 0) -> int:
        """Add two integers to the running total.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        self.total += a + b
        return self.total

    def _secret(self) -> str:
        Counter.private_calls += 1
        return "secret"

    def get_reward(self) -> float:
        return float(self.total == int(self.row["answer"]))


class Hostile(Counter):
    """Methods that raise, hang and answer too much; a reward that raises on one row."""

    def boom(self) -> str:
        """Raise."""
        raise RuntimeError("kaboom")

    def hang(self) -> str:
        """Never return (in the test's time)."""
        ENTERED.set()
        time.sleep(30)
        return "late"

    def huge(self) -> str:
        """A very long answer."""
        return "x" * 100_000

    def get_reward(self) -> float:
        if self.row["answer"] == "13":
            raise ValueError("no reward for 13")
        return super().get_reward()


class Greeter(Counter):
    """`reset` returns text: inserted before the sample's first turn, masked."""

    def reset(self, **row) -> str | None:
        super().reset(**row)
        return f"Start at {row['answer']}."


class NoReward(Counter):
    get_reward = None


class Scripted(RolloutEngine):
    """A policy that writes `script(transcript text)` each turn (closing tags and EOS as written)."""

    name, stops_on_sequences = "scripted", True

    def __init__(self, tok, script) -> None:
        super().__init__(SamplingConfig(max_new_tokens=200), eos_token_ids=[tok.eos_token_id],
                         pad_token_id=tok.pad_token_id)  # fmt: skip
        self.tok, self.script = tok, script

    def sync(self, weights, version=None, *, force=False) -> None:
        return None

    def generate(self, prompt_ids, *, n, greedy=False, seed=None, stop=None, max_new_tokens=None):
        out = []
        for ids in prompt_ids:
            text = self.script(self.tok.decode(ids))
            finished = text.endswith("<eos>")
            turn = self.tok.encode(text.removesuffix("<eos>"), add_special_tokens=False)
            turn = turn + [self.tok.eos_token_id] if finished else turn
            out.append([Completion(turn, [-0.5] * len(turn), finished) for _ in range(n)])
        return out


def call(name, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def two_turns(first: str, answer: str = "7"):
    """Turn 1 writes `first`; after a result, the answer and EOS."""
    return lambda text: f"{answer}<eos>" if text.endswith("</tool_response>") else first


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def env_toolset(cls, *, timeout_s=5.0, max_result_chars=40) -> ToolSet:
    env = Environment(cls, timeout_s=timeout_s, max_result_chars=max_result_chars)
    tool = BoundTool(env.name, env.session, "<tool_call>", "</tool_call>", environment=env)
    return ToolSet([tool], timeout_s=timeout_s, max_result_chars=max_result_chars, result_format=RESULT)


def engine(tok, cls, script, **kw) -> ToolEngine:
    return ToolEngine(Scripted(tok, script), env_toolset(cls, **kw), tok, max_turns=2, max_tokens=200,
                      keep_cache=False)  # fmt: skip


def rollout(tok, cls, script, answers=("7",), n=2, **kw) -> list[list[Completion]]:
    rows = [{"prompt": "3+4=", "answer": a} for a in answers]
    ids = [tok.encode("3+4=", add_special_tokens=False) for _ in answers]
    return engine(tok, cls, script, **kw).generate(ids, n=n, seed=1, rows=rows)


# ---- the call format and its checks (no model) -------------------------------------------------
SCHEMAS = Environment(Hostile, timeout_s=1, max_result_chars=40).schemas


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("not json", "not JSON"),
        ('{"name": "add"', "not JSON"),
        ("[1, 2]", '{"name"'),
        ('{"name": "add", "arguments": {"a": 1}, "extra": 1}', '{"name"'),
        ('{"name": "nope", "arguments": {}}', "no tool named 'nope'"),
        ('{"name": "_secret", "arguments": {}}', "no tool named '_secret'"),
        ('{"name": "__init__", "arguments": {}}', "no tool named '__init__'"),
        ('{"name": "reset", "arguments": {}}', "no tool named 'reset'"),
        ('{"name": "get_reward", "arguments": {}}', "no tool named 'get_reward'"),
        ('{"name": "add", "arguments": [1]}', "arguments must be a JSON object"),
        ('{"name": "add", "arguments": {}}', "missing argument a"),
        ('{"name": "add", "arguments": {"a": 1, "c": 2}}', "no argument c"),
        ('{"name": "add", "arguments": {"a": "1"}}', "argument a must be integer, not str"),
        ('{"name": "add", "arguments": {"a": 1.5}}', "argument a must be integer, not float"),
        ('{"name": "add", "arguments": {"a": true}}', "argument a must be integer, not bool"),
        ("[" * 100_000, "not JSON"),
    ],
    ids=lambda value: value[:40] if len(value) > 40 else value,
)
def test_a_malformed_or_hostile_call_is_refused_before_any_call(text, why):
    with pytest.raises(Exception) as err:
        parse_call(text, SCHEMAS)
    assert why in str(err.value)


def test_a_well_formed_call_parses_to_its_name_and_arguments():
    assert parse_call('{"name": "add", "arguments": {"a": 1, "b": 2}}', SCHEMAS) == ("add", {"a": 1, "b": 2})
    assert parse_call('{"name": "add", "arguments": {"a": -3}}', SCHEMAS) == ("add", {"a": -3})
    assert set(SCHEMAS) == {"add", "boom", "hang", "huge"}  # public methods only, no reset/get_reward


def test_hostile_calls_become_error_results_and_never_run(tok):
    Counter.private_calls = 0
    Counter.instances.clear()
    for text in ['{"name": "_secret", "arguments": {}}', '{"name": "__class__", "arguments": {}}',
                 '{"name": "add", "arguments": {"a": "__import__(\'os\')"}}', "{bad json"]:  # fmt: skip
        groups = rollout(tok, Counter, two_turns(f"<tool_call>{text}</tool_call>"), n=1)
        (call_,) = groups[0][0].tool_calls
        assert call_.status == "error" and call_.result.startswith("error: "), call_
    assert Counter.private_calls == 0 and all(c.calls == 0 for c in Counter.instances)


def test_a_method_that_raises_hangs_or_answers_too_much_gives_an_error_or_cut_result(tok):
    ENTERED.clear()
    texts = {"boom": call("boom"), "hang": call("hang"), "huge": call("huge")}
    start = time.perf_counter()
    for name, text in texts.items():
        (group,) = rollout(tok, Hostile, two_turns(text), n=1, timeout_s=0.5)
        (made,) = group[0].tool_calls
        assert group[0].finished  # the sample went on and answered
        if name == "boom":
            assert made.status == "error" and "kaboom" in made.result
        elif name == "hang":
            assert made.status == "timeout" and made.result == "error: timed out after 0.5 s"
        else:
            assert made.status == "truncated" and len(made.result) == 40
    assert ENTERED.is_set() and time.perf_counter() - start < 5


# ---- one instance per sample, reset with the row, get_reward as the reward ---------------------
def test_each_sample_has_its_own_instance_reset_with_its_prompts_row(tok):
    Counter.instances.clear()
    groups = rollout(tok, Counter, two_turns(call("add", a=3, b=4)), answers=("7", "8"), n=3)
    assert len(Counter.instances) == 6  # 2 prompts x 3 samples (the schemas are read from the class)
    assert sorted(c.row["answer"] for c in Counter.instances) == ["7"] * 3 + ["8"] * 3  # (built in threads)
    assert all(c.calls == 1 and c.total == 7 for c in Counter.instances)  # one call each, none shared
    assert [[c.reward for c in g] for g in groups] == [[1.0] * 3, [0.0] * 3]


def test_without_get_reward_the_task_grades_and_a_failing_get_reward_is_unscorable(tok):
    (group,) = rollout(tok, NoReward, two_turns(call("add", a=3, b=4)), n=2)
    assert [c.reward for c in group] == [None, None]
    groups = rollout(tok, Hostile, two_turns(call("add", a=3, b=4)), answers=("7", "13"), n=2)
    assert [c.reward for c in groups[0]] == [1.0, 1.0]
    assert all(math.isnan(c.reward) for c in groups[1])


def test_the_datamodule_takes_get_reward_and_counts_a_failing_one_as_unscorable(tok):
    """The rollout's reward is get_reward()'s (the task's verifier would give 0: the answer written is
    wrong); a get_reward that raises leaves its samples NaN, counted, and the step goes on."""
    task = LongSumsTask(terms=2, min_operand=1, max_operand=9, eval_size=4)
    prompts = task.eval_prompts()[:2]
    prompts[1].answer = "13"  # Hostile.get_reward raises for this row

    def script(text):  # adds the prompt's two numbers, then writes a wrong answer
        if text.endswith("</tool_response>"):
            return "0<eos>"
        a, b = text.split("=")[0].split("+")
        return call("add", a=int(a), b=int(b))

    dm = RolloutDataModule(task=task, tokenizer=tok, engine=engine(tok, Hostile, script),
                           rl=RLSettings(prompts_per_step=2, samples_per_prompt=2, prompts_per_minibatch=2),
                           rollout=RolloutSettings(max_new_tokens=200),
                           rewards=RewardComposer([WeightedReward("task", "task")], task=task))  # fmt: skip
    out = dm.rollout(prompts, seed=0)
    rewards = out.batch.rewards.view(2, 2)
    assert rewards[0].tolist() == [1.0, 1.0]  # the right sum was added up
    assert rewards[1].isnan().all() and out.stats["rollout/unscorable"] == 2.0
    assert out.stats["rollout/accuracy"] == 0.0  # the task's verifier still grades the answer written


# ---- token in, token out: results masked exactly as the calculator's --------------------------
class Calc:
    """The calculator tool's spelling of the same exchange (a plain `run_call` tool)."""

    name = "calc"

    def __call__(self, text: str) -> str:
        return "7"


def test_result_ids_are_masked_exactly_as_the_calculators(tok):
    (env_group,) = rollout(tok, Counter, two_turns(call("add", a=3, b=4)), n=1)
    text = call("add", a=3, b=4)
    calc = ToolSet([BoundTool("calc", Calc(), "<tool_call>", "</tool_call>")], timeout_s=5,
                   max_result_chars=40, result_format=RESULT)  # fmt: skip
    calc_engine = ToolEngine(Scripted(tok, two_turns(text)), calc, tok, max_turns=2, max_tokens=200,
                             keep_cache=False)  # fmt: skip
    (calc_group,) = calc_engine.generate([tok.encode("3+4=", add_special_tokens=False)], n=1, seed=1)
    mine, theirs = env_group[0], calc_group[0]
    assert mine.token_ids == theirs.token_ids and mine.policy_mask == theirs.policy_mask
    assert mine.logprobs == theirs.logprobs
    inserted = tok.encode("<tool_response>7</tool_response>", add_special_tokens=False)
    assert mine.policy_mask == [1] * len(tok.encode(text)) + [0] * len(inserted) + [1, 1]
    assert mine.tool_calls[0].status == "ok" and mine.tool_calls[0].result == "7"


def test_reset_text_is_inserted_masked_before_the_first_turn(tok):
    text = call("add", a=3, b=4)
    (group,) = rollout(tok, Greeter, lambda seen: "7<eos>" if "</tool_call>" in seen else text, n=2)
    start = tok.encode("<tool_response>Start at 7.</tool_response>", add_special_tokens=False)
    for c in group:
        assert c.token_ids[: len(start)] == start and c.policy_mask[: len(start)] == [0] * len(start)
        assert c.tool_calls[0].status == "ok" and c.reward == 1.0


# ---- config --------------------------------------------------------------------------------------
def test_a_users_class_is_named_by_target_and_checked_before_any_model(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    tools = build_toolset(ToolsSettings(max_turns=1), "test_environment.Counter")
    assert tools.tools[0].name == "Counter" and tools.tools[0].start == "<tool_call>"
    with pytest.raises(ConfigError, match="cannot be imported"):
        build_toolset(ToolsSettings(max_turns=1), "nowhere.Env")
    with pytest.raises(ConfigError, match="is not a class"):
        build_toolset(ToolsSettings(max_turns=1), "test_environment.call")


def test_every_environment_config_composes_and_checks(default_cfg, monkeypatch):
    from loorl.config import check_config

    monkeypatch.syspath_prepend(str(EXAMPLES))
    for group in sorted((ROOT / "conf" / "environment").glob("*.yaml")):
        cfg = default_cfg(f"environment={group.stem}", "tools=calculator")
        assert check_config(cfg).environment.target == cfg.environment._target_
    s = check_config(default_cfg("experiment=tiny_sum_calculator"))
    assert s.environment.target == "sum_calculator.SumCalculatorEnv" and s.tools.max_turns == 1
    with pytest.raises(ConfigError, match="needs tools.max_turns > 0"):
        check_config(default_cfg("environment=sum_calculator"))
    assert "calculate" in tools_prompt("sum_calculator.SumCalculatorEnv")


def test_the_worked_example_keeps_the_contract():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from sum_calculator import SumCalculatorEnv
    finally:
        sys.path.remove(str(EXAMPLES))
    env = Environment(SumCalculatorEnv, timeout_s=1, max_result_chars=40)
    assert set(env.schemas) == {"calculate"} and not env.owns_reward  # the task grades the answer
    session = env.session({"prompt": "1+2+3+4=", "answer": "10", "expression": "1+2+3+4"})
    assert session.call('{"name": "calculate", "arguments": {"expression": "1+2+3+4"}}').result == "10"
    assert session.reward() is None
    bad = session.call('{"name": "calculate", "arguments": {"expression": "__import__(\'os\')"}}')
    assert isinstance(bad, ToolCall) and bad.status == "error" and bad.result.startswith("error: ValueError")


# ---- slow: the worked example in TRL, and a kill -9 resume ----------------------------------------
LOORL_CACHE = Path(os.path.expanduser(os.environ.get("LOORL_CACHE", "~/.cache/loorl")))
TRL_PYTHON = LOORL_CACHE / "trl-venv" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="TRL's venv is absent (scripts/bench_vs_trl.py makes it)")
def test_the_worked_environment_runs_unchanged_in_trls_grpo_trainer(tmp_path):
    """examples/environments/sum_calculator.py, as it is, in TRL's GRPOTrainer(environment_factory=...):
    two GRPO steps with its tool called (scripts/trl_environment.py)."""
    cmd = [str(TRL_PYTHON), str(ROOT / "scripts" / "trl_environment.py"), str(EXAMPLES / "sum_calculator.py"),
           "SumCalculatorEnv", "--out", str(tmp_path), "--steps", "2"]  # fmt: skip
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert len(rows) == 2 and all("reward" in r for r in rows)
    assert sum(r["tools/call_frequency"] for r in rows) > 0, rows  # the environment's tool ran in TRL


@pytest.mark.slow
def test_a_killed_run_with_an_environment_resumes_to_the_same_run(tmp_path, model_cache):
    """The worked example's run after a kill -9 logs the uninterrupted run's values, tools/ and
    rewards (get_reward's) included."""
    from fixtures import ON_CPU, assert_same_run, metric_values, start_and_signal

    def command(run):
        return [sys.executable, str(ROOT / "src" / "train.py"), "debug=quick",
                "experiment=tiny_sum_calculator", f"model.cache_dir={model_cache}", *ON_CPU, "rl.steps=6",
                "checkpoint_every=2", "val_every=3", f"hydra.run.dir={run}"]  # fmt: skip

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(EXAMPLES)]),
               TOKENIZERS_PARALLELISM="false")  # fmt: skip

    def run_to_end(cmd):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    straight, run = tmp_path / "straight", tmp_path / "run"
    run_to_end(command(straight))
    values = metric_values(straight).items()
    calls = [float(v[0]) for (key, _), v in values if key == "tools/calls_per_sample"]
    assert calls and max(calls) > 0
    first = run / "checkpoints" / "epoch=3-step=4.ckpt"
    killed = start_and_signal(command(run), first, signal.SIGKILL, env=env, timeout=900)
    assert killed.returncode == -signal.SIGKILL
    run_to_end([*command(run), "resume_from=auto"])
    assert_same_run(straight, run)
