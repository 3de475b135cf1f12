"""Environments with TRL's `environment_factory` contract (`environment._target_`,
`loorl.tools.environment`): one instance per sample, `reset(**row)`, public methods as tools called
in the Hermes format, `get_reward()` as the reward; a hostile or failing call is an error result and
the run goes on. The policy is scripted (`Scripted`: each turn's text a function of the transcript),
so that every call is the one the test means; the masks are the calculator's, id for id."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
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
from plugins.environments import AsyncReward, Counter, Greeter, Hostile, InitFails, RandomStart, Unrouted

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "environments"
RESULT = "<tool_response>{result}</tool_response>"
ISOLATIONS = ("process", "thread")
_ENVIRONMENTS: dict = {}  # (class, isolation, limits) -> Environment: one set of worker processes each


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


@pytest.fixture(scope="module", autouse=True)
def _close_environments():
    yield
    for env in _ENVIRONMENTS.values():
        env.close()
    _ENVIRONMENTS.clear()


def environment(cls, isolation="process", *, timeout_s=5.0, max_result_chars=40, **kw) -> Environment:
    """One `Environment` per class and settings for the module: its worker processes start once."""
    key = (cls, isolation, timeout_s, max_result_chars, tuple(sorted(kw.items())))
    if key not in _ENVIRONMENTS:
        _ENVIRONMENTS[key] = Environment(cls, timeout_s=timeout_s, max_result_chars=max_result_chars,
                                         isolation=isolation, **kw)  # fmt: skip
    return _ENVIRONMENTS[key]


def env_toolset(cls, isolation="process", **kw) -> ToolSet:
    env = environment(cls, isolation, **kw)
    tool = BoundTool(env.name, env.session, "<tool_call>", "</tool_call>", environment=env)
    return ToolSet(
        [tool], timeout_s=env.timeout_s, max_result_chars=env.max_result_chars, result_format=RESULT
    )


def engine(tok, cls, script, isolation="process", **kw) -> ToolEngine:
    return ToolEngine(Scripted(tok, script), env_toolset(cls, isolation, **kw), tok, max_turns=2,
                      max_tokens=400, keep_cache=False)  # fmt: skip


def rollout(
    tok, cls, script, answers=("7",), n=2, isolation="process", rows=None, **kw
) -> list[list[Completion]]:
    rows = rows or [{"prompt": "3+4=", "answer": a} for a in answers]
    ids = [tok.encode(row["prompt"], add_special_tokens=False) for row in rows]
    return engine(tok, cls, script, isolation, **kw).generate(ids, n=n, seed=1, rows=rows)


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
    assert set(SCHEMAS) == {
        "add",
        "add_later",
        "boom",
        "exit",
        "hang",
        "huge",
        "memory",
        "pid",
        "segfault",
        "sleep",
    }


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_hostile_calls_become_error_results_and_never_run(tok, isolation):
    for text in ['{"name": "_secret", "arguments": {}}', '{"name": "__class__", "arguments": {}}',
                 '{"name": "add", "arguments": {"a": "__import__(\'os\')"}}', "{bad json"]:  # fmt: skip
        script = lambda seen, text=text: (
            (  # noqa: E731 - after the refused call, the total so far
                call("add", a=0) if seen.count("<tool_response>") == 1 else f"<tool_call>{text}</tool_call>"
            )
            if "<eos>" not in seen and seen.count("<tool_response>") < 2
            else "7<eos>"
        )
        (group,) = rollout(tok, Counter, script, n=1, isolation=isolation)
        refused, total = group[0].tool_calls
        assert refused.status == "error" and refused.result.startswith("error: "), refused
        assert total.status == "ok" and total.result == "0"  # add ran once, and _secret never (it raises)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_method_that_raises_hangs_or_answers_too_much_gives_an_error_or_cut_result(tok, isolation):
    texts = {"boom": call("boom"), "sleep": call("sleep", seconds=3.0), "huge": call("huge"),
             "async": call("add_later", a=7)}  # fmt: skip
    start = time.perf_counter()
    for name, text in texts.items():
        (group,) = rollout(tok, Hostile, two_turns(text), n=1, timeout_s=0.5, isolation=isolation)
        (made,) = group[0].tool_calls
        assert group[0].finished  # the sample went on and answered
        if name == "boom":
            assert made.status == "error" and made.result == "error: RuntimeError: kaboom"
        elif name == "sleep":
            assert made.status == "timeout" and made.result == "error: timed out after 0.5 s"
        elif name == "huge":
            assert made.status == "truncated" and len(made.result) == 40
        else:  # an async def method, awaited
            assert made.status == "ok" and made.result == "7"
    assert time.perf_counter() - start < 5


# ---- isolation process: what a method does to its process stays there ----------------------------
FAILURES = {  # a method's failure -> (ToolCall status, its result)
    "hang": ("timeout", "error: timed out after 1 s"),
    "exit": ("crashed", "error: the environment's worker process exited with status 3"),
    "segfault": ("crashed", "error: the environment's worker process was killed by SIGSEGV"),
    "memory": (
        "crashed",
        "error: the environment's worker process ran out of memory (environment.memory_mb=512)",
    ),
}


def fail_then_add(mode: str):
    """The policy of prompt 9+9=: calls `mode`, then add, then answers 7; of any other: add, then 7."""

    def script(seen: str) -> str:
        if "<tool_response>" not in seen:
            return call(mode) if seen.startswith("9+9=") else call("add", a=3, b=4)
        if seen.startswith("9+9=") and seen.count("<tool_response>") == 1:
            return call("add", a=7)
        return "7<eos>"

    return script


FAILING_ROWS = [{"prompt": "9+9=", "answer": "7"}, {"prompt": "3+4=", "answer": "7"}]


@pytest.mark.parametrize("mode", list(FAILURES))
def test_a_method_that_hangs_exits_segfaults_or_overruns_memory_ends_only_its_worker(tok, mode):
    """The worker is killed (nothing of it left running) and replaced; the sample gets an error result,
    its later calls an error, its reward NaN; the other sample is untouched."""
    limits = dict(timeout_s=1.0, max_result_chars=100, memory_mb=512)
    env = environment(Hostile, **limits)
    start = time.perf_counter()
    bad, good = rollout(tok, Hostile, fail_then_add(mode), rows=FAILING_ROWS, n=1, **limits)
    assert time.perf_counter() - start < 8
    failed, after = bad[0].tool_calls
    assert (failed.status, failed.result) == FAILURES[mode]
    assert after.status == "error" and after.result == FAILURES[mode][1].replace(
        "timed out after", "the environment's worker process timed out after"
    )
    assert math.isnan(bad[0].reward) and bad[0].environment_events == ("worker_lost",)
    assert [c.status for c in good[0].tool_calls] == ["ok"] and good[0].reward == 1.0
    assert not good[0].environment_events
    assert env.pool.killed and all(_gone(pid) for pid in env.pool.killed)  # nothing of it left running
    (again,) = rollout(tok, Hostile, two_turns(call("add", a=3, b=4)), n=1, **limits)
    assert again[0].reward == 1.0  # a new worker serves the next sample


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie its zygote has yet to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.parametrize("where", ["reset", "get_reward", "constructor"])
def test_a_reset_get_reward_or_constructor_that_crashes_leaves_its_sample_unscorable(tok, where):
    rows = [{"prompt": "3+4=", "answer": "7", "fail_in": where, "fail": "segfault"},
            {"prompt": "3+4=", "answer": "7"}]  # fmt: skip
    cls = InitFails if where == "constructor" else Hostile
    bad, good = rollout(tok, cls, two_turns(call("add", a=3, b=4)), rows=rows, n=1, timeout_s=1.0)
    assert math.isnan(bad[0].reward)
    if where == "get_reward":
        assert bad[0].tool_calls[0].status == "ok" and bad[0].environment_events == (
            "worker_lost",
            "reward_failed",
        )
    else:
        assert bad[0].tool_calls[0].result.startswith("error: the environment's reset failed: worker process")
        assert bad[0].environment_events == ("worker_lost", "reset_failed")
    if where != "constructor":
        assert good[0].reward == 1.0 and not good[0].environment_events


def test_workers_shared_by_sessions_take_each_others_instances_down_and_count_them(tok):
    """environment.workers=1: both samples live in one worker; one's exit ends the other's instance."""
    bad, good = rollout(tok, Hostile, fail_then_add("exit"), rows=FAILING_ROWS, n=1, timeout_s=1.0, workers=1)
    assert bad[0].tool_calls[0].status == "crashed" and bad[0].environment_events[0] == "worker_lost"
    assert good[0].environment_events[0] == "session_lost" and math.isnan(good[0].reward)


def test_each_sample_gets_its_own_seeded_random_stream_that_repeats(tok):
    """A worker's `random` is seeded per sample from the call's seed: the samples differ, runs repeat."""
    from loorl.rollout.multi_turn import session_seed

    assert session_seed(1, 0) != session_seed(1, 1) and session_seed(1, 0) == session_seed(1, 0)
    assert session_seed(None, 3) == session_seed(None, 3)


# ---- one instance per sample, reset with the row, get_reward as the reward ---------------------
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_each_sample_has_its_own_instance_reset_with_its_prompts_row(tok, isolation):
    groups = rollout(
        tok, Counter, two_turns(call("add", a=3, b=4)), answers=("7", "8"), n=3, isolation=isolation
    )
    assert [[c.tool_calls[0].result for c in g] for g in groups] == [["7"] * 3] * 2  # no total shared
    assert [[c.reward for c in g] for g in groups] == [[1.0] * 3, [0.0] * 3]  # each reset with its row


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_without_get_reward_the_task_grades_and_a_failing_get_reward_is_unscorable(tok, isolation):
    class_without = type("NoReward", (Counter,), {"get_reward": None}) if isolation == "thread" else None
    if class_without is not None:
        (group,) = rollout(tok, class_without, two_turns(call("add", a=3, b=4)), n=2, isolation=isolation)
        assert [c.reward for c in group] == [None, None]
    rows = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "3+4=", "answer": "7", "fail_in": "get_reward",
                                                "fail": "raise"}]  # fmt: skip
    groups = rollout(tok, Hostile, two_turns(call("add", a=3, b=4)), rows=rows, n=2, isolation=isolation)
    assert [c.reward for c in groups[0]] == [1.0, 1.0]
    assert all(math.isnan(c.reward) and c.environment_events == ("reward_failed",) for c in groups[1])
    (group,) = rollout(tok, AsyncReward, two_turns(call("add", a=1)), n=1, isolation=isolation)
    assert group[0].reward == 0.25  # an async def get_reward, awaited


def test_the_datamodule_takes_get_reward_and_counts_a_failing_one_as_unscorable(tok):
    """The rollout's reward is get_reward()'s (the task's verifier would give 0: the answer written is
    wrong); a get_reward that raises leaves its samples NaN, counted, and the step goes on."""
    task = LongSumsTask(terms=2, min_operand=1, max_operand=9, eval_size=4)
    prompts = task.eval_prompts()[:2]
    prompts[1].meta |= {"fail_in": "get_reward", "fail": "raise"}  # Hostile.get_reward raises for this row

    def script(text):  # adds the prompt's two numbers, then writes a wrong answer
        if text.endswith("</tool_response>"):
            return "0<eos>"
        a, b = text.split("=")[0].split("+")
        return call("add", a=int(a), b=int(b))

    dm = RolloutDataModule(task=task, tokenizer=tok, engine=engine(tok, Hostile, script),
                           rl=RLSettings(prompts_per_step=2, samples_per_prompt=2, prompts_per_minibatch=2),
                           rollout=RolloutSettings(max_new_tokens=200),
                           rewards=RewardComposer([WeightedReward("task", "task")], task=task))  # fmt: skip
    out = dm.sample_and_grade(prompts, seed=0)
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


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_reset_text_the_group_shares_is_appended_to_its_prompt_as_trl_does(tok, isolation):
    """Every sample of the group got "Start at 7.": it goes at the end of the prompt's last user message
    (here the whole plain-text prompt), the group's one prompt; none of it is in the completion."""
    text = call("add", a=3, b=4)
    (group,) = rollout(tok, Greeter, lambda seen: "7<eos>" if "</tool_call>" in seen else text, n=2,
                       isolation=isolation)  # fmt: skip
    prompt = tok("3+4=Start at 7.", add_special_tokens=False).input_ids
    for c in group:
        assert c.prompt_ids == prompt and c.token_ids[: len(tok.encode(text))] == tok.encode(text)
        assert (
            "reset_text_in_prompt" in c.environment_events
            and c.tool_calls[0].status == "ok"
            and c.reward == 1.0
        )


def test_reset_text_placed_in_a_chat_prompt_ends_the_last_user_message(tok):
    """Under a chat template the text goes before the end of the user's message and the assistant's
    header, as TRL's `content + observation` renders."""
    from copy import deepcopy

    from loorl.rollout.multi_turn import user_message_tail

    chat = deepcopy(tok)
    chat.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}<assistant>"
    )
    assert user_message_tail(chat) == "</s><assistant>" and user_message_tail(tok) == ""
    rendered = chat.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False,
                                        add_generation_prompt=True)  # fmt: skip
    tools = engine(chat, Greeter, lambda seen: "7<eos>")
    placed = tools.in_prompt(chat(rendered, add_special_tokens=False).input_ids, "Start at 7.")
    expected = chat.apply_chat_template([{"role": "user", "content": "3+4=Start at 7."}], tokenize=False,
                                        add_generation_prompt=True)  # fmt: skip
    assert chat.decode(placed) == expected


def test_reset_texts_that_differ_within_a_group_are_inserted_masked_before_the_first_turn(tok):
    text = call("add", a=3, b=4)
    (group,) = rollout(tok, RandomStart, lambda seen: "7<eos>" if "</tool_call>" in seen else text, n=2)
    starts = []
    for c in group:
        head = tok.decode(c.token_ids[: c.policy_mask.index(1)])
        assert head.startswith("<tool_response>Start at ") and c.prompt_ids is None
        assert "reset_text_after" in c.environment_events and c.tool_calls[0].status == "ok"
        starts.append(head)
    assert starts[0] != starts[1]  # each sample's own seeded stream
    (again,) = rollout(tok, RandomStart, lambda seen: "7<eos>" if "</tool_call>" in seen else text, n=2)
    assert [c.token_ids for c in again] == [c.token_ids for c in group]  # and the same again


def test_the_datamodule_trains_on_the_prompt_with_resets_text_in_it(tok):
    task = LongSumsTask(terms=2, min_operand=1, max_operand=9, eval_size=4)
    prompts = task.eval_prompts()[:2]
    dm = RolloutDataModule(task=task, tokenizer=tok, engine=engine(tok, Greeter, lambda seen: "7<eos>"),
                           rl=RLSettings(prompts_per_step=2, samples_per_prompt=2, prompts_per_minibatch=2),
                           rollout=RolloutSettings(max_new_tokens=200),
                           rewards=RewardComposer([WeightedReward("task", "task")], task=task))  # fmt: skip
    out = dm.sample_and_grade(prompts, seed=0)
    rows = [tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in
            zip(out.batch.input_ids.tolist(), out.batch.attention_mask.tolist())]  # fmt: skip
    assert rows[0] == f"{prompts[0].text}Start at {prompts[0].answer}.7<eos>" and rows[0] == rows[1]
    assert (
        out.stats["tools/env_reset_text_in_prompt"] == 4.0 and out.stats["tools/env_reset_text_after"] == 0.0
    )


def test_several_environments_are_routed_by_the_rows_column_each_with_its_own_tools(tok):
    """environment.routes: each row's `environment` column picks its class; a call sees that class's
    tools only; the column is not passed to reset; a row naming no route is one line."""
    from loorl.tools.environment import Environments

    plain_env, hostile_env = (
        environment(Unrouted, max_result_chars=100),
        environment(Hostile, max_result_chars=100),
    )
    routes = Environments({"plain": plain_env, "hostile": hostile_env}, "environment")
    toolset = ToolSet(
        [BoundTool(routes.name, routes.session, "<tool_call>", "</tool_call>", environment=routes)],
        timeout_s=5,
        max_result_chars=100,
        result_format=RESULT,
    )
    tools = ToolEngine(Scripted(tok, two_turns(call("boom"))), toolset, tok, max_turns=2, max_tokens=400,
                       keep_cache=False)  # fmt: skip
    rows = [{"prompt": "3+4=", "answer": "7", "environment": name} for name in ("plain", "hostile")]
    ids = [tok.encode("3+4=", add_special_tokens=False)] * 2
    plain, hostile = tools.generate(ids, n=1, seed=1, rows=rows)
    assert plain[0].tool_calls[0].result.startswith("error: no tool named 'boom'; the tools are add, pid")
    assert hostile[0].tool_calls[0].result == "error: RuntimeError: kaboom"
    assert plain[0].reward == 0.0 and not plain[0].environment_events  # reset ran, without the column
    assert routes.tools()["plain"] == list(plain_env.schemas.values())
    with pytest.raises(ConfigError, match="environment='nowhere' names none of environment.routes"):
        tools.generate(
            ids[:1], n=1, seed=1, rows=[{"prompt": "3+4=", "answer": "7", "environment": "nowhere"}]
        )


def test_a_prompt_carries_its_rows_environments_tools():
    from loorl.tasks.long_sums import LongSumsTask

    task = LongSumsTask(terms=2, min_operand=1, max_operand=9, eval_size=4)
    assert task.tools_for({"environment": "a"}) is None
    task.prompt_tools = [{"name": "x"}]
    assert task.tools_for({}) == [{"name": "x"}]
    task.prompt_tools = {"a": [{"name": "x"}], "b": [{"name": "y"}]}
    assert task.tools_for({"environment": "b"}) == [{"name": "y"}] and task.tools_for({}) is None


# ---- config --------------------------------------------------------------------------------------
def test_a_users_class_is_named_by_target_and_checked_before_any_model(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    tools = build_toolset(ToolsSettings(max_turns=1), "plugins.environments.Counter")
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
    routed = check_config(
        default_cfg(
            "tools.max_turns=1",
            "+environment.routes.a=sum_calculator.SumCalculatorEnv",
            "+environment.routes.b=plugins.environments.Counter",
        )
    )
    assert routed.environment.chosen == {
        "a": "sum_calculator.SumCalculatorEnv",
        "b": "plugins.environments.Counter",
    }
    with pytest.raises(ConfigError, match="are both set"):
        check_config(default_cfg("environment=sum_calculator", "tools.max_turns=1",
                                 "+environment.routes.b=plugins.environments.Counter"))  # fmt: skip
    for isolation in ("process", "thread"):
        assert (
            check_config(
                default_cfg(
                    "environment=sum_calculator", "tools.max_turns=1", f"environment.isolation={isolation}"
                )
            ).environment.isolation
            == isolation
        )
    from loorl.training.run_identity import environment_identity

    assert environment_identity(check_config(default_cfg()).environment) is None  # as in older checkpoints
    assert (
        environment_identity(s.environment) == "sum_calculator.SumCalculatorEnv (tools in prompt true)"
        and environment_identity(routed.environment)
        == "a: sum_calculator.SumCalculatorEnv, b: plugins.environments.Counter (tools in prompt true)"
    )
    with pytest.raises(ConfigError, match="environment.isolation"):
        check_config(
            default_cfg("environment=sum_calculator", "tools.max_turns=1", "environment.isolation=fork")
        )
    assert "calculate" in tools_prompt("sum_calculator.SumCalculatorEnv")


def test_the_worked_example_keeps_the_contract(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the workers import it from the trainer's sys.path
    from sum_calculator import SumCalculatorEnv

    env = environment(SumCalculatorEnv, timeout_s=1)
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
@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="no TRL venv (scripts/bench/bench_vs_trl.py makes it)")
def test_the_worked_environment_runs_unchanged_in_trls_grpo_trainer(tmp_path):
    """examples/environments/sum_calculator.py, as it is, in TRL's GRPOTrainer(environment_factory=...):
    two GRPO steps with its tool called (scripts/peers/trl_environment.py)."""
    script = ROOT / "scripts" / "peers" / "trl_environment.py"
    cmd = [str(TRL_PYTHON), str(script), str(EXAMPLES / "sum_calculator.py"), "SumCalculatorEnv",
           "--out", str(tmp_path), "--steps", "2"]  # fmt: skip
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert len(rows) == 2 and all("reward" in r for r in rows)
    assert sum(r["tools/call_frequency"] for r in rows) > 0, rows  # the environment's tool ran in TRL


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_killed_run_with_an_environment_resumes_to_the_same_run(tmp_path, model_cache, isolation):
    """The worked example's run after a kill -9 logs the uninterrupted run's values, tools/ and
    rewards (get_reward's) included, in each isolation; the killed run's worker processes end with it."""
    from fixtures import ON_CPU, assert_same_run, metric_values, start_and_signal

    def command(run):
        return [sys.executable, str(ROOT / "src" / "train.py"), "debug=quick",
                "experiment=tiny_sum_calculator", f"model.cache_dir={model_cache}", *ON_CPU, "rl.steps=6",
                "checkpoint_every=2", "val_every=3", f"hydra.run.dir={run}",
                f"environment.isolation={isolation}"]  # fmt: skip

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
    if isolation == "process":  # the zygote reads its closed socket, ends its workers (and they die with it)
        zygotes = [
            int(w)
            for w in re.findall(r"worker processes forked from pid (\d+)", (run / "train.log").read_text())
        ]
        time.sleep(1.0)
        assert zygotes and all(_gone(pid) for pid in zygotes)
        assert not [pid for pid in _loorl_env_processes() if _parent(pid) in zygotes]
    run_to_end([*command(run), "resume_from=auto"])
    assert_same_run(straight, run)


def _loorl_env_processes() -> list[int]:
    """Live zygotes and workers of environment isolation (their process names)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip().startswith("loorl-env-") and not _gone(
                    int(entry.name)
                ):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None
