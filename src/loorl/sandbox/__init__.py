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

# Relative imports: the package alone (standard library only) also runs copied outside loorl, as
# tests/test_sandbox_setups.py runs it for a non-root caller.
from .interpreter import STAGE_ROOT, interpreter_folders, interpreter_mounts, loader_env, staged_interpreter
from .launcher import (
    DESCRIPTIONS,
    LAUNCHER,
    LEVELS,
    MODES,
    PROBE_PROGRAM,
    SCRATCH_PLACES,
    SETUP_FAILED,
    WORKDIR,
    Mode,
)
from .results import LOADER_FAILED, TAIL_BYTES, SandboxResult, classify
from .running import LAUNCHER_GRACE_S, describe, isolation, run, run_many, world_writable_folders
from .uids import LOCK_DIR, SANDBOX_ROOT, UID_BASE, UID_SLOTS

__all__ = [
    "DESCRIPTIONS",
    "LAUNCHER",
    "LAUNCHER_GRACE_S",
    "LEVELS",
    "LOADER_FAILED",
    "LOCK_DIR",
    "MODES",
    "PROBE_PROGRAM",
    "SANDBOX_ROOT",
    "SCRATCH_PLACES",
    "SETUP_FAILED",
    "STAGE_ROOT",
    "TAIL_BYTES",
    "UID_BASE",
    "UID_SLOTS",
    "WORKDIR",
    "Mode",
    "SandboxResult",
    "classify",
    "describe",
    "interpreter_folders",
    "interpreter_mounts",
    "isolation",
    "loader_env",
    "run",
    "run_many",
    "staged_interpreter",
    "world_writable_folders",
]
