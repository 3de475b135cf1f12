"""Prompt sources and reward functions."""

from loorl.tasks.base import Prompt, Task

__all__ = ["Prompt", "Task"]
