"""The commands end without the interpreter's teardown (`loorl.cli.console.exit_without_teardown`), and
nothing that was to be written is lost: the threads still working finish, the exit handlers run, what
was printed reaches the pipe, and the exit status is the one asked for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import child_env

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from loorl.cli.console import exit_without_teardown

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late(name):
    time.sleep(0.3)
    (out / name).write_text("done")
threading.Thread(target=late, args=("thread",)).start()  # not a daemon: the interpreter waits for it
ThreadPoolExecutor(1).submit(late, "pool")  # a pool's worker: joined by threading's exit hook
print("printed, not flushed", end="")
sys.stderr.write("to stderr")
code = sys.argv[2]
exit_without_teardown(eval(code) if code != "a message" else code)
print("never")
"""


@pytest.mark.parametrize(
    "code, status",
    [("None", 0), ("0", 0), ("3", 3), ("a message", 1), ("[1]", 1)],
    ids=["none", "0", "3", "message", "object"],
)
def test_the_fast_exit_finishes_threads_runs_exit_handlers_and_flushes(tmp_path, code, status):
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), code], env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout == "printed, not flushed"
    assert done.stderr.startswith("to stderr") and done.stderr.rstrip().endswith(
        {"a message": "a message", "[1]": "[1]"}.get(code, "to stderr")
    )
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        "atexit": "ran",
        "thread": "done",
        "pool": "done",
    }


def test_under_a_profiler_the_command_ends_as_usual_and_the_profile_is_written(tmp_path):
    """`python -m cProfile -o x.prof src/train.py ...`: the command does not end the process (its main
    module is cProfile's), so cProfile writes its file at its own end. With the fast exit taken
    regardless, nothing was written. The bad setting still prints its `error:` line."""
    profile = tmp_path / "x.prof"
    cmd = [sys.executable, "-m", "cProfile", "-o", str(profile), "src/train.py", "rl.steps=nope",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "error: rl.steps=" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert profile.is_file() and profile.stat().st_size > 0
