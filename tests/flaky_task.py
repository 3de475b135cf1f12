"""A task whose reward function fails on about 10% of samples (raises, returns None or NaN)."""

from __future__ import annotations

import zlib

from loorl.tasks.arithmetic import ArithmeticTask


class FlakyArithmetic(ArithmeticTask):
    def reward(self, prompt, completion):
        bucket = zlib.crc32(f"{prompt.text}|{completion}".encode()) % 30
        if bucket == 0:
            raise RuntimeError("reward service timed out")
        if bucket == 1:
            return None
        if bucket == 2:
            return float("nan")
        return super().reward(prompt, completion)
