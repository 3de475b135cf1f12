"""The processes of `environment.isolation=process`: a zygote that imports the environment's class once
and forks workers, and the worker's loop that hosts sessions (instances) and runs their methods.

Started by `loorl.tools.env_process.WorkerPool` as `python -c ...` with the trainer's `sys.path`. Only
the standard library and `loorl.tools.base` (no torch) are imported here, so a worker is a small
process (~20 MB) forked in about a millisecond from the zygote's warm interpreter.

The zygote runs no method of the class: only its module's import. It reads fork requests from its
control socket (a SOCK_SEQPACKET pair: each message whole, with the new worker's socket passed as a
file descriptor), forks, answers with the worker's pid, and reports a worker's exit status when asked
(after the trainer saw it die). When the control socket closes (the trainer ended, however it ended)
it kills every worker it started and exits. A worker dies with the zygote (PR_SET_PDEATHSIG: the
zygote has one thread, so the signal is tied to the process) and ends when its socket closes.

A worker's limits are set after the fork: its address space (RLIMIT_AS: what the zygote had mapped
plus `environment.memory_mb`; a Python allocation past it raises MemoryError, which ends the worker with
MEMORY_EXIT after saying so),
no core dumps, and its own process group (the trainer kills the group: what a method started dies
with its worker).
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import os
import pickle
import random
import resource
import signal
import socket
import sys
from collections import OrderedDict
from multiprocessing.connection import Connection

from loorl.tools.base import ToolError, clean_text, clip

MEMORY_EXIT = 75  # a worker's exit status after a MemoryError (its address space limit)
MEMORY = ("memory", None)  # what it sends first, when it can


def _seed(seed: int | None) -> None:
    """Each session's own random streams: Python's `random`, and numpy's global one where the class's
    module imported numpy (a forked worker would otherwise share the zygote's, or draw from urandom)."""
    if seed is None:
        return
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def awaited(value):
    """A method's value, awaited where it is a coroutine (an `async def` method or `get_reward`, as
    TRL's contract allows): run to its end on an event loop of its own."""
    if inspect.isawaitable(value):
        return asyncio.run(_awaited(value))
    return value


async def _awaited(value):
    return await value


def _error_text(err: BaseException) -> str:
    return str(err) if isinstance(err, ToolError) else f"{type(err).__name__}: {err}"


def serve(conn: Connection, cls: type, max_chars: int) -> None:
    """A worker's loop: one message in, one answer out, until the socket closes. Messages:
    ("start", sid, row, seed) -> ("ok", observation text or None) | ("error", text);
    ("call", sid, name, kwargs) -> ("ok", result text, cut) | ("error", text);
    ("reward", sid) -> ("ok", value) | ("error", text); ("end", sid) -> no answer."""
    sessions: dict[int, object] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        kind, sid = message[0], message[1]
        try:
            if kind == "start":
                _seed(message[3])
                instance = cls()
                observation = awaited(instance.reset(**message[2]))
                sessions[sid] = instance
                answer = ("ok", None if observation is None else clip(clean_text(observation), max_chars)[0])
            elif kind == "call":
                value = awaited(getattr(sessions[sid], message[2])(**message[3]))
                answer = ("ok", *clip(clean_text(value), max_chars))
            elif kind == "reward":
                answer = ("ok", awaited(sessions[sid].get_reward()))
                if not isinstance(answer[1], (int, float)):  # a value that may not unpickle in the trainer
                    answer = ("ok", float(answer[1]))
            else:  # "end"
                sessions.pop(sid, None)
                continue
        except MemoryError:
            sessions.clear()
            try:
                conn.send(MEMORY)
            finally:
                os._exit(MEMORY_EXIT)
        except BaseException as err:  # noqa: BLE001 - the method's failure is the answer (SystemExit too)
            answer = ("error", clip(clean_text(_error_text(err)), max_chars)[0])
        conn.send(answer)


def _start_worker(fd: int, control: socket.socket, cls: type, cfg: dict) -> None:
    """In the forked child: fences, then the loop. Never returns."""
    try:
        control.close()
        os.setpgid(0, 0)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the zygote
        libc.prctl(15, b"loorl-env-work", 0, 0, 0)  # PR_SET_NAME: what ps -o comm and top show
        if os.getppid() == 1:
            os._exit(0)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        with open("/proc/self/statm") as f:  # what the zygote's imports mapped already (torch maps GBs)
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        memory = mapped + (cfg["memory_mb"] << 20)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        conn = Connection(fd)
    except BaseException:  # noqa: BLE001 - a worker that cannot be fenced does not run
        os._exit(1)
    serve(conn, cls, cfg["max_chars"])


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def main(cfg: dict) -> None:
    """The zygote: import the class, say ready, then fork workers on request (module docstring)."""
    control = socket.socket(fileno=cfg["control_fd"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when this process ends
    ctypes.CDLL(None).prctl(15, b"loorl-env-zygo", 0, 0, 0)  # PR_SET_NAME (15 characters at most)
    try:
        cls = pickle.loads(bytes.fromhex(cfg["cls"]))
    except BaseException as err:  # noqa: BLE001 - reported in one line by the trainer
        control.send(pickle.dumps(("error", clean_text(_error_text(err))[:300])))
        return
    control.send(pickle.dumps(("ready", os.getpid())))
    live: set[int] = set()
    ended: OrderedDict[int, int] = OrderedDict()  # pid -> exit code, the last 4096

    def reap(block_for: int | None = None) -> None:
        while live:
            pid, status = os.waitpid(
                block_for if block_for is not None else -1, 0 if block_for else os.WNOHANG
            )
            if pid == 0:
                return
            live.discard(pid)
            ended[pid] = _exit_code(status)
            while len(ended) > 4096:
                ended.popitem(last=False)
            if block_for is not None:
                return

    while True:
        try:
            data, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
        except OSError:
            data, fds = b"", []
        if not data:  # the trainer is gone: so are its workers
            for pid in live:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            os._exit(0)
        reap()
        kind, value = pickle.loads(data)
        if kind == "fork":
            pid = os.fork()
            if pid == 0:
                _start_worker(fds[0], control, cls, cfg)
            os.close(fds[0])
            live.add(pid)
            control.send(pickle.dumps(("pid", pid)))
        elif kind == "status":  # a worker the trainer saw die (and killed, to be sure): its exit code
            if value in live:
                reap(block_for=value)
            control.send(pickle.dumps(("status", ended.pop(value, None))))
