"""The house rules that a reviewer would otherwise check by hand: one job per file (no module of
src/ past 400 lines) and a tree that ruff passes (the docs' examples included, since the site shows
them as they are)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400  # past this a file is split by job (the developers' guide)


def long_files(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Every .py file under `root` with more than `limit` lines, as path -> line count."""
    counts = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}
    return {path: n for path, n in counts.items() if n > limit}


def test_no_module_of_src_is_past_400_lines():
    too_long = long_files(ROOT / "src")
    assert not too_long, f"split these by job (at most {MAX_LINES} lines a file): {too_long}"


def test_the_line_count_rule_sees_a_long_file(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_files(tmp_path) == {"pkg/long.py": MAX_LINES + 1}


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is in the test extra")
def test_ruff_passes_on_the_code_and_the_docs_examples():
    command = [sys.executable, "-m", "ruff", "check", "src", "tests", "scripts", "docs/examples"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
