"""The run's tools with their call tags: which tool a turn called, with what text, and the result tokens
to append.

A call is written by the policy as `<start>text<end>` inside its own turn (`<calc>123*456</calc>`);
the engine stops the turn when the tokens of an `<end>` tag have been generated, so a turn that
called a tool ends with that tag. `ToolSet.call_in_turn` finds the call in the turn's text and runs
it (`run_call`: limits, no exception escapes), `ToolSet.unclosed` finds a call the policy opened and
never closed, and `ToolSet.result_ids` tokenises the result once: those ids are what the sampler is
conditioned on and what the trainer scores after, never re-encoded from text.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loorl.errors import ConfigError
from loorl.tools.base import ToolCall, clip, run_call
from loorl.util.plugins import import_object

if TYPE_CHECKING:
    from loorl.settings import ToolsSettings

# texts that may precede a closing tag in a transcript (what follows it is the result's head): its
# tokens must be the same after each, or a stop on them would miss the tag as the model writes it
# (`check_tags`)
TAG_CONTEXTS = ("", " ", "1", "a", ")", "\n", "=")


@dataclass(frozen=True)
class BoundTool:
    """A tool as the run uses it: the callable, its name and its call tags."""

    name: str
    fn: Callable[[str], object]
    start: str
    end: str
    environment: object | None = None  # an `Environment`: each sample's own instance runs the call


class ToolSet:
    """The tools of `tools.available` and the rules of a call: time limit, result size, how a result
    is written into the transcript (`result_format`, `{result}` replaced; under a chat template with
    a tool role, `template_ids` renders it instead)."""

    def __init__(
        self,
        tools: list[BoundTool],
        *,
        timeout_s: float,
        max_result_chars: int,
        result_format: str = " <result>{result}</result>",
    ) -> None:
        if not tools:
            raise ConfigError(
                "tools.max_turns > 0 needs at least one tool in tools.available (e.g. tools=calculator)"
            )
        self.tools, self.timeout_s, self.max_result_chars = tools, timeout_s, max_result_chars
        self.result_format = result_format
        self.template_ids: Callable[[str], list[int]] | None = None  # set where results go through a template

    def stop_ids(self, tokenizer) -> list[tuple[BoundTool, list[int]]]:
        """Each tool's closing tag as the token sequences that end a turn: one per way the tokenizer
        writes the tag after the texts of `TAG_CONTEXTS` (a BPE tokenizer writes `</calc>` after a space
        as ` </`, `calc`, `>`: that sequence ends a turn too)."""
        return [(tool, ids) for tool in self.tools for ids in tag_variants(tokenizer, tool.end)]

    @staticmethod
    def closed_by(turn_ids: list[int], stops: list[tuple[BoundTool, list[int]]]) -> BoundTool | None:
        """The tool whose closing tag ends this turn's tokens, None if the turn ended otherwise."""
        for tool, stop in stops:
            if stop and turn_ids[-len(stop) :] == stop:
                return tool
        return None

    def closed_in_text(self, turn_text: str, before_last: str) -> BoundTool | None:
        """The tool whose closing tag the turn's last token completed, read from the text (`turn_text`,
        and `before_last` without the last token): an engine that stops on strings (vLLM) ends a turn
        on a tag the policy wrote in other ids than `stop_ids`' too, or inside a token (`>\n`)."""
        for tool in self.tools:
            if tool.end in turn_text and tool.end not in before_last:
                return tool
        return None

    def call_in_turn(self, tool: BoundTool, turn_text: str, session=None) -> ToolCall:
        """Run the call that `tool`'s closing tag ended: the text between the turn's first opening tag
        and its last closing tag (what a token that ends with the tag holds after it is not the call's).
        A turn without an opening tag, or with a second opening tag (of any tool) inside the call, is a
        call error; the tool does not run. `session`: the sample's environment instance
        (`loorl.tools.environment.Session`), which runs the call in place of `tool.fn`."""
        end = turn_text.rfind(tool.end)
        body = turn_text[:end] if end >= 0 else turn_text
        at = body.find(tool.start)
        if at < 0:
            result = f"error: {tool.end} without {tool.start}"
            return ToolCall(tool.name, body[-self.max_result_chars :], result, "error")
        text = body[at + len(tool.start) :]
        if any(t.start in text for t in self.tools):
            return ToolCall(tool.name, text, "error: a tool call inside a tool call", "nested")
        if session is not None:
            return session.call(text)
        return run_call(
            tool.fn, text, name=tool.name, timeout_s=self.timeout_s, max_chars=self.max_result_chars
        )

    def unclosed(self, turn_text: str) -> ToolCall | None:
        """A call opened in the turn's text and never closed (the turn ended at EOS or the budget)."""
        for tool in self.tools:
            at = turn_text.rfind(tool.start)
            if at >= 0 and tool.end not in turn_text[at:]:
                text = clip(turn_text[at + len(tool.start) :], self.max_result_chars)[0]
                return ToolCall(tool.name, text, "", "unclosed")
        return None

    def result_text(self, call: ToolCall) -> str:
        return self.result_format.replace("{result}", call.result)

    def result_ids(self, call: ToolCall, tokenizer) -> list[int]:
        """The result as the tokens appended to the transcript, tokenised once."""
        return self.insert_ids(call.result, tokenizer)

    def insert_ids(self, text: str, tokenizer) -> list[int]:
        """`text` as the tokens of an inserted result (a tool's result, an environment's `reset` text)."""
        if self.template_ids is not None:
            return self.template_ids(text)
        return tokenizer.encode(self.result_format.replace("{result}", text), add_special_tokens=False)


def tag_variants(tokenizer, tag: str) -> list[list[int]]:
    """The token sequences that write `tag` after each text of `TAG_CONTEXTS`: the shortest tail of
    the context-and-tag's tokens whose text holds the whole tag (a token the tag shares with the
    context's last characters included). Without repeats, in context order."""
    variants: list[list[int]] = []
    for before in TAG_CONTEXTS:
        ids = tokenizer.encode(before + tag, add_special_tokens=False)
        start = max(k for k in range(len(ids)) if tag in tokenizer.decode(ids[k:]))
        if ids[start:] not in variants:
            variants.append(ids[start:])
    return variants


def check_tags(tokenizer, tools: list[BoundTool], *, result_format: str) -> None:
    """ConfigError when a closing tag's last characters merge with the result written after it (the
    engine stops on the tag's own tokens, so the transcript would hold tokens the tokenizer never
    writes there), for an empty tag, and for two tools whose tags end alike (one stop would end the
    other's calls)."""
    follow = result_format.split("{result}")[0]
    seen: dict[str, list[list[int]]] = {}
    for tool in tools:
        if not tool.start or not tool.end:
            raise ConfigError(f"tools.available.{tool.name}: start and end tags must be non-empty strings")
        for before in TAG_CONTEXTS:
            tagged = tokenizer.encode(before + tool.end, add_special_tokens=False)
            around = tokenizer.encode(before + tool.end + follow, add_special_tokens=False)
            if around[: len(tagged)] != tagged:
                raise ConfigError(
                    f"tools.available.{tool.name}.end={tool.end!r}: the tokenizer merges its end with the "
                    f"result written after it (tools.result_format={result_format!r}: its tokens change in "
                    f"{before + tool.end + follow!r}); start tools.result_format with a character that stays "
                    "apart, e.g. ' = {result}'"
                )
        mine = tag_variants(tokenizer, tool.end)
        for name, theirs in seen.items():
            if any(a[-len(b) :] == b or b[-len(a) :] == a for a in mine for b in theirs):
                raise ConfigError(
                    f"tools.available.{tool.name}.end={tool.end!r} ends like tools.available.{name}.end: "
                    "give each tool a closing tag of its own"
                )
        seen[tool.name] = mine


def build_toolset(settings: ToolsSettings, environment: str | dict[str, str] | None = None, *,
                  route_column: str = "environment", **isolation) -> ToolSet:  # fmt: skip
    """The tools of `tools.available`: each `_target_` imported (a class is built with the entry's
    other keys; a function takes them as keyword arguments after the call's text), with its tags;
    `environment`: an environment class (`environment._target_`), whose methods the policy calls
    as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (`loorl.tools.environment`), or
    several by name (`environment.routes`), each row's chosen by its `route_column`;
    `isolation`: where its instances live (`environment.isolation`, `memory_mb`, `workers`)."""
    tools = []
    if environment:
        from loorl.tools.environment import CALL_END, CALL_START, Environment, Environments

        def one(target: str) -> Environment:
            return Environment.of(
                target, timeout_s=settings.timeout_s, max_result_chars=settings.max_result_chars, **isolation
            )

        if isinstance(environment, str):
            env = one(environment)
        else:
            env = Environments({name: one(target) for name, target in environment.items()}, route_column)
        tools.append(BoundTool(env.name, env.session, CALL_START, CALL_END, environment=env))
    for name, spec in settings.available.items():
        key = f"tools.available.{name}"
        spec = dict(spec or {})
        target, start, end = spec.pop("_target_", None), spec.pop("start", None), spec.pop("end", None)
        if not target:
            raise ConfigError(
                f"{key}._target_ is missing: name the tool's class or function (e.g. loorl.tools.Calculator)"
            )
        if not isinstance(start, str) or not isinstance(end, str) or not start or not end:
            raise ConfigError(
                f"{key}: set start and end, the call's opening and closing tags (e.g. '<calc>' and '</calc>')"
            )
        obj = import_object(target, f"{key}._target_")
        try:
            fn = obj(**spec) if inspect.isclass(obj) else (functools.partial(obj, **spec) if spec else obj)
        except TypeError as err:
            raise ConfigError(
                f"{key}: {target} does not take these settings ({err}): fix tools.available.{name}"
            ) from None
        if not callable(fn):
            raise ConfigError(
                f"{key}._target_={target} is not callable: a tool takes the call's text and returns text"
            )
        tools.append(BoundTool(name, fn, start, end))
    return ToolSet(tools, timeout_s=settings.timeout_s, max_result_chars=settings.max_result_chars,
                   result_format=settings.result_format)  # fmt: skip


PLACEHOLDER = "\x00RESULT\x00"  # stands for the result while a template is rendered


def has_tool_role(tokenizer) -> bool:
    """Whether the tokenizer's chat template has a tool role of its own (it names `tool`, as Qwen2.5's
    and Llama 3.1's do); a template that renders any role generically (SmolLM2's ChatML) has none."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(template.values())
    return "tool" in template


def template_insert(tokenizer) -> Callable[[str], list[int]]:
    """Result text -> the ids the chat template writes between an assistant turn that ended on a
    closing tag and the next assistant turn: the assistant's end of turn, a tool message holding the
    result, and the assistant's header. Rendered once with a placeholder; each result is then put in
    its place and tokenised once."""
    messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    try:
        full = tokenizer.apply_chat_template(
            [*messages, {"role": "tool", "content": PLACEHOLDER}], tokenize=False, add_generation_prompt=True
        )
    except Exception as err:  # noqa: BLE001 - a template that refuses a tool message
        raise ConfigError(f"tools.insert=template: the chat template cannot render a tool message ({err}); "
                          "use tools.insert=text") from None  # fmt: skip
    after = full[full.rindex("A", 0, full.index(PLACEHOLDER)) + 1 :]  # [end of turn][tool message][header]
    if PLACEHOLDER not in after:
        raise ConfigError(
            "tools.insert=template: the chat template drops tool messages; use tools.insert=text"
        )
    head, tail = after.split(PLACEHOLDER)
    return lambda result: tokenizer.encode(head + result + tail, add_special_tokens=False)


def insertion(tokenizer, mode: str) -> tuple[Callable[[str], list[int]] | None, str]:
    """How results enter the transcript under `tools.insert`: (a template's insert or None for plain
    text, the sentence the run log prints)."""
    if mode == "text" or (mode == "auto" and not has_tool_role(tokenizer)):
        why = (
            "tools.insert=text" if mode == "text" else "tools.insert=auto: the chat template has no tool role"
        )
        return None, f"tool results are inserted as plain tagged text ({why})"
    return template_insert(
        tokenizer
    ), f"tool results are inserted as the chat template's tool message (tools.insert={mode})"
