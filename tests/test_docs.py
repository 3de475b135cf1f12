"""The documentation site (mkdocs.yml, docs/): it builds with `--strict` (a broken link, anchor, include
or API reference fails it), and its configuration reference is what conf/ says, key for key."""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from fixtures import needs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "dev"))
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


def test_no_page_holds_a_control_character():
    """A formula written through a non-raw Python string turns `\\frac` into a form feed and `\\alpha`
    into a bell: the page then renders `rac` and `lpha` (docs/concepts/estimators.md did)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = [
        str(p.relative_to(ROOT)) for p in pages if re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f]", p.read_text())
    ]
    assert not bad


def test_the_config_reference_is_what_conf_says():
    """docs/reference/config.md is scripts/dev/config_reference.py's output for today's conf/."""
    assert config_reference.PAGE.read_text() == config_reference.render(), (
        "docs/reference/config.md is out of date: run python scripts/dev/config_reference.py"
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


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this file's tests with `--strict`."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


@needs_mkdocs
def test_the_site_builds_with_strict(site):
    assert (site / "index.html").exists()
    assert (site / "reference" / "config" / "index.html").exists()


# What a browser fetches when it opens a page: {tag: the attributes holding a URL it loads}. <link> loads
# for the rels in FETCHING_RELS only (a rel=canonical or an <a href> is a link to follow, not a fetch).
FETCHING_ATTRIBUTES = {
    "script": ("src",),
    "img": ("src", "srcset"),
    "iframe": ("src",),
    "source": ("src", "srcset"),
    "video": ("src", "poster"),
    "audio": ("src",),
    "track": ("src",),
    "embed": ("src",),
    "object": ("data",),
    "input": ("src",),
}
FETCHING_RELS = {
    "stylesheet", "preload", "modulepreload", "prefetch", "preconnect", "dns-prefetch", "icon",
    "apple-touch-icon", "manifest",
}  # fmt: skip
NETWORK = re.compile(r"^\s*(?:https?:)?//", re.IGNORECASE)
CSS_URL = re.compile(r"""(?:@import\s+(?:url\(\s*)?|url\(\s*)["']?([^"')\s;]+)""", re.IGNORECASE)


class Fetches(HTMLParser):
    """The network URLs a page's markup would fetch (scripts, stylesheets, fonts, images, frames)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        urls = [values.get(name, "") for name in FETCHING_ATTRIBUTES.get(tag, ())]
        if tag == "link" and FETCHING_RELS & set(values.get("rel", "").lower().split()):
            urls.append(values.get("href", ""))
        urls = [url for value in urls for url in value.split(",")]  # a srcset lists several
        urls += CSS_URL.findall(values.get("style", ""))
        self.urls += [f"<{tag}> {url.strip()}" for url in urls if NETWORK.match(url)]
        self.in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self.in_style = False

    def handle_data(self, data: str) -> None:
        if self.in_style:
            self.urls += [f"<style> {url}" for url in CSS_URL.findall(data) if NETWORK.match(url)]


def network_fetches(site: Path) -> list[str]:
    """Every 'page: what it fetches from the network' of a built site, its HTML and its CSS files."""
    found = []
    for page in sorted(site.rglob("*.html")):
        parser = Fetches()
        parser.feed(page.read_text())
        found += [f"{page.relative_to(site)}: {url}" for url in parser.urls]
    for sheet in sorted(site.rglob("*.css")):
        urls = [url for url in CSS_URL.findall(sheet.read_text()) if NETWORK.match(url)]
        found += [f"{sheet.relative_to(site)}: {url}" for url in urls]
    return found


@needs_mkdocs
def test_no_built_page_fetches_anything_from_the_network(site):
    """The site reads offline (a login node's `mkdocs serve`): no script, stylesheet, font, image or frame
    from a CDN. The formulas are MathML from docs/hooks/maths.py, not MathJax; `theme.font: false`."""
    fetches = network_fetches(site)
    assert not fetches, "a built page would fetch from the network:\n" + "\n".join(fetches[:20])


def test_the_network_check_finds_a_cdn_script_a_font_and_a_css_import(tmp_path):
    """The check above can fail: it sees what MathJax from a CDN and Google Fonts would add."""
    (tmp_path / "index.html").write_text(
        '<html><head><script src="https://unpkg.com/mathjax@3/es5/tex-mml-chtml.js"></script>'
        '<link rel="stylesheet" href="//fonts.googleapis.com/css?family=Roboto">'
        '<link rel="canonical" href="https://example.org/"><script src="assets/local.js"></script>'
        '<style>@import url("https://example.org/a.css");</style></head>'
        '<body><a href="https://example.org/">a link</a><img srcset="a.png 1x, http://x.org/b.png 2x">'
        '<math xmlns="http://www.w3.org/1998/Math/MathML"><mi>x</mi></math></body></html>'
    )
    (tmp_path / "extra.css").write_text("a { background: url('https://example.org/i.png'); }")
    assert network_fetches(tmp_path) == [
        "index.html: <script> https://unpkg.com/mathjax@3/es5/tex-mml-chtml.js",
        "index.html: <link> //fonts.googleapis.com/css?family=Roboto",
        "index.html: <style> https://example.org/a.css",
        "index.html: <img> http://x.org/b.png 2x",
        "extra.css: https://example.org/i.png",
    ]


class Text(HTMLParser):
    """A page's text outside <pre>, <code> and <script>, and its <math> elements."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.maths = 0
        self.skipping = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        self.maths += tag == "math"
        self.skipping += tag in ("pre", "code", "script")

    def handle_endtag(self, tag: str) -> None:
        self.skipping -= tag in ("pre", "code", "script")

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.text.append(data)


@needs_mkdocs
def test_the_formulas_are_mathml_in_the_built_pages(site):
    """Every formula of docs/concepts/estimators.md is a <math> element of its built page, and no built
    page shows TeX delimiters, \\( or \\[, as text (what a reader without MathJax saw)."""
    source = (ROOT / "docs" / "concepts" / "estimators.md").read_text()
    formulas = source.count("\\(") + source.count("$$") // 2
    page = Text()
    page.feed((site / "concepts" / "estimators" / "index.html").read_text())
    assert formulas > 20 and page.maths == formulas
    for path in sorted(site.rglob("*.html")):
        text = Text()
        text.feed(path.read_text())
        raw = re.findall(r".{0,40}\\[(\[].{0,40}", "".join(text.text))
        assert not raw, f"{path.relative_to(site)} shows TeX as text: {raw[:3]}"
