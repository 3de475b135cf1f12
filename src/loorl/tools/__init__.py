"""Tools a policy may call mid-answer in a multi-turn rollout (`tools.available`, `loorl.rollout.multi_turn`).

A tool is any callable from the call's text to the result's text, named in config by `_target_` with
its call tags. Built in: `Calculator` (exact arithmetic) and `Python` (the sandbox).
"""

from loorl.tools.base import Tool, ToolCall, ToolError, ToolTimeout, run_call
from loorl.tools.calculator import Calculator
from loorl.tools.python import Python

__all__ = ["Calculator", "Python", "Tool", "ToolCall", "ToolError", "ToolTimeout", "run_call"]
