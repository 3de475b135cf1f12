"""What a tool is, and how one call of it runs: a time limit, a size limit, and no exception that
reaches the rollout.

A tool is any callable that takes the text between its call tags and returns the result's text
(`Tool` is the base class of the built-in ones; a plain function named by `_target_` works too, as
engines, estimators and losses are plug-ins). `run_call` is the only way the rollout calls one: a
tool that raises, overruns its time limit or returns too much gives the policy an error or a
truncated result as the tool's output, recorded in a `ToolCall`, and never ends the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# ToolCall.status values; `ok` is the only one whose result is the tool's own full answer; `crashed`: an
# environment's worker process exited, died by a signal or ran out of memory in the call
STATUSES = ("ok", "error", "timeout", "truncated", "unclosed", "nested", "crashed")


class ToolError(Exception):
    """A tool's own refusal (a malformed expression, a division by zero): its message is the result."""


class ToolTimeout(ToolError):
    """A tool that enforces its own time limit (the Python tool's sandbox) and met it."""


class Tool:
    """A built-in tool: `__call__(text) -> str`. `name` names it in metrics and transcripts; a
    plug-in may be any callable (its `__name__` or class name is then its name)."""

    name = "tool"

    def __call__(self, text: str) -> str:  # pragma: no cover - the subclasses' job
        raise NotImplementedError


@dataclass(frozen=True)
class ToolCall:
    """One call as the rollout made it: the tool, the call's text, the result text the policy was
    shown (after truncation), how it ended (`STATUSES`) and the seconds it took."""

    tool: str
    text: str
    result: str
    status: str
    seconds: float = 0.0

    @property
    def made(self) -> bool:
        """The policy closed the call (an unclosed one was only opened): it counts as a call."""
        return self.status != "unclosed"

    @property
    def failed(self) -> bool:
        return self.status in ("error", "timeout", "unclosed", "nested", "crashed")


def _call_in_thread(tool: Callable, text: str, timeout_s: float) -> tuple[bool, object, BaseException | None]:
    """(done, value, error) of `tool(text)` run in a daemon thread of its own, waited for `timeout_s`.

    Python cannot kill a thread: a plug-in that never returns keeps its thread, which, being a
    daemon, neither blocks the rollout nor the interpreter's exit (a `concurrent.futures` pool's
    threads are joined at exit, so one hung call would hang the run's end). The built-in tools end
    by themselves: the calculator bounds its work before doing it, and the Python tool's program runs
    in the sandbox, which kills it at its own time limit."""
    box: dict = {}

    def work() -> None:
        try:
            box["value"] = tool(text)
        except BaseException as err:  # noqa: BLE001 - handed to the caller, which records it
            box["error"] = err

    thread = threading.Thread(target=work, name="loorl-tool", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False, None, None
    return True, box.get("value"), box.get("error")


def clip(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` cut to `max_chars` characters, with a marker saying how much was dropped; and whether
    it was cut."""
    if len(text) <= max_chars:
        return text, False
    marker = f"...[{len(text) - max_chars} more characters]"
    return text[: max(0, max_chars - len(marker))] + marker, True


def clean_text(value) -> str:
    """A tool's return value as text the tokenizer can take: bytes decoded with replacement (invalid
    UTF-8 becomes U+FFFD), anything else `str()`-ed, lone surrogates replaced."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    elif not isinstance(value, str):
        value = str(value)
    return value.encode("utf-8", "replace").decode("utf-8")


def run_call(tool: Callable, text: str, *, name: str, timeout_s: float, max_chars: int) -> ToolCall:
    """Run one tool call with a time limit and a size limit; every failure becomes the result text.

    The result the policy sees: the tool's text (cut to `max_chars`, status `truncated`), or
    `error: <message>` when it raised (status `error`), or `error: timed out after N s` (status
    `timeout`)."""
    start = time.perf_counter()
    done, value, error = _call_in_thread(tool, text, timeout_s)
    if not done:
        result, status = f"error: timed out after {timeout_s:g} s", "timeout"
    elif error is not None:  # a tool's failure is the policy's answer, never the run's end
        message = str(error) if isinstance(error, ToolError) else f"{type(error).__name__}: {error}"
        result = clip(f"error: {clean_text(message)}", max_chars)[0]
        status = "timeout" if isinstance(error, ToolTimeout) else "error"
    else:
        result, cut = clip(clean_text(value), max_chars)
        status = "truncated" if cut else "ok"
    return ToolCall(name, text, result, status, time.perf_counter() - start)
