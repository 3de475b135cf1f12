"""The interpreter a sandboxed program runs on: the folders it needs, the mounts that keep them
reachable inside the namespaces, and (level uid) its staged copy that the sandbox uid can reach."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import cache
from pathlib import Path

from .launcher import SCRATCH_PLACES

STAGE_ROOT = Path("/var/cache/loorl-sandbox")  # level uid: interpreter copies its uid can reach


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
