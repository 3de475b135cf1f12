"""Running model-written Python: one program per subprocess, fenced in by the operating system.

`run(program)` writes the program into a fresh scratch folder and starts
`python -I -c LAUNCHER ...` in a new session (its own process group). The launcher sets the fences
up inside the child, then `exec`s the interpreter on the program:

- **no network**: a new network namespace (`unshare(CLONE_NEWNET)`): only a loopback device that is
  down, so nothing is reachable, not even the host's 127.0.0.1.
- **nowhere to write but the scratch folder**: a new mount namespace in which `/tmp`, `/var/tmp`
  and `/dev/shm` (the world-writable places) are fresh private tmpfs mounts (gone with the
  program) and the scratch folder is bound at `/tmp/work`, its working directory, HOME and TMPDIR;
  then an unprivileged user: the program runs as a uid of its own (61000 and up, one per
  concurrent program, held with a lock file), so file permissions keep it out of everything it
  does not own (the scratch folder is the one place that uid owns).
- **limits** (`setrlimit`): CPU seconds, address space (`memory_mb`), file size, open files, no core
  dumps, and processes (`RLIMIT_NPROC`, counted per uid, which is why each program has its own uid:
  root ignores the limit, the program's uid does not).
- **a clean environment**: only PATH, HOME, TMPDIR and LANG; nothing of the caller's.
- **wall time**: the caller waits at most `timeout_s`; then, and after every run, every process of
  the program's uid is killed (a `/proc` sweep), so a child that left the process group or outlived
  its parent is gone too; then the scratch folder is removed.

These need root (user switching, namespaces), which the project's machines and CI have. Without
root the program runs as the caller with the same rlimits, in its own process group, killed as a
group; there is no network or filesystem isolation and `RLIMIT_NPROC` counts the caller's own
processes. `isolation()` says which fences hold; a run where a fence that should hold cannot be
built is a sandbox failure (`passed=None`), never a silent run without it.

Results: `passed` True/False for the program's own outcome (exit status 0 or not), None when the
sandbox itself failed (the sample is unscorable, not wrong); `status` one of passed, failed (an
AssertionError), error (any other failure of the program), timeout, memory, filesize, sandbox.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

UID_BASE = 61000  # the sandbox uids: UID_BASE, UID_BASE + 1, ... (one per concurrently running program)
UID_SLOTS = 256
SETUP_FAILED = 111  # the launcher's exit status when a fence could not be built
TAIL_BYTES = 4096  # how much of stdout/stderr a result keeps (the end)
LOCK_DIR = Path(tempfile.gettempdir()) / "loorl-sandbox-uids"
WORKDIR = "/tmp/work"  # the scratch folder's path inside the program's mount namespace


@dataclass(frozen=True)
class SandboxResult:
    passed: bool | None  # None: the sandbox itself failed; the sample is unscorable
    status: str  # passed | failed | error | timeout | memory | filesize | sandbox
    returncode: int | None
    stdout: str  # the last TAIL_BYTES of the program's output
    stderr: str
    seconds: float


# The child's first program: build the fences, then exec the interpreter on the program. Runs with
# `python -I` (no environment variables, no user site) and receives its settings as JSON in argv[1].
LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
def fail(what):
    err = ctypes.get_errno()
    sys.stderr.write(f"loorl sandbox setup failed: {what}: {os.strerror(err) if err else ''}\n")
    os._exit(111)
libc = ctypes.CDLL(None, use_errno=True)
def setup():
    if cfg["namespaces"]:
        if libc.unshare(0x20000000) != 0:                          # CLONE_NEWPID: the next child is its init
            fail("pid namespace")
        child = os.fork()
        if child:  # stay outside as the init's parent, reap it and end the way it ended
            status = os.waitpid(child, 0)[1]
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                if sig not in (signal.SIGKILL, signal.SIGSTOP):
                    signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            os._exit(os.waitstatus_to_exitcode(status))
        if libc.unshare(0x40000000) != 0:                          # CLONE_NEWNET
            fail("network namespace")
        if libc.unshare(0x00020000) != 0:                          # CLONE_NEWNS
            fail("mount namespace")
        if libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:  # MS_REC | MS_PRIVATE
            fail("private mounts")
        if libc.mount(b"proc", b"/proc", b"proc", 0x2 | 0x4 | 0x8, None) != 0:  # nosuid, nodev, noexec
            fail("/proc of the pid namespace")
        os.chdir(cfg["scratch"])  # kept through the mounts below, which may shadow its path
        for hidden, paths in cfg["expose"]:  # the interpreter under a private home: that home emptied,
            fds = [os.open(p, os.O_PATH) for p in paths]  # the interpreter's folders bound back read-only
            if libc.mount(b"tmpfs", hidden.encode(), b"tmpfs", 0, b"size=1m,mode=0755") != 0:
                fail("tmpfs on " + hidden)
            for path, fd in zip(paths, fds):
                os.makedirs(path, exist_ok=True)
                source, target = f"/proc/self/fd/{fd}".encode(), path.encode()
                if libc.mount(source, target, None, 0x1000 | 0x4000, None) != 0:  # MS_BIND | MS_REC
                    fail("binding " + path)
                if libc.mount(None, target, None, 0x20 | 0x1000 | 0x1, None) != 0:  # remount read-only
                    fail("read-only " + path)
        size = f"size={cfg['file_mb']}m,mode=1777".encode()
        for place in (b"/tmp", b"/var/tmp", b"/dev/shm"):
            if os.path.isdir(place) and libc.mount(b"tmpfs", place, b"tmpfs", 0, size) != 0:
                fail("tmpfs on " + place.decode())
        os.mkdir(cfg["workdir"])
        if libc.mount(b".", cfg["workdir"].encode(), None, 0x1000, None) != 0:  # MS_BIND: scratch at workdir
            fail("binding the scratch folder")
    os.chdir(cfg["workdir"])
    mb = 1 << 20
    limits = [(resource.RLIMIT_CPU, cfg["cpu_s"]), (resource.RLIMIT_AS, cfg["memory_mb"] * mb),
              (resource.RLIMIT_FSIZE, cfg["file_mb"] * mb), (resource.RLIMIT_NOFILE, 64),
              (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, cfg["max_procs"])]
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
        if os.getuid() != cfg["uid"] or os.geteuid() != cfg["uid"]:
            fail("dropping privileges")
    try:
        os.execve(sys.executable, [sys.executable, "-I", "-u", "-B", "program.py"], cfg["env"])  # unbuffered
    except OSError:
        fail("starting the interpreter")
try:
    setup()
except Exception as err:  # anything before the program starts is the sandbox's failure
    fail(repr(err))
"""


@cache
def isolation() -> dict[str, str]:
    """Which fences hold on this machine (probed once, in a throwaway child)."""
    if os.geteuid() != 0:
        return {"user": "caller (not root)", "network": "none", "filesystem": "none"}
    probe = subprocess.run(
        [sys.executable, "-I", "-c", "import ctypes,os,sys; libc=ctypes.CDLL(None, use_errno=True);"
         "sys.exit(0 if libc.unshare(0x40000000 | 0x00020000) == 0 else 1)"],
        capture_output=True, timeout=30,
    )  # fmt: skip
    namespaces = probe.returncode == 0
    return {
        "user": f"uid {UID_BASE}+ (one per program)",
        "network": "namespace" if namespaces else "none (unshare refused)",
        "filesystem": "private /tmp, /var/tmp, /dev/shm" if namespaces else "uid permissions only",
    }


def interpreter_mounts() -> list[tuple[str, list[str]]]:
    """(hidden folder, [interpreter folders under it]): where the interpreter lives below a folder
    that other users cannot enter (pyenv under /root), that folder is shadowed by an empty tmpfs in
    the program's mount namespace and the interpreter's folders are bound back into it read-only."""
    wanted = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))}
    wanted = {p for p in wanted if not any(p.startswith(q + os.sep) for q in wanted)}  # outermost only
    hidden: dict[str, list[str]] = {}
    for path in sorted(wanted):
        parts = Path(path).parts
        for i in range(2, len(parts) + 1):
            ancestor = str(Path(*parts[:i]))
            if not os.stat(ancestor).st_mode & 0o001:  # others may not pass through
                if path != ancestor:
                    hidden.setdefault(ancestor, []).append(path)
                break
    return [(folder, paths) for folder, paths in hidden.items()]


@contextlib.contextmanager
def _uid_slot() -> Iterator[int | None]:
    """An unused sandbox uid, held with an exclusive lock file (across threads and processes) while
    its program runs; None when not root."""
    if os.geteuid() != 0:
        yield None
        return
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    while True:
        for uid in range(UID_BASE, UID_BASE + UID_SLOTS):
            handle = open(LOCK_DIR / str(uid), "w")  # noqa: SIM115 - held until the program is done
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                _kill_uid(uid)  # anything a crashed earlier holder left behind
                yield uid
            finally:
                handle.close()
            return
        time.sleep(0.05)


def _uid_processes(uid: int) -> list[int]:
    """Live processes of `uid` (zombies are dead already: they wait for their parent to reap them)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # gone meanwhile
            continue
        zombie = fields.get("State", "").strip().startswith("Z")
        if int(fields.get("Uid", "-1").split()[0]) == uid and not zombie:
            pids.append(int(entry))
    return pids


def _kill_uid(uid: int) -> int:
    """SIGKILL every process of `uid` until none is left (a fork between scans is caught by the next;
    RLIMIT_NPROC bounds how many there can be). Returns how many were killed."""
    killed = 0
    for _ in range(100):
        pids = _uid_processes(uid)
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.01)
    log.warning("sandbox: processes of uid %d survived 100 kill sweeps", uid)
    return killed


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError), path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - TAIL_BYTES))
        return f.read().decode("utf-8", "replace")
    return ""


def classify(returncode: int | None, stderr: str, *, timed_out: bool) -> tuple[bool | None, str]:
    """(passed, status) from how the program ended."""
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return False, "timeout"
    if returncode == SETUP_FAILED and "loorl sandbox setup failed" in stderr:
        return None, "sandbox"
    if returncode == 0:
        return True, "passed"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return False, "filesize"
    if "MemoryError" in stderr:
        return False, "memory"
    if "AssertionError" in stderr:
        return False, "failed"
    return False, "error"


def run(
    program: str,
    *,
    timeout_s: float = 10,
    memory_mb: int = 1024,
    file_mb: int = 10,
    max_procs: int = 32,
) -> SandboxResult:
    """Run a complete Python program (solution plus tests) in the sandbox; see the module docstring."""
    started = time.perf_counter()
    fences = isolation()
    base = None
    try:
        base = Path(tempfile.mkdtemp(prefix="loorl-sandbox-"))  # 0700, the caller's: nobody else looks in
        with _uid_slot() as uid:
            scratch = base / "work"
            scratch.mkdir()
            (scratch / "program.py").write_text(program)
            if uid is not None:
                os.chmod(base, 0o711)  # the program's uid may pass through to its folder, not list it
                for path in (scratch, scratch / "program.py"):
                    os.chown(path, uid, uid)
            namespaces = fences["network"] == "namespace"
            workdir = WORKDIR if namespaces else str(scratch)  # where the program sees its folder
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
            cfg = {
                "scratch": str(scratch),
                "workdir": workdir,
                "uid": uid,
                "namespaces": namespaces,
                "expose": interpreter_mounts() if namespaces and uid is not None else [],
                "cpu_s": max(1, math.ceil(timeout_s)),
                "memory_mb": memory_mb,
                "file_mb": file_mb,
                "max_procs": max_procs,
                "env": env,
            }
            out_path, err_path = base / "stdout", base / "stderr"
            timed_out = False
            with out_path.open("wb") as out, err_path.open("wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", LAUNCHER, json.dumps(cfg)],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={},
                    start_new_session=True, close_fds=True,
                )  # fmt: skip
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                if uid is not None:  # the program and all it started, whatever their process group;
                    _kill_uid(uid)  # the launcher then reaps its pid-namespace init and exits
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group (without root: all)
                proc.wait()
            stderr = _tail(err_path)
            passed, status = classify(proc.returncode, stderr, timed_out=timed_out)
            return SandboxResult(passed, status, proc.returncode, _tail(out_path), stderr,
                                 time.perf_counter() - started)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:  # the sandbox failed, not the program
        log.warning("sandbox failure: %r", err)
        return SandboxResult(None, "sandbox", None, "", repr(err), time.perf_counter() - started)
    finally:
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)


def run_many(programs: Sequence[str], *, workers: int = 2, **limits) -> list[SandboxResult]:
    """`run` over a batch, at most `workers` programs at a time; results in input order."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run(p, **limits), programs))
