"""The tree reads like the architecture: no module imports from a layer above its own, no cycles
(scripts/import_graph.py, README "Layout")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_upward_imports_and_no_cycles():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_graph.py")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert "upward: 0" in first and "cycles: 0" in first, done.stdout
    assert "not in LAYERS" not in done.stdout, done.stdout  # every module has its layer


def test_the_types_module_imports_nothing_of_loorl():
    source = (ROOT / "src" / "loorl" / "types.py").read_text()
    assert "loorl" not in "".join(line for line in source.splitlines() if line.startswith(("import", "from")))
