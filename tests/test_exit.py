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
exit_without_teardown(None if code == "None" else int(code) if code.isdigit() else code)
print("never")
"""


@pytest.mark.parametrize(
    "code, status", [("None", 0), ("0", 0), ("3", 3), ("a message", 1)], ids=["none", "0", "3", "message"]
)
def test_the_fast_exit_finishes_threads_runs_exit_handlers_and_flushes(tmp_path, code, status):
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), code], env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout == "printed, not flushed"
    assert done.stderr.startswith("to stderr") and done.stderr.rstrip().endswith(
        "a message" if code == "a message" else "to stderr"
    )
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        "atexit": "ran",
        "thread": "done",
        "pool": "done",
    }


def test_a_bad_setting_still_exits_2_through_it(tmp_path):
    """`python src/train.py rl.steps=nope`: the `error:` line and its status, 2, raised inside Hydra's
    main and ended by the fast exit."""
    done = subprocess.run([sys.executable, "src/train.py", "rl.steps=nope", f"hydra.run.dir={tmp_path}"],
                          env=child_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 2 and done.stdout.strip().splitlines()[-1].startswith("error: rl.steps="), (
        done.stdout[-2000:] + done.stderr[-2000:]
    )
