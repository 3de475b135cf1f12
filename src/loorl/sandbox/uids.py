"""Sandbox uids: an unused uid per running program, held machine-wide by a lock file, and the killing
of every process of a uid this sandbox holds."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pwd
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from .interpreter import _root_owned_folder

log = logging.getLogger(__package__)  # "loorl.sandbox": the run log names the package, as before the split

UID_BASE = 61000  # the sandbox uids: UID_BASE, UID_BASE + 1, ... (one per concurrently running program)
UID_SLOTS = 256
SANDBOX_ROOT = Path("/run/loorl-sandbox")  # root-owned and fixed: the uid locks of every job on the machine
LOCK_DIR = SANDBOX_ROOT / "uids"


# ---- uids -----------------------------------------------------------------------------------------
def _live_processes() -> Iterator[tuple[int, int]]:
    """(pid, real uid) of every live process (zombies are dead already: they wait to be reaped)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
                if not fields["State"].strip().startswith("Z"):
                    yield int(entry), int(fields["Uid"].split()[0])


def _live_uids() -> set[int]:
    return {uid for _, uid in _live_processes()}


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


@contextlib.contextmanager
def _uid_slot(switch_uid: bool) -> Iterator[int | None]:
    """An unused sandbox uid, held with an exclusive lock file in LOCK_DIR (one fixed root-owned place
    for every job on the machine, whatever its TMPDIR) while its program runs. A uid that has an
    account or a live process is never taken. None when the level does not switch uids."""
    if not switch_uid:
        yield None
        return
    _root_owned_folder(SANDBOX_ROOT, mode=0o755)
    _root_owned_folder(LOCK_DIR, mode=0o700)
    while True:
        busy = None
        for uid in range(UID_BASE, UID_BASE + UID_SLOTS):
            handle = open(LOCK_DIR / str(uid), "w")  # noqa: SIM115 - held until the program is done
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            busy = _live_uids() if busy is None else busy
            if uid in busy or _has_account(uid):  # someone else's: not ours to use, nor to kill
                handle.close()
                continue
            try:
                yield uid
            finally:
                handle.close()
            return
        time.sleep(0.05)


def _uid_processes(uid: int) -> list[int]:
    """Live processes of `uid`."""
    return [pid for pid, owner in _live_processes() if owner == uid]


def _kill_uid(uid: int) -> int:
    """Level uid only (no PID namespace to end): SIGKILL every process of `uid`, a uid this sandbox
    holds exclusively, until none is left. Returns how many were killed."""
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
