"""Write the configuration reference (docs/reference/config.md) from the YAML files under conf/.

    python scripts/dev/config_reference.py            # rewrite docs/reference/config.md
    python scripts/dev/config_reference.py --check    # exit 1 if the page differs from what conf/ says

Every key of every file is a row: its dotted path, its value as written (interpolations unresolved)
and the comment beside it in the file, continuation lines included; a file's header comment heads its
section. The configs are the documentation of their options (each has a comment there), so the page is
made from them and cannot drift: `tests/test_docs.py` regenerates it and compares, and checks its keys
against OmegaConf's reading of the same files both ways.

Written by hand: YAML loaders drop comments, and the comments are the content.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
PAGE = ROOT / "docs" / "reference" / "config.md"
KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z0-9_@./+-]+):(?P<rest>.*)$")
ITEM = re.compile(r"^(?P<indent>\s*)- (?P<rest>.*)$")


@dataclass
class Row:
    key: str  # dotted path in the file
    value: str  # as written; "" for a section
    comment: list[str] = field(default_factory=list)


@dataclass
class ConfigFile:
    path: Path
    header: list[str]
    rows: list[Row]


def split_comment(text: str) -> tuple[str, str]:
    """'value  # comment' -> ('value', 'comment'); a '#' inside quotes or braces is part of the value."""
    depth, quote = 0, None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == "#" and depth == 0 and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip(), text[i + 1 :].strip()
    return text.strip(), ""


def parse(path: Path) -> ConfigFile:
    """The rows of one YAML file of this repository's style: block mappings, `key: value  # comment`
    lines with continuation comments indented past the key, and block lists (whose items are the
    value of the key above them)."""
    header: list[str] = []
    rows: list[Row] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the mappings the line is inside
    last: Row | None = None
    last_indent = -1
    in_header = True
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped:
            in_header = in_header and not rows
            continue
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            indent = len(line) - len(line.lstrip())
            if in_header and not rows:
                if not text.startswith("@package"):
                    header.append(text)
            elif last is not None and indent > last_indent:
                last.comment.append(text)  # a continuation of the comment beside the last key
            continue
        in_header = False
        item = ITEM.match(line)
        if item:  # a list item: part of the value of the key above
            value, comment = split_comment(item.group("rest"))
            if last is not None:
                last.value = (last.value + "<br>" if last.value else "") + f"- {value}"
                if comment:
                    last.comment.append(f"{value}: {comment}" if last.key == "defaults" else comment)
            continue
        match = KEY.match(line)
        if not match:
            raise SystemExit(f"{path.relative_to(ROOT)}: cannot read the line {line!r}")
        indent = len(match.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        value, comment = split_comment(match.group("rest"))
        dotted = ".".join([k for _, k in stack] + [match.group("key")])
        last, last_indent = Row(dotted, value, [comment] if comment else []), indent
        rows.append(last)
        if not value:
            stack.append((indent, match.group("key")))
    return ConfigFile(path, header, rows)


def config_files() -> list[Path]:
    """conf/train.yaml, conf/eval.yaml, then every group's files, group by group (a group's own files
    before its subfolders')."""
    top = [CONF / "train.yaml", CONF / "eval.yaml"]
    rest = [p for p in CONF.rglob("*.yaml") if p not in top]
    return top + sorted(rest, key=lambda p: (p.relative_to(CONF).parts[0], str(p.parent), p.name))


def cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and `<` so that `<run>/...` is not read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def prose(text: str) -> str:
    """A comment as Markdown text: `_` and `*` literal (`_self_`, `_target_`, `a * b`), not emphasis;
    inside backticks (code) nothing is escaped but the pipes."""
    parts = cell(text).split("`")
    return "`".join(p if i % 2 else p.replace("_", "\\_").replace("*", "\\*") for i, p in enumerate(parts))


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Every key of every file under `conf/`, with its value as written there (`${...}` are Hydra",
        "interpolations, resolved when a run composes its config) and the comment beside it. Generated",
        "by `python scripts/dev/config_reference.py` from the files themselves; `tests/test_docs.py` fails",
        "when this page and `conf/` disagree. How the files compose:",
        "[How the configs compose](../how-to/configs.md).",
        "",
        "A group's option is chosen with `group=option` on the command line (`estimator=grpo`); a key is",
        "set with `key=value` (`rl.steps=20`), added with `+key=value` where the file does not have it.",
        "",
        '<div class="config-reference" markdown>',
        "",
    ]
    group = None
    for path in config_files():
        parsed = parse(path)
        relative = path.relative_to(CONF)
        here = str(relative.parent) if relative.parent != Path(".") else None
        if here != group and here is not None:
            out += [f"## {here}", ""]
            group = here
        level = "##" if here is None else "###"
        out += [f"{level} `{relative}`", ""]
        if parsed.header:
            out += [prose(" ".join(parsed.header)), ""]
        out += ["| key | value | what it does |", "| --- | --- | --- |"]
        for row in parsed.rows:
            if row.key == "defaults":  # a list of group choices: its own table below
                out.append("| `defaults` | the list below | the config groups this file composes, in order |")
                continue
            value = f"`{cell(row.value)}`" if row.value else ""
            out.append(f"| `{row.key}` | {value} | {prose(' '.join(row.comment))} |")
        out.append("")
        defaults = next((row for row in parsed.rows if row.key == "defaults"), None)
        if defaults is not None:
            out += ["| `defaults` entry | what it does |", "| --- | --- |"]
            notes = {c.split(": ", 2)[0] + ": " + c.split(": ", 2)[1]: c.split(": ", 2)[2]
                     for c in defaults.comment if c.count(": ") >= 2}  # fmt: skip
            for item in defaults.value.split("<br>"):
                entry = item.removeprefix("- ")
                out.append(f"| {cell(entry)} | {prose(notes.get(entry, ''))} |")
            out.append("")
    out += ["</div>", ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            sys.exit(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/dev/config_reference.py")
        return
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}: {len(config_files())} files")


if __name__ == "__main__":
    main()
