"""One build per cache entry, however many processes find it missing at once.

Every process of a torchrun or srun launch starts together; with the tiny model, the GGUF
conversion or the SmolLM2 wheel not yet in `LOORL_CACHE`, each would build the same entry at the same
time (measured: two tasks building one tiny model took 42 s instead of 5, fighting for 2 cores). A
file lock beside the entry (`<entry>.lock`, fcntl through the `filelock` package; NFS needs its lock
daemon, as for any fcntl lock) lets one process build while the others wait, then load its result.
The builds themselves still write under a temporary name and rename into place, so a killed builder
leaves no half-written entry, and its lock goes with its process.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger("loorl")


@contextlib.contextmanager
def held_lock(entry: Path, what: str) -> Iterator[None]:
    """Hold `<entry>.lock` for the block; say so when another process holds it first."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(entry.with_name(f"{entry.name}.lock")))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process to finish building %s into %s", what, entry)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def build_once(entry: Path, *, done: Callable[[], bool], build: Callable[[], object], what: str) -> Path:
    """`entry` after `build()` has run in exactly one of the processes that found it not `done()`."""
    if not done():
        with held_lock(entry, what):
            if not done():  # a process that waited finds the other's result here
                build()
    return Path(entry)
