"""`loorl.tools.Python`: the call's text run as a Python program in loorl's sandbox; the result is
what it printed.

The sandbox (`loorl.sandbox`) is the one code tasks grade with: its own process group (or PID
namespace), no network where namespaces exist, CPU, memory, file-size and process limits, and a
wall-time limit after which everything the program started is killed. So an infinite loop ends as
`timeout`, a fork bomb meets the process limit, and a 100 MB print meets the file-size limit (the
result is the output's tail and the error); none of them reaches the run.
"""

from __future__ import annotations

from loorl import sandbox
from loorl.tools.base import Tool, ToolError, ToolTimeout


class Python(Tool):
    """`<python>print(123*456)</python>` -> `56088\n`. The program's standard output (its tail, as the
    sandbox keeps it); when it failed, a `ToolError` with the last line of its error output (the
    exception), or saying which limit it met."""

    name = "python"

    def __init__(
        self, *, timeout_s: float = 5.0, memory_mb: int = 512, file_mb: int = 1, max_procs: int = 16
    ):
        self.limits = {
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "file_mb": file_mb,
            "max_procs": max_procs,
        }

    def __call__(self, text: str) -> str:
        result = sandbox.run(text, **self.limits)
        if result.status == "passed":
            return result.stdout
        if result.status == "timeout":
            raise ToolTimeout(f"the program ran past {self.limits['timeout_s']:g} s")
        if result.status == "filesize":
            raise ToolError(f"the program wrote more than {self.limits['file_mb']} MB")
        last = (result.stderr.strip().splitlines() or [result.status])[-1]
        raise ToolError(f"the sandbox failed: {last}" if result.status == "sandbox" else last)
