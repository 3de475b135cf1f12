"""The sandbox on set-ups other than the one it was built on, each made for real here: an interpreter
in a venv under a scratch place, an interpreter that needs `LD_LIBRARY_PATH`, two jobs with their
own `TMPDIR`, a uid of the sandbox range that someone else uses, a non-root caller, a root caller
without namespaces. Each caller is a separate process that imports `loorl.sandbox` and prints what
it saw as JSON."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import loorl
from fixtures import sandbox_leftovers
from loorl import sandbox

SRC = str(Path(loorl.__file__).parent.parent)  # the folder that holds the loorl package

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="builds set-ups that need root")

CALLER = """
import dataclasses, json, sys
sys.path.insert(0, {src!r})
from {module} import isolation, run
found = {{"isolation": isolation()}}
found["results"] = [dataclasses.asdict(run(p, timeout_s={timeout})) for p in {programs!r}]
print(json.dumps(found))
"""


def call(python: str, programs: list[str], *, env: dict | None = None, src: str = SRC,
         module: str = "loorl.sandbox", timeout: float = 10, **popen) -> dict:  # fmt: skip
    """Run `programs` in the sandbox from a caller process on `python`; its isolation and results."""
    script = CALLER.format(src=src, module=module, programs=programs, timeout=timeout)
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": tempfile.gettempdir()} | (env or {})
    done = subprocess.run(
        [python, "-c", script], env=env, capture_output=True, text=True, timeout=300, **popen
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


WHERE = "import os, sys\nprint(sys.prefix, os.getuid())\n"


@pytest.mark.parametrize("place", sandbox.SCRATCH_PLACES)
def test_an_interpreter_in_a_venv_under_a_scratch_place_runs_programs(place):
    """A scratch place is a private tmpfs inside; the venv (and its base interpreter under /root) are
    bound back read-only after it."""
    root = tempfile.mkdtemp(prefix="loorl-venv-", dir=place)
    try:
        venv = Path(root) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                       check=True, timeout=120)  # fmt: skip
        found = call(str(venv / "bin" / "python"), [WHERE, "import json\nprint(json.dumps([1]))\n"])
        assert found["isolation"]["level"] == "full"
        (first, second) = found["results"]
        assert first["passed"], first
        prefix, uid = first["stdout"].split()
        assert prefix == str(venv) and int(uid) >= sandbox.UID_BASE
        assert second["passed"] and second["stdout"] == "[1]\n"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _patchelf() -> str:
    found = shutil.which("patchelf") or os.path.join(sysconfig.get_path("scripts"), "patchelf")
    if not os.path.isfile(found):
        pytest.skip("needs patchelf (the test extra installs it)")
    return found


def test_an_interpreter_that_needs_ld_library_path_gets_it_and_nothing_else(tmp_path):
    """Like an HPC `module load` Python: the executable finds libpython only through LD_LIBRARY_PATH
    (its run path removed, the library copied to a folder of its own under a name that no system
    library has)."""
    library = sysconfig.get_config_var("INSTSONAME")
    libdir = sysconfig.get_config_var("LIBDIR")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not os.path.isfile(os.path.join(libdir, library)):
        pytest.skip("needs an interpreter built with a shared libpython")
    venv, libs = tmp_path / "venv", tmp_path / "module-libs"
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)  # fmt: skip
    python = venv / "bin" / "python"
    module_library = "libloorl-module-" + library
    subprocess.run([_patchelf(), "--remove-rpath", "--replace-needed", library, module_library, str(python)],
                   check=True, timeout=60)  # fmt: skip
    libs.mkdir()
    shutil.copy2(os.path.join(libdir, library), libs / module_library)
    bare = subprocess.run([str(python), "-c", "pass"], env={}, capture_output=True, text=True, timeout=60)
    assert bare.returncode == 127 and sandbox.LOADER_FAILED in bare.stderr  # it really needs it
    program = "import os\nprint(sorted(os.environ))\nprint(os.environ['LD_LIBRARY_PATH'])\n"
    found = call(str(python), [program],
                 env={"LD_LIBRARY_PATH": str(libs), "LOORL_SECRET": "x"})  # fmt: skip
    (result,) = found["results"]
    assert result["passed"], result
    names, path = result["stdout"].splitlines()
    assert json.loads(names.replace("'", '"')) == ["HOME", "LANG", "LD_LIBRARY_PATH", "PATH", "TMPDIR"]
    assert path == str(libs)


def test_an_interpreter_that_cannot_start_is_unscorable_not_wrong():
    passed, status = sandbox.classify(
        127, f"python: {sandbox.LOADER_FAILED}: libpython3.11.so.1.0", timed_out=False
    )
    assert (passed, status) == (None, "sandbox")
    assert sandbox.classify(127, "", timed_out=False) == (False, "error")  # the program's own exit(127)


def test_two_jobs_with_their_own_tmpdir_do_not_kill_each_others_programs(tmp_path):
    """SLURM gives each job its own TMPDIR; the uids are machine-wide, and so are their locks."""
    script = CALLER.format(src=SRC, module="loorl.sandbox", timeout=20, programs=[
        "import os, time\nprint(os.getuid())\ntime.sleep(4)\nprint('slept')\n"])  # fmt: skip
    quick = CALLER.format(src=SRC, module="loorl.sandbox", timeout=20,
                          programs=["import os\nprint(os.getuid())\n"] * 3)  # fmt: skip
    jobs = []
    for name, text in (("a", script), ("b", quick)):
        tmpdir = tmp_path / f"job-{name}"
        tmpdir.mkdir()
        env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmpdir)}
        jobs.append(subprocess.Popen([sys.executable, "-c", text], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
        time.sleep(1.5)
    (slow,), quick_results = (
        json.loads(job.communicate(timeout=120)[0].splitlines()[-1])["results"] for job in jobs
    )
    assert (slow["passed"], slow["status"]) == (True, "passed"), slow
    assert slow["stdout"].split()[1] == "slept" and slow["seconds"] > 4
    assert all(r["passed"] for r in quick_results)
    assert slow["stdout"].split()[0] not in {r["stdout"].strip() for r in quick_results}  # never the same uid


def test_a_uid_in_the_range_that_someone_else_runs_is_neither_taken_nor_killed():
    """A process of uid 61000 that the sandbox did not start (a real user's, another tool's)."""
    stranger = subprocess.Popen(
        ["sleep", "60"], user=sandbox.UID_BASE, group=sandbox.UID_BASE, extra_groups=[]
    )
    try:
        time.sleep(0.2)
        result = sandbox.run("import os\nprint(os.getuid())\n")
        assert result.passed and int(result.stdout) != sandbox.UID_BASE
        assert stranger.poll() is None  # still running
    finally:
        stranger.kill()
        stranger.wait()


def test_no_world_writable_host_folder_is_writable_inside():
    """Every world-writable host folder found (mount points and the usual places): the program writes
    a file into each; none reaches the host (`/tmp`, `/var/tmp`, `/dev/shm` are private tmpfs inside,
    the rest of the host is read-only)."""
    folders = sandbox.world_writable_folders()
    assert {"/tmp", "/dev/shm"} <= set(folders)
    name = f"loorl-escape-{os.getpid()}"
    program = textwrap.dedent(f"""
        import os
        for folder in {folders!r}:
            try:
                open(os.path.join(folder, {name!r}), "w").write("x")
                print("wrote", folder)
            except OSError as err:
                print("refused", folder, err.strerror)
    """)
    result = sandbox.run(program)
    assert result.passed, result.stderr
    reached = [f for f in folders if os.path.exists(os.path.join(f, name))]
    for folder in reached:
        os.remove(os.path.join(folder, name))
    assert reached == [], result.stdout
    assert "refused /run/lock Read-only file system" in result.stdout or "/run/lock" not in folders


def _interpreter_for(uid: int) -> str | None:
    """An interpreter that `uid` can start (the project's may live under /root, which it cannot enter)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            probe = subprocess.run([candidate, "-I", "-c", "import ctypes, json"], user=uid, group=uid,
                                   extra_groups=[], capture_output=True, timeout=60)  # fmt: skip
        except OSError:  # not there, or not for this user
            continue
        if probe.returncode == 0:
            return candidate
    return None


def test_a_non_root_caller_gets_namespaces_or_says_it_has_none(tmp_path):
    nobody = 65534
    python = _interpreter_for(nobody)
    if python is None:
        pytest.skip("no interpreter that a non-root user can start")
    outside = next(p for p in ("/var/cache", "/opt", "/srv", "/") if os.path.isdir(p))  # not a scratch place
    home = Path(tempfile.mkdtemp(prefix="loorl-nonroot-", dir=outside))
    try:
        os.chmod(home, 0o755)
        shutil.copytree(  # the package alone: standard library only
            Path(sandbox.__file__).parent,
            home / "standalone_sandbox",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        canary = home / "canary.txt"
        canary.write_text("keep")
        os.chown(canary, nobody, nobody)  # the caller's own file
        programs = [
            "import os\nprint(os.getuid())\n",
            f"try:\n    open({str(canary)!r}, 'w').write('gone')\n"
            "except OSError as err:\n    print('refused', err.strerror)\n",
            "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
            "    print('connected')\n"
            "except OSError:\n    print('unreachable')\n",
        ]  # fmt: skip
        found = call(python, programs, src=str(home), module="standalone_sandbox", user=nobody, group=nobody,
                     extra_groups=[], cwd=str(home))  # fmt: skip
        fences = found["isolation"]
        uid, write, network = (r["stdout"].strip() for r in found["results"])
        assert int(uid) == nobody and fences["user"].startswith("the caller")
        if fences["level"] == "namespaces":  # unprivileged user namespaces: no network, host read-only
            assert write == "refused Read-only file system" and network == "unreachable"
            assert canary.read_text() == "keep"
        else:  # said plainly: nothing but limits
            assert (fences["level"], fences["network"]) == ("none", "host (none)") and fences["refused"]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _drop_sys_admin():
    """In the child before exec: CAP_SYS_ADMIN leaves the bounding set, so the exec'd root process has
    no namespaces or mounts (Docker's default profile is stricter still)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, 21, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_SYS_ADMIN
        os._exit(99)


def test_root_without_namespaces_runs_programs_as_its_own_uid_and_says_what_is_missing():
    programs = [
        WHERE,
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\nprint('parent')\n",
        "while True:\n    pass\n",
    ]
    found = call(sys.executable, programs, preexec_fn=_drop_sys_admin, timeout=3)
    fences = found["isolation"]
    assert fences["level"] == "uid" and "full: pid namespace: Operation not permitted" in fences["refused"]
    assert fences["network"] == "host (none)"
    where, orphan, loop = found["results"]
    assert where["passed"], where  # the interpreter under /root reached through its staged copy
    assert int(where["stdout"].split()[1]) >= sandbox.UID_BASE
    assert orphan["passed"] and loop["status"] == "timeout"
    left = sandbox_leftovers()  # not the other worker's programs, which hold their uids' locks
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []  # the sleeper that left the process group went with its uid


ROOTLESS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def check(ok, what):
    if not ok:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")
# a container runtime's view of /proc: part of it masked (Docker, Podman and Kubernetes cover /proc paths)
check(libc.unshare(0x00020000) == 0, "mount namespace")
check(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0, "private mounts")
check(libc.mount(b"tmpfs", b"/proc/sys", b"tmpfs", 0, b"size=1m") == 0, "masking /proc/sys")
ready, mapped = os.pipe(), os.pipe()
child = os.fork()
if child == 0:  # the container: root of a user namespace (65536 uids mapped), its mounts locked
    check(libc.unshare(0x10000000 | 0x00020000) == 0, "user namespace")
    os.write(ready[1], b"1")
    os.read(mapped[0], 1)
    os.setgid(0); os.setuid(0)
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
os.read(ready[0], 1)
for name in ("uid_map", "gid_map"):
    with open(f"/proc/{child}/{name}", "w") as f:
        f.write("0 0 65536")
os.write(mapped[1], b"1")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


def test_a_user_namespaced_container_whose_proc_is_masked_is_found_out_by_the_probe():
    """Rootless containers and user-namespaced pods: namespaces work, but mounting a /proc for the
    program's PID namespace is refused (part of the container's /proc is covered). The probe runs
    every fence that `run` uses, so it says so and falls back, rather than reporting fences that
    every run then fails to build."""
    script = CALLER.format(src=SRC, module="loorl.sandbox", timeout=10, programs=[WHERE])
    done = subprocess.run([sys.executable, "-c", ROOTLESS, script], capture_output=True, text=True,
                          timeout=300,
                          env={"PATH": "/usr/bin:/bin", "TMPDIR": tempfile.gettempdir()})  # fmt: skip
    if done.returncode != 0 and "user namespace" in done.stderr:
        pytest.skip(f"cannot build the container here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    fences, (result,) = found["isolation"], found["results"]
    assert "full: /proc of the pid namespace: Operation not permitted" in fences["refused"], fences
    assert fences["level"] == "uid" and result["passed"], (fences, result)
    assert int(result["stdout"].split()[1]) >= sandbox.UID_BASE


MBPP_ROW = {"task_id": 1, "text": "Write a function add(a, b).", "code": "def add(a, b):\n    return a + b\n",
            "test_list": ["assert add(1, 2) == 3"]}  # fmt: skip
REPO = Path(__file__).resolve().parents[1]


def test_a_code_run_below_the_required_isolation_stops_in_one_line_before_any_model_loads(tmp_path):
    """`task.sandbox.require=full` (the default) where namespaces are refused: one `error:` line and exit
    status 2, from the task's construction (before the model or the tokenizer loads)."""
    rows = tmp_path / "mbpp.jsonl"
    rows.write_text(json.dumps(MBPP_ROW) + "\n")
    env = {**os.environ, "LOORL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "src/train.py", "task=humaneval", f"task.data.path={rows}", "task.style=chat",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, preexec_fn=_drop_sys_admin,
    )  # fmt: skip
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert errors[0].startswith(
        "error: task.sandbox.require=full, but the sandbox here is uid (full: pid namespace"
    )
    assert "task.sandbox.require=any" in errors[0]
    assert not (tmp_path / "cache").exists()  # nothing was fetched or built
    accepted = subprocess.run(
        [sys.executable, "-c", "from loorl.tasks.code import CodeTask\n"
         f"task = CodeTask(data={{'path': {str(rows)!r}}}, style='chat', sandbox={{'require': 'any'}})\n"
         "print(task.run_facts()['sandbox'])\nprint(task.grade(task.eval_prompts()[0], "
         "'```python\\ndef add(a, b):\\n    return a + b\\n```'))"],
        capture_output=True, text=True, timeout=300, preexec_fn=_drop_sys_admin,
    )  # fmt: skip
    facts, verdict = accepted.stdout.splitlines()[-2:]
    assert facts.startswith("sandbox isolation uid: user uid 61000+") and "network host (none)" in facts
    assert verdict == "(1.0, True)"
