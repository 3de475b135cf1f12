"""Prompt datasets from files or the hub: rows -> `Example`s, prompt rendering and length filtering.

Supported sources for `load_examples(path, split=...)`:

- a local `.parquet`, `.jsonl` or `.json` (a list of objects) file;
- a local directory holding `<split>.parquet` / `<split>.jsonl` / `<split>.json` (verl's preprocessing
  writes `data/gsm8k/train.parquet` and `test.parquet`); for `split` "validation"/"val"/"test" the
  other two names are accepted when exactly one of them exists;
- otherwise a hub dataset name, `name` or `name:config` (e.g. `openai/gsm8k:main`), read with
  `datasets.load_dataset` when the optional `datasets` package is installed.

Row layouts (`layout="auto"` detects them from the first row's columns):

- `verl`: `prompt` (a list of chat messages) + `reward_model: {"ground_truth": ..., "style": ...}`;
- `gsm8k`: `question` + `answer` ending in `#### <number>`;
- `math`: `problem` + `solution` (+ optional `answer`);
- `custom`: `question_key` / `answer_key` name the columns.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loorl.errors import ConfigError

LAYOUTS = ("auto", "verl", "gsm8k", "math", "custom")
ON_OVERFLOW = ("filter", "error")
FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
_EVAL_SPLIT_ALIASES = ("validation", "val", "test")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class Example:
    question: str  # the question text, or the last user message when the row holds chat messages
    answer: str  # the bare reference answer
    columns: dict = field(default_factory=dict)  # every other column, for custom reward functions


# ----------------------------------------------------------------------------------------------- loading


def load_examples(
    path: str,
    *,
    split: str,
    layout: str = "auto",
    question_key: str | None = None,
    answer_key: str | None = None,
    limit: int | None = None,
) -> list[Example]:
    """Read `split` of the dataset at `path` and turn its rows into `Example`s (the first `limit` rows)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"data.layout={layout!r} is not one of {', '.join(LAYOUTS)}")
    if limit is not None and limit < 0:
        raise ConfigError(f"data.limit={limit} must be >= 0 or null (all rows)")
    rows, source = _read_rows(str(path), split, limit)
    if not rows:
        if limit == 0:
            return []
        raise ConfigError(
            f"data.path={path} split={split!r} has no rows ({source}); point data.path elsewhere"
        )
    layout = _resolve_layout(layout, rows[0], question_key, answer_key, source)
    return [_convert(row, i, layout, question_key, answer_key, source) for i, row in enumerate(rows)]


def _read_rows(path: str, split: str, limit: int | None) -> tuple[list[dict], str]:
    local = Path(os.path.expanduser(path))
    if local.is_file():
        rows = _read_file(local)
    elif local.is_dir():
        local = _split_file(local, split, path)
        rows = _read_file(local)
    else:
        return _read_hub(path, split, limit)
    return (rows if limit is None else rows[:limit]), str(local)


def _split_file(directory: Path, split: str, path: str) -> Path:
    def find(name: str) -> Path | None:
        for suffix in FILE_SUFFIXES:
            if (directory / f"{name}{suffix}").is_file():
                return directory / f"{name}{suffix}"
        return None

    exact = find(split)
    if exact is not None:
        return exact
    if split in _EVAL_SPLIT_ALIASES:
        found = [f for f in (find(name) for name in _EVAL_SPLIT_ALIASES) if f is not None]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise ConfigError(
                f"data.path={path} has no {split} file and several candidates ({names}); "
                f"name the split exactly or point data.path at one file"
            )
    present = sorted(p.name for p in directory.iterdir() if p.suffix in FILE_SUFFIXES)
    raise ConfigError(
        f"data.path={path} is a directory without {split}.parquet or {split}.jsonl "
        f"(data files: {', '.join(present) or 'none'}); point data.path at a file or fix the split name"
    )


def _read_file(file: Path) -> list[dict]:
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(file)
    if suffix == ".jsonl":
        return _read_jsonl(file)
    if suffix == ".json":
        return _read_json(file)
    raise ConfigError(
        f"data.path={file} has unsupported suffix {suffix or '(none)'!r}; "
        f"use a .parquet, .jsonl or .json file"
    )


def _read_parquet(file: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(file).to_pylist()
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise ConfigError(f"data.path={file} is not a readable parquet file ({_one_line(e)})") from e


def _read_jsonl(file: Path) -> list[dict]:
    rows = []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"data.path={file} line {lineno} is not valid JSON ({e.msg}); fix or remove that line"
                ) from e
            if not isinstance(row, dict):
                raise ConfigError(
                    f"data.path={file} line {lineno} is a JSON {type(row).__name__}, not an object; "
                    f"each line must be one row object"
                )
            rows.append(row)
    return rows


def _read_json(file: Path) -> list[dict]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"data.path={file} line {e.lineno} is not valid JSON ({e.msg}); fix the file"
        ) from e
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise ConfigError(
            f"data.path={file} must hold a JSON list of row objects; use .jsonl for one object per line"
        )
    return data


def _read_hub(path: str, split: str, limit: int | None) -> tuple[list[dict], str]:
    def not_found(reason: str) -> ConfigError:
        return ConfigError(
            f"data.path={path} not found: not a local file or directory ({reason}); "
            f"for a hub dataset install datasets (pip install datasets) and be online"
        )

    if path.lower().endswith(FILE_SUFFIXES) or path.startswith(("/", ".", "~")):
        raise not_found("no such path")
    try:
        import datasets
    except ImportError:
        raise not_found("and the datasets package is not installed") from None
    name, _, config = path.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        rows = [dict(row) for row in ds]
    except Exception as e:  # the hub raises many types: missing repo, offline, bad config or split
        raise not_found(f"load_dataset failed: {_one_line(e)}") from e
    return rows, f"hub {path} split {split}"


# ------------------------------------------------------------------------------------------------ layouts


def _resolve_layout(
    layout: str, first: dict, question_key: str | None, answer_key: str | None, src: str
) -> str:
    columns = ", ".join(first) or "none"
    if layout == "custom" or (layout == "auto" and (question_key or answer_key)):
        if not (question_key and answer_key):
            raise ConfigError(
                f"data.question_key and data.answer_key must both be set for a custom layout "
                f"(got question_key={question_key!r}, answer_key={answer_key!r}; columns: {columns})"
            )
        return "custom"
    if layout != "auto":
        return layout
    if "prompt" in first and "reward_model" in first:
        return "verl"
    if "question" in first and "answer" in first and "####" in str(first["answer"]):
        return "gsm8k"
    if "problem" in first and "solution" in first:
        return "math"
    raise ConfigError(
        f"data.layout=auto cannot recognise {src} (columns: {columns}); "
        f"set data.question_key and data.answer_key to the question and answer columns"
    )


# Per layout: (question column, answer column); question_key / answer_key override them.
_DEFAULT_KEYS = {
    "verl": ("prompt", "reward_model"),
    "gsm8k": ("question", "answer"),
    "math": ("problem", None),
}


def _convert(
    row: dict, index: int, layout: str, question_key: str | None, answer_key: str | None, src: str
) -> Example:
    if layout == "custom":
        qk, ak = question_key, answer_key
    else:
        default_q, default_a = _DEFAULT_KEYS[layout]
        qk = question_key or default_q
        ak = answer_key or default_a
        if layout == "math" and ak is None:
            ak = "answer" if row.get("answer") is not None else "solution"
    where = f"{src} row {index}"
    for key in (qk, ak):
        if key not in row:
            raise ConfigError(
                f"data.layout={layout}: {where} has no column {key!r} (columns: {', '.join(row)}); "
                f"set data.question_key / data.answer_key or data.layout"
            )
    columns = {k: v for k, v in row.items() if k not in (qk, ak)}
    question_value = row[qk]
    question = _question_text(question_value, where, qk)
    if isinstance(question_value, list):
        columns["messages"] = question_value
    answer_value = row[ak]
    if layout == "gsm8k":
        columns["solution"] = answer_value
        answer = _gsm8k_answer(answer_value, where)
    else:
        if layout == "verl" or (layout == "math" and ak == "solution"):
            columns[ak] = answer_value  # keep `solution` / `reward_model` (its `style`) for reward functions
        answer = _answer_text(answer_value, where, ak)
    return Example(question=question, answer=answer, columns=columns)


def _question_text(value: Any, where: str, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        users = [m for m in value if m.get("role") == "user"]
        if users:
            return str(users[-1]["content"])
        raise ConfigError(f"{where}: column {key!r} holds chat messages without a user message; fix the data")
    raise ConfigError(
        f"{where}: column {key!r} is a {type(value).__name__}, not text or a list of chat messages; "
        f"set data.question_key to the question column"
    )


def _answer_text(value: Any, where: str, key: str) -> str:
    if isinstance(value, dict) and "ground_truth" in value:
        value = value["ground_truth"]
    if value is None:
        raise ConfigError(f"{where}: column {key!r} has no reference answer; fix the data or data.answer_key")
    return value if isinstance(value, str) else str(value)


def _gsm8k_answer(value: Any, where: str) -> str:
    text = str(value)
    if "####" not in text:
        raise ConfigError(
            f"data.layout=gsm8k: {where} answer has no '#### <number>' line; "
            f"use data.layout=custom with data.question_key / data.answer_key"
        )
    tail = text.rsplit("####", 1)[1].replace(",", "").replace("$", "").strip()
    match = _NUMBER.search(tail)
    return match.group(0) if match else tail


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------------------------------------- prompting


def format_prompt(
    question: str,
    *,
    suffix: str = "",
    tokenizer=None,
    use_chat_template: bool | str = "auto",
    system_prompt: str | None = None,
    examples: Sequence[tuple[str, str]] = (),
    tools: list[dict] | None = None,
) -> str:
    """The text the policy sees: `question suffix`, rendered with the tokenizer's chat template when asked.

    `use_chat_template`: True (required), False (plain text) or "auto" (when the tokenizer has one).
    Without a chat template a `system_prompt` is put before the text, separated by a blank line.
    `examples`: worked (question, answer) pairs shown before the question, as earlier user and
    assistant turns of the chat (few-shot); as `question\nanswer` paragraphs in plain text.
    `tools`: JSON schemas passed to the chat template as `tools=` (an environment's tools,
    `environment.tools_in_prompt`; `or None`, as TRL: some templates write tool boilerplate for []);
    unused in plain text. A template that fails on them, or writes no tool's name, is a ConfigError.
    """
    text = f"{question} {suffix}" if suffix else question
    if use_chat_template not in (True, False, "auto"):
        raise ConfigError(f"task.chat_template={use_chat_template!r} must be true, false or auto")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template is True and not has_template:
        what = "no tokenizer was given" if tokenizer is None else "the tokenizer has no chat_template"
        raise ConfigError(f"task.chat_template=true but {what}; set task.chat_template=false or auto")
    if use_chat_template is False or not has_template:
        paragraphs = [system_prompt] if system_prompt else []
        paragraphs += [f"{q}\n{a}" for q, a in examples] + [text]
        return "\n\n".join(paragraphs)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for q, a in examples:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": text})
    if not tools:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _render_with_tools(tokenizer, messages, tools)


_NO_TOOLS_FIX = "set environment.tools_in_prompt=false (and describe the tools in task.system_prompt)"


def _render_with_tools(tokenizer, messages: list[dict], tools: list[dict]) -> str:
    """`messages` rendered with `tools=`, or a ConfigError where the template cannot write the tools:
    it raises on them (and not without them), or a tool's name is no more often in the prompt than in
    the messages themselves (the template dropped them: the policy would never read the schemas)."""
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
    except Exception as err:  # noqa: BLE001 - a template may raise anything on tools it cannot write
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # its own error
        raise ConfigError(f"the chat template fails on the environment's tools= ({_one_line(err)}); "
                          f"{_NO_TOOLS_FIX}") from None  # fmt: skip
    said = " ".join(str(m["content"]) for m in messages)
    for schema in tools:
        name = schema.get("function", schema).get("name", "")
        if rendered.count(name) <= said.count(name):
            why = "it ignores tools="
            raise ConfigError(
                f"the chat template wrote no tool {name!r} into the prompt ({why}): {_NO_TOOLS_FIX}"
            )
    return rendered


def filter_by_length(
    texts: list[str], tokenizer, *, max_length: int, on_overflow: str = "filter"
) -> tuple[list[int], int]:
    """Indices of the texts of at most `max_length` tokens, and how many were dropped.

    `on_overflow="error"` raises on the first text that is too long instead of dropping it.
    """
    if on_overflow not in ON_OVERFLOW:
        raise ConfigError(f"task.on_long_prompt={on_overflow!r} is not one of {', '.join(ON_OVERFLOW)}")
    if max_length < 1:
        raise ConfigError(f"rollout.max_prompt_length={max_length} must be >= 1")
    keep = []
    for i, text in enumerate(texts):
        n = len(tokenizer(text, add_special_tokens=False).input_ids)
        if n <= max_length:
            keep.append(i)
        elif on_overflow == "error":
            preview = " ".join(text.split())[:40]
            raise ConfigError(
                f"rollout.max_prompt_length={max_length} is shorter than prompt {i} "
                f"({n} tokens: {preview!r}); "
                f"raise rollout.max_prompt_length or set task.on_long_prompt=filter"
            )
    return keep, len(texts) - len(keep)
