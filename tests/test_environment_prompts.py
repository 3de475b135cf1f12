"""`environment.tools_in_prompt`: an environment's tools written into every prompt a task renders with a
chat template, as the template's `tools=` (TRL's `GRPOTrainer._tokenize_prompts` renders each prompt with
`apply_chat_template(conversation, tools=<the environment's methods> or None, add_generation_prompt=True)`);
prompts in plain text unchanged; a template that cannot write the tools is one line naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures import write_gsm8k
from loorl.build import build_task
from loorl.config import check_config, load_settings
from loorl.errors import ConfigError
from loorl.models.tiny import build_char_tokenizer
from loorl.tasks.data import format_prompt
from loorl.tasks.mixed import MixedTask
from loorl.tools.environment import Environment

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "environments"
TARGET = "sum_calculator.SumCalculatorEnv"
CHAT_ENV = ("task=chat_long_sums", "environment=sum_calculator", "tools.max_turns=1")

# Qwen2.5's chat template (as TRL 1.16 ships it, trl/chat_templates/qwen2_5.jinja): the Hermes tools block
# in the system message when `tools` is given
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 - the template's own lines (its tool-call and tool-message branches left out)
# ChatML without tools: a template that ignores `tools=`
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer(template: str | None):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


@pytest.fixture
def example_env(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def schemas() -> list[dict]:
    return Environment.of(TARGET, timeout_s=1.0, max_result_chars=1).tools()


def chat_task(default_cfg, *overrides: str):
    return build_task(load_settings(default_cfg(*CHAT_ENV, *overrides)))


def conversation(task, prompt) -> list[dict]:
    """The messages chat_long_sums renders: its system prompt, worked turns and the question."""
    question = task.question.replace("{expression}", " + ".join(prompt.meta["expression"].split("+")))
    messages = [{"role": "system", "content": task.system_prompt}]
    for q, a in task.examples:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages + [{"role": "user", "content": question}]


# ---- (a) a real task's prompts carry the tools exactly as the chat template writes them ---------------
def test_chat_prompts_carry_the_environments_tools_as_the_template_renders_them(default_cfg, example_env):
    task = chat_task(default_cfg)
    tools = schemas()
    assert task.prompt_tools == tools and tools[0]["function"]["name"] == "calculate"
    tok = tokenizer(QWEN25_TEMPLATE)
    task.prepare(tok, max_prompt_length=4096)
    rng = __import__("numpy").random.default_rng(0)
    for p in [task.eval_prompts()[0], *task.train_prompts(3, rng=rng)]:  # held-out and training prompts
        messages = conversation(task, p)
        assert p.text == tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
        assert json.dumps(tools[0], ensure_ascii=False) in p.text  # the schema, inside <tools></tools>
        assert '"name": "calculate"' in p.text
        assert '"description": "Evaluate an integer arithmetic expression exactly."' in p.text
        assert p.text.index("<tools>\n") < p.text.index('"calculate"') < p.text.index("\n</tools>")


def test_tools_in_prompt_false_gives_todays_prompt(default_cfg, example_env):
    tok = tokenizer(QWEN25_TEMPLATE)
    off = chat_task(default_cfg, "environment.tools_in_prompt=false")
    assert off.prompt_tools is None
    without_env = build_task(load_settings(default_cfg("task=chat_long_sums")))
    assert without_env.prompt_tools is None
    for task in (off, without_env):
        task.prepare(tok, max_prompt_length=4096)
    p = off.eval_prompts()[0]
    assert p.text == without_env.eval_prompts()[0].text
    assert p.text == tok.apply_chat_template(conversation(off, p), tokenize=False, add_generation_prompt=True)
    assert "calculate" not in p.text and "<tools>" not in p.text


def test_plain_text_prompts_are_unchanged(default_cfg, example_env):
    """No chat template (the tiny model's tokenizer): the prompt is the same text with or without tools."""
    on, off = chat_task(default_cfg), chat_task(default_cfg, "environment.tools_in_prompt=false")
    assert on.prompt_tools and off.prompt_tools is None
    for task in (on, off):
        task.prepare(tokenizer(None), max_prompt_length=4096)
    assert on.eval_prompts()[0].text == off.eval_prompts()[0].text
    assert "calculate" not in on.eval_prompts()[0].text


def test_a_mixed_tasks_sources_carry_the_tools(tmp_path, example_env):
    """task=mix renders through its sources (each a DatasetTask): they get the mix's tools."""
    data = write_gsm8k(tmp_path / "gsm8k", train=4, test=2)
    task = MixedTask(sources={"gsm8k": {"verifier": "gsm8k", "path": str(data)}}, system_prompt="Be brief.")
    task.prompt_tools = schemas()  # as build_task sets it
    task.prepare(tokenizer(QWEN25_TEMPLATE), max_prompt_length=4096)
    texts = [p.text for p in task.eval_prompts()]
    assert texts and all('"name": "calculate"' in t for t in texts)


def test_format_prompt_passes_tools_or_none():
    """`tools=[]` renders as no tools (`or None`, as TRL: some templates write boilerplate for [])."""
    tok = tokenizer("{% if tools is not none %}TOOLS {% endif %}" + CHATML)
    plain = format_prompt("What is 1 + 2?", tokenizer=tok)
    assert format_prompt("What is 1 + 2?", tokenizer=tok, tools=[]) == plain
    assert not plain.startswith("TOOLS")


# ---- (b) the option composes ----------------------------------------------------------------------
def test_the_option_composes_in_every_environment_config(default_cfg, example_env):
    for group in sorted((ROOT / "conf" / "environment").glob("*.yaml")):
        choice = (f"environment={group.stem}", "tools=calculator")
        assert check_config(default_cfg(*choice)).environment.tools_in_prompt is True  # the default
        off = default_cfg(*choice, "environment.tools_in_prompt=false")
        assert check_config(off).environment.tools_in_prompt is False
    s = check_config(default_cfg("experiment=tiny_sum_calculator", "environment.tools_in_prompt=false"))
    assert s.environment.target == TARGET and not s.environment.tools_in_prompt
    with pytest.raises(ConfigError, match="environment.tools_in_prompt"):
        check_config(default_cfg("environment=sum_calculator", "tools.max_turns=1",
                                 "environment.tools_in_prompt=maybe"))  # fmt: skip


# ---- (c) a template that cannot write the tools: one line naming the fix -------------------------------
def test_a_template_that_ignores_tools_is_one_line_naming_the_fix(default_cfg, example_env):
    task = chat_task(default_cfg)
    fix = r"wrote no tool 'calculate'.*environment\.tools_in_prompt=false"
    with pytest.raises(ConfigError, match=fix) as err:
        task.prepare(tokenizer(CHATML), max_prompt_length=4096)
    assert "\n" not in str(err.value)
    # the tool's name in the system prompt is not the template writing it
    named = chat_task(default_cfg, "task.system_prompt='Call calculate.'")
    with pytest.raises(ConfigError, match="environment.tools_in_prompt=false"):
        named.prepare(tokenizer(CHATML), max_prompt_length=4096)
    off = chat_task(default_cfg, "environment.tools_in_prompt=false")
    off.prepare(tokenizer(CHATML), max_prompt_length=4096)  # the fix: today's prompt
    assert off.eval_prompts()[0].text.startswith("<|im_start|>system\nYou can use a calculator")


def test_a_template_that_raises_on_tools_is_one_line_naming_the_fix(default_cfg, example_env):
    task = chat_task(default_cfg)
    refuses = "{% if tools %}{{ raise_exception('tools are not supported') }}{% endif %}" + CHATML
    with pytest.raises(ConfigError, match=r"fails on the environment's tools=.*tools are not supported.*"
                                          r"environment\.tools_in_prompt=false"):  # fmt: skip
        task.prepare(tokenizer(refuses), max_prompt_length=4096)
    broken = "{{ raise_exception('broken template') }}"  # fails without tools too: its own error, as today
    with pytest.raises(Exception, match="broken template") as err:
        format_prompt("What is 1 + 2?", tokenizer=tokenizer(broken), tools=[{"type": "function"}])
    assert not isinstance(err.value, ConfigError)
