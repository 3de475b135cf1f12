"""What each isolation level builds, and the program that builds it: the levels' modes and what they
fence, the fixed paths inside, and the launcher the child runs first (see `loorl.sandbox`)."""

from __future__ import annotations

from dataclasses import dataclass

SETUP_FAILED = 111  # the launcher's exit status when a fence could not be built
WORKDIR = "/tmp/work"  # the scratch folder's path inside the program's mount namespace
SCRATCH_PLACES = ("/tmp", "/var/tmp", "/dev/shm")  # private tmpfs mounts inside (where programs write)
LEVELS = ("full", "namespaces", "uid", "none")  # strongest first


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
