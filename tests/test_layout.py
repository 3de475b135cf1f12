"""The tree reads like the architecture: no module imports from a layer above its own, no cycles,
imports under `if TYPE_CHECKING:` included (scripts/import_graph.py, docs/reference/layout.md)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph(*args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_graph.py"), *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_no_upward_imports_and_no_cycles():
    out = import_graph()
    first = out.splitlines()[0]
    assert "typing: " in first, out  # the counts below include the typing-only imports
    assert "upward: 0" in first and "cycles: 0" in first, out
    assert "not in LAYERS" not in out, out  # every module has its layer


def test_typing_only_imports_count_as_upward_edges_and_close_cycles(tmp_path):
    """An annotation that names a higher layer's type is an upward edge: a tree whose algorithm layer
    imports the settings only under TYPE_CHECKING, while the settings import it, fails the check."""
    (tmp_path / "loorl" / "algo").mkdir(parents=True)
    (tmp_path / "loorl" / "algo" / "objectives.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from loorl.settings import LossSettings\n"
    )
    (tmp_path / "loorl" / "settings.py").write_text("from loorl.algo.objectives import token_loss_of\n")
    out = import_graph("--root", str(tmp_path))
    first = out.splitlines()[0]
    assert "imports: 2  typing: 1  upward: 1  cycles: 1" in first, out
    assert "upward: loorl.algo.objectives -> loorl.settings  (typing only)" in out, out


def test_the_loss_settings_have_what_the_algorithm_layer_reads():
    """`LossParams` is a Protocol, checked by no one at run time: every attribute it names must be a
    field of the `loss` section that the run passes for it."""
    from loorl.algo.objectives import LossParams
    from loorl.settings import LossSettings

    wanted = {name for name, value in vars(LossParams).items() if isinstance(value, property)}
    assert wanted and wanted <= {f.name for f in dataclasses.fields(LossSettings)}


def test_the_types_module_imports_nothing_of_loorl():
    source = (ROOT / "src" / "loorl" / "types.py").read_text()
    assert "loorl" not in "".join(line for line in source.splitlines() if line.startswith(("import", "from")))
