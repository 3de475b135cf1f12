"""The tree reads like the architecture: no module imports from a layer above its own, no cycles,
imports under `if TYPE_CHECKING:` included (scripts/dev/import_graph.py, docs/reference/layout.md)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph(*args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "dev" / "import_graph.py"), *args],
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


# ---- the layout page and the README agree with the tree ------------------------------------------------
LAYOUT = ROOT / "docs" / "reference" / "layout.md"
HEADER = re.compile(r"^  (\S.*?)\s{2,}")  # `  rollout/        the environment: ...`: an entry of src/loorl/


def layout_entries(text: str) -> dict[str, str]:
    """The src/loorl/ entries of the layout page's tree: header (`rollout/`, `errors.py, types.py`) ->
    the entry's whole text, continuation lines included."""
    block = text.split("```\n", 2)[1]
    lines = block.split("src/loorl/\n", 1)[1].splitlines()
    entries, header = {}, None
    for line in lines:
        if not line.startswith(" "):  # tests/, scripts/...: past src/loorl/
            break
        if match := HEADER.match(line):
            header = match.group(1)
            entries[header] = ""
        entries[header] += " " + line
    return entries


def test_the_layout_page_names_every_module_in_its_folders_entry():
    entries = layout_entries(LAYOUT.read_text())
    missing = []
    for path in sorted((ROOT / "src" / "loorl").rglob("*.py")):
        relative = path.relative_to(ROOT / "src" / "loorl")
        if path.name == "__init__.py" and len(relative.parts) > 1:
            continue  # a package is named by its folder
        if len(relative.parts) == 1:  # config.py: in an entry's header
            named = any(path.name in header.split(", ") for header in entries) or path.name == "__init__.py"
        else:
            text = entries.get(f"{relative.parts[0]}/", "")
            named = re.search(rf"\b{re.escape(path.stem)}\b", text) is not None
        if not named:
            missing.append(str(relative))
    assert not missing, f"docs/reference/layout.md does not name {missing}: add each to its folder's entry"


def test_the_layout_page_names_every_script_and_nothing_that_is_gone():
    text = LAYOUT.read_text()
    block = text.split("```\n", 2)[1]
    groups = [p for p in (ROOT / "scripts").iterdir() if p.is_dir() and p.name != "__pycache__"]
    loose = [p.name for p in (ROOT / "scripts").iterdir() if p.is_file()]
    assert not loose, f"scripts/ holds folders by purpose (bench, research, ...), not {loose}"
    scripts_block = block.split("\nscripts/ ", 1)[1]  # the scripts/ entry: a folder by purpose per line
    for group in groups:
        assert f"\n  {group.name}/ " in scripts_block, f"layout.md does not name scripts/{group.name}/"
        files = [p.name for p in group.iterdir() if p.suffix in (".py", ".sh", ".sbatch")]
        assert not [f for f in sorted(files) if f not in scripts_block], (group.name, files)
    for header in layout_entries(text):  # the src/loorl/ entries' files and folders exist
        for name in header.split(", "):
            assert (ROOT / "src" / "loorl" / name).exists(), (
                f"layout.md names src/loorl/{name}, which is gone"
            )
    for name in re.findall(r"\b((?:scripts|src|tests)/[\w./]+)", block):
        assert (ROOT / name.rstrip(".,")).exists(), f"layout.md names {name}, which is gone"


def test_the_readmes_documentation_list_links_every_concept_how_to_research_and_reference_page():
    readme = (ROOT / "README.md").read_text().split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    pages = [
        p for folder in ("concepts", "how-to", "reference") for p in (ROOT / "docs" / folder).glob("*.md")
    ]
    pages += list((ROOT / "docs" / "research").glob("*.md"))
    missing = sorted(str(p.relative_to(ROOT)) for p in pages if f"({p.relative_to(ROOT)}" not in readme)
    assert not missing, f"README.md's documentation list does not link {missing}"


def test_the_readmes_figures_are_those_of_the_pages_it_cites():
    """The speed-ups against TRL and the GPU figures the README quotes stand on the performance pages."""
    readme = (ROOT / "README.md").read_text()
    performance = (ROOT / "docs" / "performance" / "index.md").read_text()
    trl_row = next(line for line in readme.splitlines() if line.startswith("| speed on the same CPU work"))
    speedups = re.findall(r"\d+\.\d+x", trl_row)
    assert speedups and [x for x in speedups if x not in performance] == []
    gpu = (ROOT / "docs" / "performance" / "gpu.md").read_text()
    gpu_bullet = readme.split("- **On GPUs**", 1)[1].split("\n- ", 1)[0].split("\n## ", 1)[0]
    figures = re.findall(r"\d[\d,]*(?:\.\d+)? (?:generated tokens/s|s per RL step)", gpu_bullet)
    assert figures and [f.split()[0] for f in figures if f.split()[0] not in gpu] == []
