"""The sandbox holds: hostile programs, each bounded, each ending with this process alive, nothing
outside the scratch folder changed and no process of the program left. The tests run as root, so
they also show that the program does not run as root (root would ignore RLIMIT_NPROC and file
permissions)."""

from __future__ import annotations

import ast
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fixtures import sandbox_leftovers
from loorl import sandbox

pytestmark = pytest.mark.skipif(
    sandbox.isolation()["network"] != "namespace", reason="needs root and namespaces"
)


def leftover_processes() -> list[int]:
    """Processes a finished program of this file left (every program here runs at the `full` level,
    inside a PID namespace of its own)."""
    return sandbox_leftovers(namespaced_only=True)


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    assert leftover_processes() == []


def test_results_say_how_the_program_ended():
    ok = sandbox.run("print('hi'); assert 1 + 1 == 2")
    assert (ok.passed, ok.status, ok.returncode, ok.stdout) == (True, "passed", 0, "hi\n")
    wrong = sandbox.run("def f(x):\n    return x\nassert f(2) == 3, 'f(2)'")
    assert (wrong.passed, wrong.status) == (False, "failed") and "AssertionError: f(2)" in wrong.stderr
    broken = sandbox.run("def f(:\n")
    assert (broken.passed, broken.status) == (False, "error") and "SyntaxError" in broken.stderr


def test_the_program_is_not_root_and_writes_only_in_its_folder():
    escape = Path(f"/etc/loorl-escape-{os.getpid()}")  # this run's own name: nothing left by another
    result = sandbox.run(
        "import os\n"
        "print(os.getuid(), os.getcwd(), os.environ['HOME'])\n"
        "open('mine.txt', 'w').write('ok')\n"
        f"try:\n    open({str(escape)!r}, 'w')\nexcept OSError:\n    print('no /etc')\n"
    )
    assert result.passed, result.stderr
    uid, cwd, home = result.stdout.splitlines()[0].split()
    assert int(uid) >= sandbox.UID_BASE and cwd == home == sandbox.WORKDIR
    assert result.stdout.splitlines()[1] == "no /etc" and not escape.exists()


def test_an_infinite_loop_is_stopped_at_the_wall_time():
    started = time.perf_counter()
    result = sandbox.run("while True:\n    pass", timeout_s=2)
    assert (result.passed, result.status) == (False, "timeout")
    assert time.perf_counter() - started < 10


def test_forking_500_sleeping_children_hits_the_process_limit():
    program = (
        "import os, time\n"
        "for i in range(500):\n"
        "    try:\n        pid = os.fork()\n"
        "    except OSError as err:\n        print('stopped at', i, err.errno); break\n"
        "    if pid == 0:\n        time.sleep(120); os._exit(0)\n"
        "time.sleep(120)\n"
    )
    result = sandbox.run(program, timeout_s=5, max_procs=32)
    assert result.status == "timeout"
    stopped_at = int(result.stdout.split()[2])
    assert (
        stopped_at < 32 and result.stdout.split()[3] == "11"
    )  # EAGAIN: RLIMIT_NPROC, though started by root


def test_allocating_4_gb_against_1_gb_is_a_memory_error():
    result = sandbox.run("x = bytearray(4 * 1024**3)\nprint('allocated')", memory_mb=1024)
    assert (result.passed, result.status) == (False, "memory") and "allocated" not in result.stdout


def test_writing_1_gb_against_10_mb_stops_at_the_file_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the scratch folder under tmp_path
    program = "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * (1 << 20))\n"
    result = sandbox.run(program, file_mb=10)
    assert (result.passed, result.status) == (False, "filesize")
    assert list(tmp_path.iterdir()) == []  # and the scratch folder is gone afterwards


def test_canaries_in_the_parent_folder_and_home_survive(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parent_canary = tmp_path / "canary.txt"
    home_canary = Path.home() / f".loorl-canary-{os.getpid()}"
    parent_canary.write_text("keep")
    home_canary.write_text("keep")
    try:
        program = (
            "import os, shutil\n"
            f"for path in ['../../canary.txt', {str(parent_canary)!r}, {str(home_canary)!r}]:\n"
            "    try:\n        os.remove(path); print('removed', path)\n"
            "    except OSError as err:\n        print('refused', type(err).__name__)\n"
            "shutil.rmtree('..', ignore_errors=True)\n"
            "open('/tmp/escaped.txt', 'w').write('x')\n"
        )
        result = sandbox.run(program)
        assert "removed" not in result.stdout, result.stdout
        assert parent_canary.read_text() == "keep" and home_canary.read_text() == "keep"
        assert not Path("/tmp/escaped.txt").exists()  # its /tmp was a private tmpfs
        assert sorted(p.name for p in tmp_path.iterdir()) == ["canary.txt"]
    finally:
        home_canary.unlink(missing_ok=True)


def test_the_callers_environment_does_not_reach_the_program(monkeypatch):
    monkeypatch.setenv("LOORL_SECRET_TOKEN", "hunter2")
    result = sandbox.run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('LOORL_SECRET_TOKEN'))")
    names, secret = result.stdout.splitlines()
    assert secret == "None" and "hunter2" not in result.stdout
    assert ast.literal_eval(names) == ["HOME", "LANG", "PATH", "TMPDIR"]  # the sandbox's own four


def test_a_listener_on_the_hosts_loopback_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(8)
    port = server.getsockname()[1]
    accepted = []
    waiter = threading.Thread(target=lambda: accepted.append(_accept(server)))
    waiter.start()
    program = (
        "import socket\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3); print('connected')\n"
        "except OSError as err:\n    print('unreachable', type(err).__name__)\n"
    )
    result = sandbox.run(program)
    waiter.join()
    server.close()
    assert result.stdout.startswith("unreachable") and accepted == [None]


def _accept(server):
    try:
        return server.accept()
    except TimeoutError:
        return None


def test_killing_the_parent_fails_and_the_caller_lives():
    program = (
        "import os, signal\n"
        f"for pid in (os.getppid(), {os.getpid()}, 1):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL); print('killed', pid)\n"
        "    except OSError as err:\n        print('refused', pid, type(err).__name__)\n"
    )
    result = sandbox.run(program)
    assert f"killed {os.getpid()}" not in result.stdout  # the caller is not even visible (pid namespace)
    assert os.getpid() and result.returncode is not None  # still here to check


def test_a_grandchild_that_outlives_its_parent_is_gone_afterwards():
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"  # leaves the process group
        "    if os.fork() == 0:\n        time.sleep(300)\n    os._exit(0)\n"
        "time.sleep(0.2)\nprint('parent exits')\n"
    )
    result = sandbox.run(program)
    assert result.passed and result.stdout == "parent exits\n"
    assert leftover_processes() == []  # checked here too, not only by the fixture


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                found.append(int(entry))
    return found


def test_a_launcher_that_does_not_answer_is_killed_and_nothing_of_its_program_outlives_run(monkeypatch):
    """A launcher told to end its namespace (SIGTERM) returns once the namespace is empty. One that
    does not answer (stopped here) is killed after LAUNCHER_GRACE_S, and its init dies after it
    (`PR_SET_PDEATHSIG`): `run` must not free the uid before that init and its children are gone."""
    monkeypatch.setattr(sandbox.running, "LAUNCHER_GRACE_S", 0.5)  # where `_end` reads it
    forks = 16
    program = (
        "import os, time\n"
        f"for _ in range({forks}):\n    if os.fork() == 0:\n        time.sleep(300)\n"
        "time.sleep(300)\n"
    )
    stopped = []

    def stop_the_launcher_once_the_program_has_forked():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not stopped:
            for launcher in _children(os.getpid()):
                inits = _children(launcher)
                if inits and len(_children(inits[0])) == forks:
                    os.kill(launcher, signal.SIGSTOP)
                    stopped.append(launcher)
            time.sleep(0.01)

    stopper = threading.Thread(target=stop_the_launcher_once_the_program_has_forked)
    stopper.start()
    result = sandbox.run(program, timeout_s=3)
    left = leftover_processes()  # at once: the fixture looks again later
    stopper.join()
    assert stopped and result.status == "timeout"
    assert left == []


def test_run_many_runs_in_parallel_in_order_each_program_with_its_own_uid():
    programs = ["import os, time\ntime.sleep(1.5)\nprint(os.getuid())"] * 4 + ["while True: pass"]
    started = time.perf_counter()
    results = sandbox.run_many(programs, workers=2, timeout_s=3)
    elapsed = time.perf_counter() - started
    assert [r.status for r in results] == ["passed"] * 4 + ["timeout"]
    assert elapsed < 4 * 1.5 + 3  # two at a time, not one
    assert len({r.stdout for r in results[:2]}) == 2  # the two that ran together had different uids


def test_a_sandbox_failure_is_unscorable_not_wrong(monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/loorl")
    result = sandbox.run("print(1)")
    assert (result.passed, result.status) == (None, "sandbox")
    monkeypatch.undo()
    monkeypatch.setattr(  # where `_launch` looks it up
        sandbox.running, "interpreter_mounts", lambda **_: (["/root/no-such-interpreter"], ["/root"])
    )
    result = sandbox.run("print(1)")
    assert (result.passed, result.status) == (None, "sandbox") and "setup failed" in result.stderr
