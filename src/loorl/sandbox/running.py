"""Running programs: the isolation level probed once per process, `run` and `run_many`, and ending a
program with everything it started."""

from __future__ import annotations

import contextlib
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from .interpreter import _under, interpreter_mounts, loader_env, staged_interpreter
from .launcher import DESCRIPTIONS, LAUNCHER, MODES, PROBE_PROGRAM, SCRATCH_PLACES, WORKDIR, Mode
from .results import SandboxResult, _tail, classify
from .uids import _kill_uid, _uid_slot

log = logging.getLogger(__package__)  # "loorl.sandbox": the run log names the package, as before the split

LAUNCHER_GRACE_S = 5.0  # how long a launcher told to end its namespace gets before it is killed


# ---- running --------------------------------------------------------------------------------------
@cache
def isolation() -> dict[str, str]:
    """The strongest level that works on this machine, found once per process by running a probe
    program through each (`LEVELS`, strongest first), and what it fences:
    {level, user, processes, network, filesystem, refused}; `refused` says why the stronger levels
    did not work ("" when the first did)."""
    ladder = ["full", "uid", "none"] if os.geteuid() == 0 else ["namespaces", "none"]
    refused = []
    for level in ladder:
        result = _launch(PROBE_PROGRAM, MODES[level], timeout_s=30, memory_mb=1024, file_mb=10, max_procs=32)
        words = result.stdout.split() + ["", "", ""]
        in_own_pid_namespace = words[2] == "1" or not MODES[level].namespaces
        if result.passed and words[0] == "loorl-probe" and in_own_pid_namespace:
            user, processes, network, filesystem = DESCRIPTIONS[level]
            found = {"level": level, "user": user, "processes": processes, "network": network,
                     "filesystem": filesystem, "refused": "; ".join(refused)}  # fmt: skip
            if level != "full":
                log.warning("sandbox: isolation %s (%s)", level, found["refused"])
            return found
        why = (result.stderr.strip().splitlines() or [result.status])[-1]
        why = why.removeprefix("OSError(").removesuffix(")")
        refused.append(f"{level}: {why.removeprefix('loorl sandbox setup failed: ')}")
    return {
        "level": "unavailable",
        "user": "-",
        "processes": "-",
        "network": "-",
        "filesystem": "-",
        "refused": "; ".join(refused),
    }  # every run is a sandbox failure (unscorable), with this reason


def describe(fences: dict[str, str] | None = None) -> str:
    """One line for logs and summaries: the level and what it fences."""
    f = fences or isolation()
    line = (f"sandbox isolation {f['level']}: user {f['user']}; processes {f['processes']}; "
            f"network {f['network']}; filesystem {f['filesystem']}")  # fmt: skip
    return line + (f" (stronger levels refused: {f['refused']})" if f["refused"] else "")


def run(
    program: str,
    *,
    timeout_s: float = 10,
    memory_mb: int = 1024,
    file_mb: int = 10,
    max_procs: int = 32,
) -> SandboxResult:
    """Run a complete Python program (solution plus tests) in the sandbox, at the level `isolation()`
    found; see the package docstring."""
    fences = isolation()
    if fences["level"] not in MODES:
        return SandboxResult(
            None, "sandbox", None, "", f"loorl sandbox unavailable: {fences['refused']}", 0.0
        )
    mode = MODES[fences["level"]]
    return _launch(
        program, mode, timeout_s=timeout_s, memory_mb=memory_mb, file_mb=file_mb, max_procs=max_procs
    )


def _launch(program: str, mode: Mode, *, timeout_s: float, memory_mb: int, file_mb: int,
            max_procs: int) -> SandboxResult:  # fmt: skip
    started = time.perf_counter()
    base = None
    try:
        base = Path(tempfile.mkdtemp(prefix="loorl-sandbox-"))  # 0700, the caller's: nobody else looks in
        with _uid_slot(mode.switch_uid) as uid:
            scratch = base / "work"
            scratch.mkdir()
            (scratch / "program.py").write_text(program)
            if uid is not None:
                os.chmod(base, 0o711)  # the program's uid may pass through to its folder, not list it
                for path in (scratch, scratch / "program.py"):
                    try:
                        os.chown(path, uid, uid)
                    except OSError as err:
                        raise OSError(f"cannot give uid {uid} its folder ({err.strerror}): the uid is not "
                                      "mapped in this user namespace") from err  # fmt: skip
            workdir = WORKDIR if mode.namespaces else str(scratch)  # where the program sees its folder
            if mode.namespaces:
                python, extra_env = sys.executable, dict(loader_env())
                expose, hide = interpreter_mounts(switch_uid=mode.switch_uid)
            else:
                python, extra_env = (
                    staged_interpreter() if mode.switch_uid else (sys.executable, loader_env())
                )
                expose, hide = [], []
            env = {
                "PATH": "/usr/bin:/bin",
                "HOME": workdir,
                "TMPDIR": workdir,
                "LANG": "C.UTF-8",
                **extra_env,
            }
            cfg = {
                "caller": os.getpid(),
                "scratch": str(scratch),
                "workdir": workdir,
                "uid": uid,
                "userns": mode.userns,
                "namespaces": mode.namespaces,
                "scratch_places": list(SCRATCH_PLACES),
                "expose": expose,
                "hide": hide,
                "python": python,
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
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=dict(loader_env()),
                    start_new_session=True, close_fds=True,
                )  # fmt: skip
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                _end(proc, mode, uid)
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


def _end(proc: subprocess.Popen, mode: Mode, uid: int | None) -> None:
    """End the program and everything it started, through what this sandbox owns: with namespaces the
    launcher kills its namespace's init (SIGTERM to the launcher; the launcher returns once the
    namespace is empty); without, the launcher's process group and (level uid) the processes of the
    uid this sandbox holds. A launcher that does not answer in LAUNCHER_GRACE_S is killed, and its
    init with it; the init then dies after the launcher, so (level full) the uid is swept until its
    namespace is gone: the uid's lock, freed next, must not free a uid whose processes still live."""
    if mode.namespaces:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=LAUNCHER_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()  # the init has PR_SET_PDEATHSIG: the kernel ends the namespace, soon
                proc.wait()
                if uid is not None:
                    _kill_uid(uid)
        proc.wait()
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the group lives while a member does: the pgid is not reused
    if uid is not None:
        _kill_uid(uid)
    proc.wait()


def run_many(programs: Sequence[str], *, workers: int = 2, **limits) -> list[SandboxResult]:
    """`run` over a batch, at most `workers` programs at a time; results in input order."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    isolation()  # probed once, before the threads
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run(p, **limits), programs))


def world_writable_folders() -> list[str]:
    """Host folders that any user may write into (mode o+w, sticky or not): every mount point and the
    usual places, with their children two levels down. The tests check that a sandboxed program can
    write into none of them."""
    roots = set(SCRATCH_PLACES) | {"/", "/var", "/run", "/dev", "/home", "/opt", "/srv", "/mnt", "/media"}
    with open("/proc/self/mountinfo") as f:
        roots |= {line.split()[4].encode().decode("unicode_escape") for line in f}
    found = set()
    for root in roots:
        if any(_under(root, skip) for skip in ("/proc", "/sys")):
            continue
        level = [root]
        for _ in range(3):  # the root, its children and grandchildren
            below = []
            for folder in level:
                with contextlib.suppress(OSError):
                    if os.path.isdir(folder) and not os.path.islink(folder):
                        if os.stat(folder).st_mode & 0o002:
                            found.add(folder)
                        below += [e.path for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
            level = below[:2000]
    return sorted(found)
