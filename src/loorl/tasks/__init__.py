"""Prompt sources and reward functions."""

from loorl.tasks.base import Task
from loorl.types import Prompt

__all__ = ["Prompt", "Task"]
