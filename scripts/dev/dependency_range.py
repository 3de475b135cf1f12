"""Build the lowest and the newest environments `pyproject.toml` allows and run the range subset in each.

    python scripts/dev/dependency_range.py                  # both, under /tmp/loorl-deps
    python scripts/dev/dependency_range.py --which newest   # one of them
    python scripts/dev/dependency_range.py --root DIR --report table.md

lowest: every core dependency (`[project] dependencies`) at the version its `>=` names, pinned with a
pip constraints file (what the dependencies pull in themselves, pip resolves). newest: the newest
release of each on the package index (`--upgrade --upgrade-strategy eager`), within the upper bounds
the file sets. torch is the exception in the newest: the CPU build that lies on this machine's disk
(2.13.0; the index serves later releases as CUDA builds of several GB), which is also the lowest
the file allows.

Each environment is a fresh venv with loorl installed from this checkout with its test extra
(`pip install -e ".[test]"`: pytest, pytest-xdist and what the tests' options load: peft, gguf,
tensorboard, wandb), without vLLM, whose CPU build pins torch and caps transformers itself. It runs
`SUBSET`, the suite's core on the library range: the estimators' and losses' maths, every config
option composed and every bad setting's error, the rollout and the gradient on the tiny model,
training runs with each estimator, resume, the quiet run log, the default run's learning bar (with
no deprecated call of loorl's) and the deprecation checks of tests/test_warnings.py. It prints the
versions it resolved and the result, and exits 1 if either end fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
TORCH_ON_DISK = "2.13.0"  # the CPU build this machine's pip finds without a download (see the docstring)
SUBSET = [
    "tests/test_estimators.py",
    "tests/test_losses.py",
    "tests/test_configs.py",
    "tests/test_config_errors.py",
    "tests/test_rollout.py",
    "tests/test_training.py",
    "tests/test_default_run.py",
    "tests/test_warnings.py",
]
# vLLM's CPU build pins torch and caps transformers itself: its option is not part of the range
DESELECTED = ["tests/test_configs.py::test_every_option_composes[rollout=vllm]"]
INDIRECT = ["huggingface-hub", "numpy"]  # reported beside the core: what the core's range pulls in


def core_requirements() -> list[str]:
    """`[project] dependencies` of pyproject.toml, as written."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def lowest_pins(requirements: list[str]) -> list[str]:
    """`name==lower` for each requirement with a `>=` bound (extras dropped: constraints name projects)."""
    pins = []
    for req in map(Requirement, requirements):
        lower = [spec.version for spec in req.specifier if spec.operator == ">="]
        if lower:
            pins.append(f"{req.name}=={lower[0]}")
    return pins


def reported() -> list[str]:
    """The packages whose versions the table shows: the core dependencies, then `INDIRECT`."""
    return [Requirement(req).name for req in core_requirements()] + INDIRECT


def run(command: list[str], log, **kwargs) -> int:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, **kwargs).returncode


def build(which: str, root: Path, log) -> Path:
    """A fresh venv under `root/which` with loorl and its core dependencies at the range's `which` end."""
    venv = root / which
    subprocess.run(["rm", "-rf", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    if which == "lowest":
        constraints = root / "lowest-constraints.txt"
        constraints.write_text("\n".join(lowest_pins(core_requirements())) + "\n")
        command = [*pip, "-c", str(constraints), "-e", f"{ROOT}[test]"]
    else:
        upgrade = ["--upgrade", "--upgrade-strategy", "eager"]
        command = [*pip, *upgrade, f"torch=={TORCH_ON_DISK}", "-e", f"{ROOT}[test]"]
    if run(command, log) != 0:
        raise SystemExit(f"{which}: pip could not build the environment; see {log.name}")
    return venv


VERSIONS = """
import importlib.metadata as m, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
print(json.dumps(found))
"""


def versions(venv: Path) -> dict[str, str]:
    """The installed versions of `reported()` in `venv`."""
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", VERSIONS, *reported()], capture_output=True, text=True
    )
    return json.loads(out.stdout or "{}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--which", choices=["lowest", "newest", "both"], default="both")
    parser.add_argument("--root", type=Path, default=Path("/tmp/loorl-deps"), help="where the venvs go")
    parser.add_argument("--report", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    ends = ["lowest", "newest"] if args.which == "both" else [args.which]
    results = {}
    for which in ends:
        with open(args.root / f"{which}.log", "w") as log:
            started = time.time()
            venv = build(which, args.root, log)
            built = time.time() - started
            env_cache = args.root / f"cache-{which}"  # each environment builds its own tiny model
            command = [
                str(venv / "bin" / "python"),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                *SUBSET,
                *(f"--deselect={test}" for test in DESELECTED),
            ]
            started = time.time()
            code = run(command, log, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "LOORL_CACHE": str(env_cache),
                                                     "HOME": str(args.root)})  # fmt: skip
            tested = time.time() - started
        tail = (args.root / f"{which}.log").read_text().strip().splitlines()[-1]
        results[which] = (versions(venv), code, tail, built, tested)
        print(
            f"{which}: {'passed' if code == 0 else 'FAILED'} ({tail}); built in {built:.0f} s, tested in "
            f"{tested:.0f} s; log {args.root / (which + '.log')}",
            flush=True,
        )
    lines = ["| package | " + " | ".join(ends) + " |", "| --- | " + " | ".join("---" for _ in ends) + " |"]
    for name in reported():
        lines.append(f"| {name} | " + " | ".join(results[w][0].get(name, "-") for w in ends) + " |")
    lines.append("| **subset** | " + " | ".join(results[w][2] for w in ends) + " |")
    table = "\n".join(lines)
    print(table)
    if args.report:
        args.report.write_text(table + "\n")
    raise SystemExit(max(results[w][1] for w in ends))


if __name__ == "__main__":
    main()
