"""The documentation site (mkdocs.yml, docs/): it builds with `--strict` (a broken link, anchor, include
or API reference fails it), and its configuration reference is what conf/ says, key for key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fixtures import needs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import config_reference  # noqa: E402  (scripts/ is not a package)

needs_mkdocs = needs("mkdocs", what="MkDocs Material (.[docs], part of the README's test install)")


def conf_keys(path: Path) -> set[str]:
    """Every key of a YAML file as OmegaConf reads it, dotted (mappings and their leaves)."""
    keys: set[str] = set()

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node.keys():
            dotted = f"{prefix}{key}"
            keys.add(dotted)
            value = node._get_node(key)
            if isinstance(value, DictConfig):
                walk(value, dotted + ".")

    walk(OmegaConf.load(path), "")
    return keys


def reference_keys() -> dict[str, set[str]]:
    """{file under conf/: the keys its section of docs/reference/config.md lists}."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in config_reference.PAGE.read_text().splitlines():
        heading = re.match(r"^#+ `(.+\.yaml)`$", line)
        if heading:
            current = sections.setdefault(heading.group(1), set())
        row = re.match(r"^\| `([^`]+)` \|", line)
        if row and current is not None:
            current.add(row.group(1))
    return sections


def test_the_config_reference_is_what_conf_says():
    """docs/reference/config.md is scripts/config_reference.py's output for today's conf/."""
    assert config_reference.PAGE.read_text() == config_reference.render(), (
        "docs/reference/config.md is out of date: run python scripts/config_reference.py"
    )


def test_every_conf_key_is_in_the_reference_and_every_reference_key_is_in_conf():
    listed = reference_keys()
    files = {str(p.relative_to(config_reference.CONF)): p for p in config_reference.config_files()}
    assert set(listed) == set(files)
    for name, path in files.items():
        assert listed[name] == conf_keys(path), name


def test_a_key_added_to_conf_is_missing_from_the_reference(tmp_path, monkeypatch):
    """The comparison above can fail: a key conf/ gains is not in the committed page."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "train.yaml").write_text("rl:\n  steps: 3  # iterations\n")
    (conf / "eval.yaml").write_text("seed: 0\n")
    monkeypatch.setattr(config_reference, "CONF", conf)
    page = config_reference.render()
    assert "| `rl.steps` | `3` | iterations |" in page
    (conf / "train.yaml").write_text("rl:\n  steps: 3  # iterations\n  new_key: 1\n")
    assert conf_keys(conf / "train.yaml") - {"rl", "rl.steps"} == {"rl.new_key"}
    assert "rl.new_key" not in page


@needs_mkdocs
def test_the_site_builds_with_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
