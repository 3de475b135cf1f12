"""Running model-written Python: one program per subprocess, fenced in by the operating system.

`run(program)` writes the program into a fresh scratch folder and starts
`python -I -c LAUNCHER ...` in a new session (its own process group). The launcher sets the fences
up inside the child, then `exec`s the interpreter on the program. What can be built depends on the
machine; `isolation()` finds out once per process by running a probe program through each level,
strongest first, and every later run uses the first level that worked:

- **full** (root with namespaces): a PID namespace (the program is its init, with its own `/proc`:
  when it ends, or when the sandbox kills it, the kernel ends everything it started), a network
  namespace (only a downed loopback: nothing is reachable, the host's 127.0.0.1 included) and a
  mount namespace in which every host mount is read-only, `/tmp`, `/var/tmp` and `/dev/shm` are
  fresh private tmpfs mounts, the scratch folder is bound read-write at `/tmp/work` (its working
  directory, HOME and TMPDIR), and the interpreter's folders are bound back read-only wherever the
  scratch mounts or a private home (one that other users cannot enter, pyenv under `/root`) would
  hide them. Then an unprivileged uid of its own (61000 and up, one per concurrent program, held
  machine-wide by a lock file in `/run/loorl-sandbox`, never a uid that has an account or a live
  process), so file permissions keep it out of everything it does not own.
- **namespaces** (not root, where unprivileged user namespaces are allowed): the same namespaces
  and mounts inside a user namespace, but the program runs as the caller's own uid (it can read
  the caller's files, not write them).
- **uid** (root without namespaces, e.g. Docker's default seccomp profile): the uid switch and the
  limits only; the network and the host's world-writable folders stay reachable. An interpreter
  that the program's uid cannot reach (under `/root`) is replaced by a copy of its standard library
  in `/var/cache/loorl-sandbox` (hard links where possible).
- **none** (not root, no user namespaces): the program runs as the caller with the limits only.

In every level: **limits** (`setrlimit`: CPU seconds, address space (`memory_mb`), file size, open
files, no core dumps, processes (`RLIMIT_NPROC`, counted per uid, which is why each program has its
own uid: root ignores the limit, the program's uid does not)); **a clean environment** (PATH, HOME,
TMPDIR, LANG, and `LD_LIBRARY_PATH` only when the interpreter cannot start without it); **wall
time**: the caller waits at most `timeout_s`, then ends the program through what the sandbox owns:
the launcher kills its namespace's init (full, namespaces), or the program's process group and
the processes of the uid it holds exclusively (uid); the launcher and the init die with the caller
(`PR_SET_PDEATHSIG`). No level kills a process it did not start.

`isolation()` reports the level; `loorl.tasks.code` prints it at the start of a run and refuses to
run below `task.sandbox.require=full` unless told `any`.

Results: `passed` True/False for the program's own outcome (exit status 0 or not), None when the
sandbox itself failed (the sample is unscorable, not wrong: a fence that could not be built, an
interpreter that could not start); `status` one of passed, failed (an AssertionError), error (any
other failure of the program), timeout, memory, filesize, sandbox.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
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
SANDBOX_ROOT = Path("/run/loorl-sandbox")  # root-owned and fixed: the uid locks of every job on the machine
LOCK_DIR = SANDBOX_ROOT / "uids"
STAGE_ROOT = Path("/var/cache/loorl-sandbox")  # level uid: interpreter copies its uid can reach
WORKDIR = "/tmp/work"  # the scratch folder's path inside the program's mount namespace
SCRATCH_PLACES = ("/tmp", "/var/tmp", "/dev/shm")  # private tmpfs mounts inside (where programs write)
LEVELS = ("full", "namespaces", "uid", "none")  # strongest first
LOADER_FAILED = "error while loading shared libraries"  # the dynamic loader's message (exit status 127)
LAUNCHER_GRACE_S = 5.0  # how long a launcher told to end its namespace gets before it is killed


@dataclass(frozen=True)
class SandboxResult:
    passed: bool | None  # None: the sandbox itself failed; the sample is unscorable
    status: str  # passed | failed | error | timeout | memory | filesize | sandbox
    returncode: int | None
    stdout: str  # the last TAIL_BYTES of the program's output
    stderr: str
    seconds: float


@dataclass(frozen=True)
class Mode:
    """How one level builds its fences."""

    userns: bool  # a user namespace first (not root): the caller's uid mapped to itself
    namespaces: bool  # pid, network and mount namespaces
    switch_uid: bool  # a sandbox uid of its own (root)


MODES = {
    "full": Mode(userns=False, namespaces=True, switch_uid=True),
    "namespaces": Mode(userns=True, namespaces=True, switch_uid=False),
    "uid": Mode(userns=False, namespaces=False, switch_uid=True),
    "none": Mode(userns=False, namespaces=False, switch_uid=False),
}
DESCRIPTIONS = {  # level -> (user, processes, network, filesystem)
    "full": ("uid 61000+ (one per program)", "pid namespace", "namespace",
             "host read-only; private /tmp, /var/tmp, /dev/shm"),
    "namespaces": ("the caller's uid (reads what the caller can)", "pid namespace", "namespace",
                   "host read-only; private /tmp, /var/tmp, /dev/shm"),
    "uid": ("uid 61000+ (one per program)", "process group + the uid's processes", "host (none)",
            "uid permissions only (world-writable folders writable)"),
    "none": ("the caller", "process group", "host (none)", "the caller's (none)"),
}  # fmt: skip


# The child's first program: build the fences, then exec the interpreter on the program. Runs with
# `python -I` (no environment variables, no user site) and receives its settings as JSON in argv[1].
LAUNCHER = r"""
import ctypes, errno, json, os, re, resource, signal, sys
cfg = json.loads(sys.argv[1])
def fail(what):
    err = ctypes.get_errno()
    sys.stderr.write(f"loorl sandbox setup failed: {what}: {os.strerror(err) if err else ''}\n")
    os._exit(111)
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x1, 0x20, 0x1000, 0x4000, 0x40000
KEEP = {"nosuid": 0x2, "nodev": 0x4, "noexec": 0x8, "noatime": 0x400, "nodiratime": 0x800,
        "relatime": 0x200000, "strictatime": 0x1000000}  # per-mount flags a remount must keep
def mount(source, target, fstype, flags, data, what):
    enc = lambda s: s.encode() if isinstance(s, str) else s
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        fail(what)
def kept(path):  # the flags of the mount at `path` that a remount must keep (locked in a user namespace)
    f = os.statvfs(path).f_flag
    return sum(ms for st, ms in ((2, 0x2), (4, 0x4), (8, 0x8), (1024, 0x400), (2048, 0x800), (4096, 0x200000))
               if f & st)
def die_with_parent():  # SIGKILL when the process that started us is gone
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        fail("parent-death signal")
def host_read_only():
    # every mount this namespace inherited, read-only (a bind remount keeps each mount's own flags)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | sum(KEEP.get(o, 0) for o in fields[5].split(","))
        if libc.mount(None, point.encode(), None, flags, None) != 0:
            if ctypes.get_errno() in (errno.ENOENT, errno.EINVAL):  # shadowed by a later mount
                continue
            fail("read-only " + point)
def fence_filesystem():
    os.chdir(cfg["scratch"])  # kept through the mounts below, which may shadow its path
    needed = [(p, os.open(p, os.O_PATH)) for p in cfg["expose"]]  # before anything hides them
    mount("none", "/", None, MS_REC | MS_PRIVATE, None, "private mounts")
    host_read_only()
    mount("proc", "/proc", "proc", 0x2 | 0x4 | 0x8, None, "/proc of the pid namespace")
    size = f"size={cfg['file_mb']}m,mode=1777"
    for place in cfg["scratch_places"]:
        if os.path.isdir(place):
            mount("tmpfs", place, "tmpfs", 0, size, "tmpfs on " + place)
    for hidden in cfg["hide"]:  # a home others cannot enter: emptied (its interpreter bound back below)
        mount("tmpfs", hidden, "tmpfs", 0, "size=1m,mode=0755", "tmpfs on " + hidden)
    for path, fd in needed:
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None, "binding " + path)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept(path), None, "read-only " + path)
        os.close(fd)
    os.mkdir(cfg["workdir"])
    mount(".", cfg["workdir"], None, MS_BIND, None, "binding the scratch folder")
    flags = MS_REMOUNT | MS_BIND | 0x2 | 0x4 | kept(cfg["workdir"])  # writable again, no set-uid, no devices
    mount(None, cfg["workdir"], None, flags, None, "a writable scratch folder")
def enter_namespaces():
    if cfg["userns"]:  # not root: a user namespace in which this process may build the rest
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(0x10000000) != 0:                          # CLONE_NEWUSER
            fail("user namespace")
        maps = (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1"))
        for name, text in maps:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    if libc.unshare(0x20000000) != 0:                              # CLONE_NEWPID: the next child is its init
        fail("pid namespace")
    child = os.fork()
    if child:  # stay outside as the init's parent; on SIGTERM (the caller's timeout) kill the init,
        signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))  # which ends them all
        status = os.waitpid(child, 0)[1]  # returns once every process of the namespace is gone
        if os.WIFSIGNALED(status):  # end the way the init ended
            sig = os.WTERMSIG(status)
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        os._exit(os.waitstatus_to_exitcode(status))
    die_with_parent()
    if libc.unshare(0x40000000) != 0:                              # CLONE_NEWNET
        fail("network namespace")
    if libc.unshare(0x00020000) != 0:                              # CLONE_NEWNS
        fail("mount namespace")
    fence_filesystem()
def setup():
    die_with_parent()
    if os.getppid() != cfg["caller"]:
        fail("the caller is gone")
    if cfg["namespaces"]:
        enter_namespaces()
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
        die_with_parent()  # a change of uid clears it
    try:
        os.execve(cfg["python"], [cfg["python"], "-I", "-u", "-B", "program.py"], cfg["env"])  # unbuffered
    except OSError:
        fail("starting the interpreter")
try:
    setup()
except Exception as err:  # anything before the program starts is the sandbox's failure
    fail(repr(err))
"""

PROBE_PROGRAM = "import os\nprint('loorl-probe', os.getuid(), os.getpid())\n"


# ---- the interpreter and what it needs ------------------------------------------------------------
def _outermost(paths) -> list[str]:
    paths = {os.path.realpath(p) for p in paths if p and os.path.isdir(p)}
    return sorted(p for p in paths if not any(p.startswith(q + os.sep) for q in paths if q != p))


def _hidden_ancestor(path: str) -> str | None:
    """The outermost folder on `path` (itself included) that other users may not pass through."""
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        ancestor = str(Path(*parts[:i]))
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


@cache
def loader_env() -> dict[str, str]:
    """The loader variables the interpreter cannot start without (`LD_LIBRARY_PATH` for HPC `module
    load` Pythons and some conda builds): {} when it starts in an empty environment."""
    value = os.environ.get("LD_LIBRARY_PATH")
    if not value:
        return {}
    bare = subprocess.run([sys.executable, "-I", "-c", ""], env={}, capture_output=True, timeout=60)
    return {} if bare.returncode == 0 else {"LD_LIBRARY_PATH": value}


def interpreter_folders() -> list[str]:
    """The folders the interpreter needs: its prefixes, its executable's, and its loader path."""
    exe = os.path.realpath(sys.executable)
    library_path = loader_env().get("LD_LIBRARY_PATH", "")
    wanted = [sys.prefix, sys.base_prefix, os.path.dirname(sys.executable), os.path.dirname(exe)]
    return _outermost(wanted + library_path.split(os.pathsep))


def interpreter_mounts(*, switch_uid: bool) -> tuple[list[str], list[str]]:
    """(folders to bind back read-only, private homes to empty) for the mount namespace: every
    interpreter folder that a scratch mount would hide, or (with a uid switch) that lies below a folder
    other users cannot enter; those folders are emptied by a tmpfs, then the interpreter's are bound
    back into them."""
    expose, hide = [], set()
    for path in interpreter_folders():
        if any(_under(path, place) for place in SCRATCH_PLACES):
            expose.append(path)
            continue
        hidden = _hidden_ancestor(path) if switch_uid else None
        if hidden is not None:
            expose.append(path)
            hide.add(hidden)
    return expose, sorted(hide)


def staged_interpreter() -> tuple[str, dict[str, str]]:
    """(python, environment) for the uid level, where no mount namespace can bind a hidden interpreter
    back: the interpreter, its shared library and its standard library (no site-packages) copied once
    into STAGE_ROOT (hard links where on the same filesystem), a place the sandbox uid can read but
    not write. Returns the caller's own interpreter when the sandbox uid can reach it."""
    if not any(_hidden_ancestor(p) for p in interpreter_folders()):
        return sys.executable, dict(loader_env())
    exe = os.path.realpath(sys.executable)
    stdlib = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{exe}|{sys.version}|{os.stat(exe).st_mtime_ns}".encode()).hexdigest()[:16]
    target = STAGE_ROOT / f"python-{key}"
    python = target / "bin" / os.path.basename(exe)
    env = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(target / "lib"), *loader_env().values()]))}
    if python.is_file():
        return str(python), env
    _root_owned_folder(STAGE_ROOT, mode=0o755)
    building = Path(tempfile.mkdtemp(prefix="building-", dir=STAGE_ROOT))
    os.chmod(building, 0o755)

    def link_or_copy(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    skip = shutil.ignore_patterns("site-packages", "test", "tests", "__pycache__", "idlelib", "tkinter",
                                  "turtledemo", "ensurepip")  # fmt: skip
    shutil.copytree(stdlib, building / "lib" / os.path.basename(stdlib), ignore=skip,
                    copy_function=link_or_copy)  # fmt: skip
    (building / "bin").mkdir()
    link_or_copy(exe, building / "bin" / os.path.basename(exe))
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    for name in {sysconfig.get_config_var("LDLIBRARY"), sysconfig.get_config_var("INSTSONAME")} - {None}:
        if os.path.isfile(os.path.join(libdir, name)) and name.endswith(
            tuple(".so" + s for s in ("", ".1.0"))
        ):
            link_or_copy(os.path.join(libdir, name), building / "lib" / name)
    for folder in building.rglob("*"):
        if folder.is_dir():
            os.chmod(folder, 0o755)
    try:
        os.rename(building, target)
    except OSError:  # another process staged it meanwhile
        shutil.rmtree(building, ignore_errors=True)
    return str(python), env


def _root_owned_folder(path: Path, *, mode: int) -> None:
    """Create `path` (root's, `mode`) or check that it is root's and not writable by others."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != 0 or info.st_mode & 0o022:
        raise OSError(f"{path} must be root's and writable only by root (it is uid {info.st_uid}, "
                      f"mode {oct(info.st_mode & 0o777)}): remove it")  # fmt: skip


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


# ---- results --------------------------------------------------------------------------------------
def _tail(path: Path) -> str:
    with contextlib.suppress(OSError), path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - TAIL_BYTES))
        return f.read().decode("utf-8", "replace")
    return ""


def classify(returncode: int | None, stderr: str, *, timed_out: bool) -> tuple[bool | None, str]:
    """(passed, status) from how the program ended."""
    if returncode == SETUP_FAILED and "loorl sandbox setup failed" in stderr:
        return None, "sandbox"
    if returncode == 127 and LOADER_FAILED in stderr:  # the interpreter never started
        return None, "sandbox"
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return False, "timeout"
    if returncode == 0:
        return True, "passed"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return False, "filesize"
    if "MemoryError" in stderr:
        return False, "memory"
    if "AssertionError" in stderr:
        return False, "failed"
    return False, "error"


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
    found; see the module docstring."""
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
