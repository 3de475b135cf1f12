"""Environment sessions in worker processes (`environment.isolation=process`, the default): a method
that hangs, exits, segfaults or allocates without bound ends its worker, never the run.

Each sample's instance lives in a worker process for the whole sample (`ProcessSession`). Workers are
forked from a zygote that imported the class once (`loorl.tools.env_worker`: ~1 ms a fork, where a new
interpreter would take ~100 ms) and are kept: a worker whose session ended cleanly hosts a later one
(a new instance, built and reset there), so a run forks about as many workers as it has samples in
flight, once. `environment.workers`: None (the default) gives every session a worker of its own; N
caps the processes, and sessions then share them (the least busy first; a killed worker takes the
other sessions on it down too, each counted in `tools/env_sessions_lost`).

Every call waits at most `tools.timeout_s`. A worker that overruns it, exits, dies by a signal or runs
out of memory is killed with its process group and dropped; its session is broken (its later calls
answer an error, its reward is NaN); the next session gets a new worker. Counted per sample
(`Completion.environment_events`: `tools/crashes`, `tools/timeouts`, `tools/env_reset_failures`,
`tools/env_reward_failures`, `tools/env_workers_lost`).

Why by hand: no standard pool keeps an object alive in one chosen process across calls and kills that
process on a per-call timeout (concurrent.futures and multiprocessing.Pool cannot kill one worker;
pebble kills on timeout but holds no state between calls; multiprocessing's forkserver re-imports the
training script in every child).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from loorl.tools.env_worker import MEMORY, MEMORY_EXIT

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the zygote's start: an interpreter and the class's module imported
ZYGOTE = (
    "import json, sys; cfg = json.loads(sys.argv[1]); sys.path[:] = cfg['path']\n"
    "from loorl.tools.env_worker import main; main(cfg)"
)


class WorkerLost(Exception):
    """A worker that had to be killed or died: `kind` timeout | crashed | memory, `why` one line."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind, self.why = kind, why


@dataclass(eq=False)
class Worker:
    """One worker process: its socket, pid and pidfd (signals go to exactly this process, never to a
    reused pid), the sessions it hosts, and a lock (one message in flight at a time)."""

    conn: Connection
    pid: int
    pidfd: int | None
    sessions: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    dead: str | None = None  # why it was dropped


class WorkerPool:
    """The zygote and its workers for one environment class, started at the first session."""

    def __init__(self, cls: type, *, memory_mb: int, max_chars: int, workers: int | None) -> None:
        self.cls, self.memory_mb, self.max_chars, self.max_workers = cls, memory_mb, max_chars, workers
        self.zygote: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.workers: list[Worker] = []
        self.lock = threading.Lock()  # the control socket and the worker list
        self.ids = itertools.count()
        self.forked = 0  # workers started over the pool's life (scripts and tests read it)
        self.killed: list[int] = []  # the pids of workers killed or found dead

    # ---- the zygote --------------------------------------------------------------------------------
    def _start_zygote(self) -> None:
        try:
            cls_bytes = pickle.dumps(self.cls)
        except Exception as err:  # noqa: BLE001 - a class defined in __main__ or a closure
            raise WorkerLost("crashed", f"the class cannot be sent to a worker process ({err}); set "
                                        "environment.isolation=thread") from None  # fmt: skip
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = {
            "path": [p or os.getcwd() for p in sys.path],
            "cls": cls_bytes.hex(),
            "memory_mb": self.memory_mb,
            "max_chars": self.max_chars,
            "control_fd": theirs.fileno(),
        }
        self.zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, json.dumps(cfg)],
                                       pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                       start_new_session=True)  # fmt: skip
        theirs.close()
        mine.settimeout(START_TIMEOUT_S)
        try:
            kind, value = pickle.loads(mine.recv(1 << 16) or pickle.dumps(("error", "it exited")))
        except (TimeoutError, OSError) as err:
            kind, value = "error", f"no answer in {START_TIMEOUT_S:g} s ({err})"
        mine.settimeout(None)
        if kind != "ready":
            self.zygote.kill()
            self.zygote.wait()
            self.zygote = None
            raise WorkerLost("crashed", f"the class did not import in a worker process ({value})")
        self.control = mine
        log.info("environment %s: worker processes forked from pid %d", self.cls.__name__, value)

    def _ask_zygote(self, message: tuple, fd: int | None = None) -> tuple:
        """One request and its answer on the control socket (the caller holds `lock`)."""
        data = pickle.dumps(message)
        try:
            if fd is None:
                self.control.send(data)
            else:
                socket.send_fds(self.control, [data], [fd])
            answer = self.control.recv(1 << 16)
        except OSError:
            answer = b""
        if not answer:  # the zygote died (killed from outside): a new one next time
            self._drop_zygote()
            raise WorkerLost("crashed", "the workers' zygote process died")
        return pickle.loads(answer)

    def _drop_zygote(self) -> None:
        if self.control is not None:
            self.control.close()
        if self.zygote is not None:
            with contextlib.suppress(OSError):
                self.zygote.kill()
            self.zygote.wait()
        self.control = self.zygote = None

    # ---- workers -----------------------------------------------------------------------------------
    def _fork(self) -> Worker:
        if self.zygote is None:
            self._start_zygote()
        mine, theirs = socket.socketpair()
        try:
            _, pid = self._ask_zygote(("fork", None), theirs.fileno())
        finally:
            theirs.close()
        pidfd = None
        with contextlib.suppress(OSError, AttributeError):  # Linux >= 5.3; else plain pids
            pidfd = os.pidfd_open(pid)
        self.forked += 1
        return Worker(Connection(mine.detach()), pid, pidfd)

    def acquire(self) -> tuple[Worker, int]:
        """A worker for a new session and the session's id: an idle one, else a new one, else (at the
        cap) the least busy."""
        with self.lock:
            sid = next(self.ids)
            idle = [w for w in self.workers if not w.sessions]
            if idle:
                worker = idle[0]
            elif self.max_workers is None or len(self.workers) < self.max_workers:
                worker = self._fork()
                self.workers.append(worker)
            else:
                worker = min(self.workers, key=lambda w: len(w.sessions))
            worker.sessions.add(sid)
            return worker, sid

    def release(self, worker: Worker, sid: int) -> None:
        """The session is over: its instance dropped in the worker, which stays for later sessions."""
        if worker.dead is not None:
            return
        with worker.lock:
            try:
                worker.conn.send(("end", sid))
            except OSError:
                pass
        with self.lock:
            worker.sessions.discard(sid)

    def ask(self, worker: Worker, message: tuple, timeout_s: float) -> tuple:
        """Send one message to the worker and wait for its answer, at most `timeout_s`; a worker that
        overruns, dies or runs out of memory is killed and dropped (`WorkerLost`)."""
        with worker.lock:
            if worker.dead is not None:
                raise WorkerLost("lost", worker.dead)
            try:
                worker.conn.send(message)
                if worker.conn.poll(timeout_s):
                    answer = worker.conn.recv()
                    if answer != MEMORY:
                        return answer
                    raise WorkerLost("memory", f"ran out of memory (environment.memory_mb={self.memory_mb})")
                raise WorkerLost("timeout", f"timed out after {timeout_s:g} s")
            except (EOFError, OSError):
                lost = WorkerLost("crashed", "")
            except WorkerLost as err:
                lost = err
            self._kill(worker, lost)
            raise lost

    def _kill(self, worker: Worker, lost: WorkerLost) -> None:
        """End the worker and what it started (its process group), learn how it ended, drop it."""
        with contextlib.suppress(OSError):
            if worker.pidfd is not None:
                signal.pidfd_send_signal(worker.pidfd, signal.SIGKILL)
            else:
                os.kill(worker.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(worker.pid, signal.SIGKILL)  # its group: the pgid lives while a member does
        with self.lock:
            code = None
            with contextlib.suppress(WorkerLost):
                code = self._ask_zygote(("status", worker.pid))[1]
            if lost.kind == "crashed" and code == MEMORY_EXIT:
                lost.kind, lost.why = "memory", f"ran out of memory (environment.memory_mb={self.memory_mb})"
            elif lost.kind == "crashed":
                lost.why = _how_it_ended(code)
            worker.dead = f"worker process {lost.why} in another sample's call"
            self.killed.append(worker.pid)
            if worker in self.workers:
                self.workers.remove(worker)
        worker.conn.close()
        if worker.pidfd is not None:
            os.close(worker.pidfd)

    def close(self) -> None:
        """Every worker and the zygote, ended (the zygote kills its workers when its socket closes)."""
        with self.lock:
            for worker in self.workers:
                worker.conn.close()
                if worker.pidfd is not None:
                    os.close(worker.pidfd)
            self.workers = []
            if self.control is not None:
                self.control.close()
                self.control = None
            if self.zygote is not None:
                try:
                    self.zygote.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.zygote.kill()
                    self.zygote.wait()
                self.zygote = None


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "ended"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with status {code}"
