"""task=long_sums and chat_long_sums (sums of four 3-digit numbers, where the calculator is the
difference), and tool calls reaching the task's verifier and the reward functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from loorl.errors import ConfigError
from loorl.models.tiny import build_char_tokenizer, greedy_exact, sft_batch
from loorl.rewards import RewardComposer, WeightedReward
from loorl.tasks.long_sums import TOOL_EXAMPLES, ChatLongSumsTask, LongSumsTask
from loorl.tools.base import ToolCall
from loorl.types import Prompt, Segment

OK = ToolCall("calculator", "123+456+789+101", "1469", "ok")
FAILED = ToolCall("calculator", "123+456+", "error: invalid syntax", "error")


def test_prompts_are_four_three_digit_terms_and_the_held_out_sums_are_never_drawn():
    task = LongSumsTask(eval_size=50)
    held_out = {p.text for p in task.eval_prompts()}
    train = task.train_prompts(400, rng=np.random.default_rng(0))
    assert not held_out & {p.text for p in train}
    for p in [*train[:20], *task.eval_prompts()[:20]]:
        terms = [int(t) for t in p.text.rstrip("=").split("+")]
        assert len(terms) == 4 and all(100 <= t <= 999 for t in terms)
        assert p.answer == str(sum(terms)) and p.meta["expression"] == p.text[:-1]


@pytest.mark.parametrize(
    ("completion", "correct"),
    [
        ("<calc>123+456+789+101</calc> <result>1469</result>1469", True),
        ("1469", True),  # in its head
        ("<calc>123+456+789+101</calc> <result>1469</result>", False),  # the tool's result is not an answer
        ("<calc>123+456+789+101</calc> <result>1469</result>1468", False),
        ("1469 <result>1469</result>1470", False),  # read after the last result only
        ("", False),
    ],
)
def test_the_answer_is_what_follows_the_last_tool_result(completion, correct):
    task = LongSumsTask()
    prompt = Prompt("123+456+789+101=", "1469", {"expression": "123+456+789+101"})
    assert task.grade(prompt, completion) == (float(correct), correct)


def test_require_tool_rewards_a_right_answer_only_after_a_call_that_ran():
    prompt = Prompt("123+456+789+101=", "1469", {"expression": "123+456+789+101"})
    right = "<calc>123+456+789+101</calc> <result>1469</result>1469"
    required = LongSumsTask(require_tool=True)
    assert required.grade_with_tools(prompt, right, [OK]) == (1.0, True)
    assert required.grade_with_tools(prompt, "1469", []) == (0.0, True)  # correct, unrewarded
    assert required.grade_with_tools(prompt, right, [FAILED]) == (0.0, True)
    assert LongSumsTask().grade_with_tools(prompt, "1469", []) == (1.0, True)
    rewards, correct, _ = required.grade_many([prompt] * 2, ["1469", right], tool_calls=[(), (OK,)])
    assert (rewards, correct) == ([0.0, 1.0], [True, True])


def test_the_warm_start_calls_the_calculator_in_its_share_with_the_result_untrained():
    task = LongSumsTask(tool_share=0.3)
    pairs = task.sft_examples(2000, rng=np.random.default_rng(1))
    tool = [target for _, target in pairs if not isinstance(target, str)]
    assert abs(len(tool) / len(pairs) - 0.3) < 0.03
    prompt, target = next((p, t) for p, t in pairs if not isinstance(t, str))
    expression, answer = prompt[:-1], str(sum(int(t) for t in prompt[:-1].split("+")))
    assert target == [Segment(f"<calc>{expression}</calc>"), Segment(f" <result>{answer}</result>", False),
                      Segment(answer)]  # fmt: skip
    tok = build_char_tokenizer()
    ids, mask = sft_batch([(prompt, target)], tok, max_len=512)  # [1, L], [1, L]
    text = [tok.decode([i]) for i in ids[0].tolist()]
    trained = "".join(t for t, m in zip(text, mask[0].tolist()) if m)
    untrained = "".join(t for t, m in zip(text, mask[0].tolist()) if not m)
    assert trained == f"<calc>{expression}</calc>{answer}<eos>"
    assert untrained == f"{prompt} <result>{answer}</result>"
    # greedy_exact skips the untrained result: predicting it wrong does not make the example wrong
    logits = torch.nn.functional.one_hot(ids[0, 1:], len(tok)).float()[None]  # [1, L-1, V] perfect
    logits = torch.cat([logits, torch.zeros(1, 1, len(tok))], dim=1)  # [1, L, V]
    result_at = [i for i, m in enumerate(mask[0].tolist()) if not m and i > len(prompt)]
    logits[0, result_at[0] - 1] = 0  # a wrong prediction of the result's first token
    assert greedy_exact(logits, ids, mask).item()
    logits[0, len(prompt) - 1] = 0  # a wrong first token of the call
    assert not greedy_exact(logits, ids, mask).item()


def test_the_chat_variant_reads_the_number_after_the_last_result():
    task = ChatLongSumsTask(eval_size=10)
    prompt = task.eval_prompts()[0]
    assert prompt.text.endswith(f"What is {prompt.meta['expression'].replace('+', ' + ')}?")
    calc = f"<calc>{prompt.meta['expression']}</calc> <result>{prompt.answer}</result>"
    good = f"Let me compute. {calc} So it is {prompt.answer}."
    assert task.grade(prompt, good) == (1.0, True)
    assert task.grade(prompt, f"<calc>1</calc> <result>{prompt.answer}</result> I do not know") == (
        0.0,
        False,
    )


def test_the_worked_example_is_graded_right_and_writes_the_result_as_the_tool_does(make_config):
    cfg = make_config("task=chat_long_sums", "tools=calculator")
    task = instantiate(cfg.task)
    ((question, answer),) = task.examples
    assert task.examples == TOOL_EXAMPLES  # the config's turn is the code's default
    expression = question.removeprefix("What is ").removesuffix("?").replace(" ", "")
    prompt = Prompt(question, str(sum(map(int, expression.split("+")))), {"expression": expression})
    assert task.grade(prompt, answer) == (1.0, True)
    result = cfg.tools.result_format.replace("{result}", prompt.answer)
    assert f"<calc>{expression}</calc>{result}" in answer  # as the tool would have inserted it
    shown = task.eval_prompts()[0].text  # plain text before prepare(): the turn, then the question
    assert shown.index(answer) < shown.index(task.eval_prompts()[0].meta["expression"].replace("+", " + "))
    assert answer not in ChatLongSumsTask(examples=[]).eval_prompts()[0].text


@pytest.mark.parametrize("examples", [["just a string"], [["q", "a", "extra"]], [["q", 3]]])
def test_bad_worked_examples_are_one_line(examples):
    with pytest.raises(ConfigError, match=r"^task\.examples\[0\]=.* must be a \[question, answer\] pair"):
        ChatLongSumsTask(examples=examples)


@pytest.mark.parametrize(
    ("options", "setting"),
    [({"terms": 1}, "task.terms"), ({"tool_share": 1.5}, "task.tool_share"),
     ({"tool_call": "<calc>"}, "task.tool_call"), ({"min_operand": 9, "max_operand": 1}, "task.max_operand")],
)  # fmt: skip
def test_bad_task_settings_are_one_line(options, setting):
    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
        LongSumsTask(**options)


def test_the_task_configs_compose(make_config):
    for name, cls in (("long_sums", LongSumsTask), ("chat_long_sums", ChatLongSumsTask)):
        cfg = make_config(f"task={name}")
        assert type(instantiate(cfg.task)) is cls
    cfg = make_config("experiment=tiny_long_sums")
    assert cfg.tools.max_turns == 1 and "calculator" in cfg.tools.available and cfg.task.name == "long_sums"
    warm_start = cfg.model.tiny.warm_start  # a fixed length: the probe's target is out of reach here
    assert warm_start.target_accuracy is None and warm_start.max_steps == 400 and cfg.rl.steps == 40


# ---- reward functions that read the tool calls ------------------------------------------------------
def _used_the_tool(prompts, completions, tool_calls, **_):
    return [float(any(c.status == "ok" for c in calls)) for calls in tool_calls]


def _plain(prompts, completions):
    return [1.0 for _ in completions]


def _kwargs(prompts, completions, **columns):
    return [
        float(len(columns.get("tool_calls", [[]] * len(completions))[i])) for i in range(len(completions))
    ]


def test_reward_functions_that_take_tool_calls_get_them_and_the_others_do_not():
    task = LongSumsTask(require_tool=True)
    prompts = [Prompt("123+456+789+101=", "1469", {})]  # no columns: _plain takes no **kwargs
    texts = [
        [
            "1469",
            "<calc>123+456+789+101</calc> <result>1469</result>1469",
            "<calc>123+456+</calc> <result>error</result>1",
        ]
    ]
    calls = [[(), (OK,), (FAILED,)]]
    composer = RewardComposer(
        [WeightedReward("task", "task"), WeightedReward("used", _used_the_tool, 0.5),
         WeightedReward("plain", _plain, 0.0), WeightedReward("kw", _kwargs, 0.0)],
        task=task,
    )  # fmt: skip
    graded = composer(prompts, texts, calls)
    assert graded.parts["task"].tolist() == [[0.0, 1.0, 0.0]]  # require_tool: the first is right, unrewarded
    assert graded.correct.tolist() == [[1.0, 1.0, 0.0]]
    assert graded.parts["used"].tolist() == [[0.0, 1.0, 0.0]]
    assert graded.parts["kw"].tolist() == [[0.0, 1.0, 1.0]]  # **kwargs receives them
    assert graded.rewards.tolist() == [[0.0, 1.5, 0.0]]
    without = composer(prompts, texts)  # a run without tools: no tool_calls for anyone
    assert without.parts["kw"].tolist() == [[0.0, 0.0, 0.0]]
    assert without.parts["task"].tolist() == [[1.0, 1.0, 0.0]]  # grade, not grade_with_tools
    assert without.parts["used"].isnan().all()  # a function that needs them is unscorable, counted


def test_a_raising_batch_is_retried_per_sample_with_each_samples_own_calls():
    seen = []

    def picky(prompts, completions, tool_calls):
        if len(completions) > 1:
            raise RuntimeError("one at a time")
        seen.append(tool_calls)
        return [float(len(tool_calls[0]))]

    composer = RewardComposer([WeightedReward("picky", picky)])
    prompts = [Prompt("1+1=", "2", {})]
    graded = composer(prompts, [["a", "b"]], [[(OK,), (OK, FAILED)]])
    assert graded.rewards.tolist() == [[1.0, 2.0]] and seen == [[[OK]], [[OK, FAILED]]]


def test_the_tools_are_part_of_the_runs_identity(make_config):
    """A resumed run whose tools differ from its checkpoint's is told so (`run_identity`'s "run" part);
    without tools the entry is None, as in checkpoints written before tools existed."""
    from loorl.config import load_settings
    from loorl.training.run_identity import run_identity

    def identity(*overrides):
        settings = load_settings(make_config(*overrides))
        return run_identity(settings, model="m", strategy="auto")["run"]["tools"]

    assert identity() is None and identity("tools=calculator", "tools.max_turns=0") is None
    assert identity("experiment=tiny_long_sums") == "calculator (max_turns 1, max_tokens 72)"
