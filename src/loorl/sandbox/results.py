"""A program's result: the tail of its output, and (passed, status) from how it ended."""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass
from pathlib import Path

from .launcher import SETUP_FAILED

TAIL_BYTES = 4096  # how much of stdout/stderr a result keeps (the end)
LOADER_FAILED = "error while loading shared libraries"  # the dynamic loader's message (exit status 127)


@dataclass(frozen=True)
class SandboxResult:
    passed: bool | None  # None: the sandbox itself failed; the sample is unscorable
    status: str  # passed | failed | error | timeout | memory | filesize | sandbox
    returncode: int | None
    stdout: str  # the last TAIL_BYTES of the program's output
    stderr: str
    seconds: float


# ---- results --------------------------------------------------------------------------------------
def _tail(path: Path) -> str:
    with contextlib.suppress(OSError), path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - TAIL_BYTES))
        return f.read().decode("utf-8", "replace")
    return ""


def classify(returncode: int | None, stderr: str, *, timed_out: bool) -> tuple[bool | None, str]:
    """(passed, status) from how the program ended."""
    if returncode == SETUP_FAILED and "loorl sandbox setup failed" in stderr:
        return None, "sandbox"
    if returncode == 127 and LOADER_FAILED in stderr:  # the interpreter never started
        return None, "sandbox"
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return False, "timeout"
    if returncode == 0:
        return True, "passed"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return False, "filesize"
    if "MemoryError" in stderr:
        return False, "memory"
    if "AssertionError" in stderr:
        return False, "failed"
    return False, "error"
