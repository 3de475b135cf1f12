"""`loorl.tasks.data`: dataset files -> Examples, prompt rendering and length filtering (no network)."""

from __future__ import annotations

import builtins
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loorl.errors import ConfigError
from loorl.tasks.data import Example, filter_by_length, format_prompt, load_examples

GSM8K_SUFFIX = 'Let\'s think step by step and output the final answer after "####".'
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _verl_rows(split: str, n: int) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"{split} question {i}? {GSM8K_SUFFIX}"},
            ],
            "ability": "math",
            "reward_model": {"ground_truth": str(10 + i), "style": "rule"},
            "extra_info": {"split": split, "index": i},
        }
        for i in range(n)
    ]


def _write_verl(directory, split: str, n: int) -> None:
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    )
    pq.write_table(pa.Table.from_pylist(_verl_rows(split, n), schema=schema), directory / f"{split}.parquet")


def _write_jsonl(path, rows, blank_lines: bool = False) -> None:
    lines = [json.dumps(r) for r in rows]
    sep = "\n\n  \n" if blank_lines else "\n"
    path.write_text(sep.join(lines) + "\n", encoding="utf-8")


def _assert_one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.fixture
def verl_dir(tmp_path):
    d = tmp_path / "gsm8k"
    d.mkdir()
    _write_verl(d, "train", 3)
    _write_verl(d, "test", 2)
    return d


@pytest.fixture
def no_datasets(monkeypatch):
    """Make `import datasets` fail even where the package happens to be installed."""
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "datasets" or name.startswith("datasets."):
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


def _char_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted({chr(c) for c in range(32, 127)} | {"\n"})
    vocab = {c: i for i, c in enumerate(["<unk>", *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


# ------------------------------------------------------------------------------------------------- verl


def test_verl_parquet_directory_both_splits(verl_dir):
    train = load_examples(str(verl_dir), split="train")
    assert [e.question for e in train] == [f"train question {i}? {GSM8K_SUFFIX}" for i in range(3)]
    assert [e.answer for e in train] == ["10", "11", "12"]
    first = train[0]
    assert isinstance(first, Example)
    assert first.columns["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"train question 0? {GSM8K_SUFFIX}"},
    ]
    assert first.columns["data_source"] == "openai/gsm8k"
    assert first.columns["extra_info"] == {"split": "train", "index": 0}
    assert first.columns["ability"] == "math"
    assert first.columns["reward_model"] == {"ground_truth": "10", "style": "rule"}
    assert "prompt" not in first.columns

    test = load_examples(str(verl_dir), split="test")
    assert [(e.question.split("?")[0], e.answer) for e in test] == [
        ("test question 0", "10"),
        ("test question 1", "11"),
    ]


def test_verl_single_file_and_limit(verl_dir):
    rows = load_examples(str(verl_dir / "train.parquet"), split="ignored-for-files", limit=2)
    assert [e.answer for e in rows] == ["10", "11"]
    assert load_examples(str(verl_dir), split="train", limit=0) == []
    assert len(load_examples(str(verl_dir), split="train", limit=100)) == 3


def test_split_aliases(verl_dir, tmp_path):
    val = load_examples(str(verl_dir), split="validation")
    assert [e.question.split("?")[0] for e in val] == ["test question 0", "test question 1"]
    # only validation exists: asking for test finds it
    d = tmp_path / "only_val"
    d.mkdir()
    _write_verl(d, "validation", 1)
    assert load_examples(str(d), split="test")[0].question.startswith("validation question 0?")
    # two candidates: ambiguous
    _write_verl(d, "val", 1)
    with pytest.raises(ConfigError) as err:
        load_examples(str(d), split="test")
    msg = _assert_one_line(err)
    assert "data.path=" in msg and "val.parquet" in msg and "validation.parquet" in msg
    # training split has no alias
    with pytest.raises(ConfigError) as err:
        load_examples(str(d), split="train")
    msg = _assert_one_line(err)
    assert "without train.parquet" in msg and "val.parquet, validation.parquet" in msg


# ------------------------------------------------------------------------------------------------ gsm8k


def test_gsm8k_jsonl(tmp_path):
    f = tmp_path / "train.jsonl"
    rows = [
        {"question": "How many apples?", "answer": "She has 2 + 70 = <<2+70=72>>72 apples.\n#### 72"},
        {"question": "How much money?", "answer": "It costs $1,000 + $234.\n#### $1,234"},
        {"question": "What is the loss?", "answer": "#### x\n#### -5"},
    ]
    _write_jsonl(f, rows, blank_lines=True)
    ex = load_examples(str(f), split="train")
    assert [e.question for e in ex] == ["How many apples?", "How much money?", "What is the loss?"]
    assert [e.answer for e in ex] == ["72", "1234", "-5"]
    assert ex[1].columns == {"solution": "It costs $1,000 + $234.\n#### $1,234"}
    # the same rows through a directory and an explicit layout
    assert [e.answer for e in load_examples(str(tmp_path), split="train", layout="gsm8k")] == [
        "72",
        "1234",
        "-5",
    ]


def test_gsm8k_bad_line_names_file_and_line(tmp_path):
    f = tmp_path / "train.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"})
    f.write_text(f"{good}\n\n{good}\n{{not json\n{good}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_examples(str(f), split="train")
    msg = _assert_one_line(err)
    assert msg.startswith(f"data.path={f} line 4 is not valid JSON")

    f.write_text(f"{good}\n[1, 2]\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_examples(str(f), split="train")
    assert "line 2 is a JSON list, not an object" in _assert_one_line(err)


def test_gsm8k_layout_without_marker_is_an_error(tmp_path):
    f = tmp_path / "d.jsonl"
    _write_jsonl(f, [{"question": "q", "answer": "#### 3"}, {"question": "q2", "answer": "no marker"}])
    with pytest.raises(ConfigError) as err:
        load_examples(str(f), split="train")
    msg = _assert_one_line(err)
    assert "data.layout=gsm8k" in msg and "row 1" in msg and "####" in msg


# ------------------------------------------------------------------------------------------------- math


def test_math_jsonl_with_and_without_answer(tmp_path):
    solution = "We have $x = 2 \\cdot 3$, so the answer is $\\boxed{6}$."
    with_answer = tmp_path / "with.jsonl"
    _write_jsonl(
        with_answer,
        [
            {
                "problem": "Compute $2 \\cdot 3$.",
                "solution": solution,
                "answer": "6",
                "level": "Level 1",
                "type": "Algebra",
            }
        ],
    )
    (ex,) = load_examples(str(with_answer), split="test")
    assert ex.question == "Compute $2 \\cdot 3$."
    assert ex.answer == "6"
    assert ex.columns == {"solution": solution, "level": "Level 1", "type": "Algebra"}

    without = tmp_path / "without.json"
    without.write_text(
        json.dumps([{"problem": "P?", "solution": solution, "level": "Level 2"}]), encoding="utf-8"
    )
    (ex,) = load_examples(str(without), split="test")
    assert ex.question == "P?"
    assert ex.answer == solution
    assert ex.columns == {"solution": solution, "level": "Level 2"}


# ----------------------------------------------------------------------------------------------- custom


def test_custom_layout_and_keys(tmp_path):
    f = tmp_path / "custom.jsonl"
    _write_jsonl(
        f,
        [{"q": "Capital of France?", "a": "Paris", "difficulty": 1}, {"q": "2+2?", "a": 4, "difficulty": 0}],
    )
    for layout in ("custom", "auto"):
        ex = load_examples(str(f), split="train", layout=layout, question_key="q", answer_key="a")
        assert [(e.question, e.answer) for e in ex] == [("Capital of France?", "Paris"), ("2+2?", "4")]
        assert [e.columns for e in ex] == [{"difficulty": 1}, {"difficulty": 0}]

    with pytest.raises(ConfigError) as err:
        load_examples(str(f), split="train", layout="custom", question_key="q")
    msg = _assert_one_line(err)
    assert "data.question_key and data.answer_key must both be set" in msg and "answer_key=None" in msg

    with pytest.raises(ConfigError) as err:
        load_examples(str(f), split="train", question_key="q", answer_key="answer")
    msg = _assert_one_line(err)
    assert "no column 'answer'" in msg and "columns: q, a, difficulty" in msg


def test_auto_detection_failure_lists_columns(tmp_path):
    f = tmp_path / "custom.jsonl"
    _write_jsonl(f, [{"q": "x", "a": "y", "difficulty": 1}])
    with pytest.raises(ConfigError) as err:
        load_examples(str(f), split="train")
    msg = _assert_one_line(err)
    assert msg == (
        f"data.layout=auto cannot recognise {f} (columns: q, a, difficulty); "
        "set data.question_key and data.answer_key to the question and answer columns"
    )
    # question + answer without '####' is not GSM8K
    _write_jsonl(f, [{"question": "x", "answer": "y"}])
    with pytest.raises(ConfigError, match=r"columns: question, answer\)"):
        load_examples(str(f), split="train")
    with pytest.raises(
        ConfigError, match=r"^data.layout='chat' is not one of auto, verl, gsm8k, math, custom$"
    ):
        load_examples(str(f), split="train", layout="chat")


# ------------------------------------------------------------------------------------------ missing data


def test_missing_path_without_datasets(tmp_path, no_datasets):
    with pytest.raises(ConfigError) as err:
        load_examples("openai/gsm8k:main", split="train")
    msg = _assert_one_line(err)
    assert msg == (
        "data.path=openai/gsm8k:main not found: not a local file or directory (and the datasets package is "
        "not installed); for a hub dataset install datasets (pip install datasets) and be online"
    )
    missing = tmp_path / "nope" / "train.parquet"
    with pytest.raises(ConfigError) as err:
        load_examples(str(missing), split="train")
    msg = _assert_one_line(err)
    assert msg.startswith(f"data.path={missing} not found: not a local file or directory (no such path)")


def test_unsupported_and_empty_files(tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_text("question,answer\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"unsupported suffix '\.csv'; use a \.parquet, \.jsonl or \.json"):
        load_examples(str(csv), split="train")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"split='train' has no rows"):
        load_examples(str(empty), split="train")
    with pytest.raises(ConfigError, match=r"^data.limit=-1 must be >= 0"):
        load_examples(str(empty), split="train", limit=-1)


# ------------------------------------------------------------------------------------------ format_prompt


def test_format_prompt_plain():
    assert format_prompt("What is 2+2?") == "What is 2+2?"
    assert format_prompt("What is 2+2?", suffix=GSM8K_SUFFIX) == f"What is 2+2? {GSM8K_SUFFIX}"
    assert format_prompt("Q", suffix="S", system_prompt="Sys") == "Sys\n\nQ S"
    # auto with a tokenizer that has no template: plain text
    tok = _char_tokenizer(None)
    assert format_prompt("Q", suffix="S", tokenizer=tok) == "Q S"
    tok_t = _char_tokenizer(TEMPLATE)
    assert format_prompt("Q", suffix="S", tokenizer=tok_t, use_chat_template=False) == "Q S"


def test_format_prompt_chat_template():
    tok = _char_tokenizer(TEMPLATE)
    assert (
        format_prompt("What is 2+2?", suffix="Think.", tokenizer=tok)
        == "<|user|>What is 2+2? Think.\n<|assistant|>"
    )
    assert (
        format_prompt("Q", tokenizer=tok, use_chat_template=True, system_prompt="Be terse.")
        == "<|system|>Be terse.\n<|user|>Q\n<|assistant|>"
    )


def test_format_prompt_worked_examples_come_before_the_question():
    shots = [("1+1?", "2"), ("2+3?", "5")]
    chat = format_prompt("Q", tokenizer=_char_tokenizer(TEMPLATE), system_prompt="Sys", examples=shots)
    shown = "<|system|>Sys\n<|user|>1+1?\n<|assistant|>2\n<|user|>2+3?\n<|assistant|>5\n"
    assert chat == shown + "<|user|>Q\n<|assistant|>"
    assert format_prompt("Q", system_prompt="Sys", examples=shots) == "Sys\n\n1+1?\n2\n\n2+3?\n5\n\nQ"
    assert format_prompt("Q", examples=()) == "Q"


def test_format_prompt_template_required():
    with pytest.raises(ConfigError) as err:
        format_prompt("Q", tokenizer=_char_tokenizer(None), use_chat_template=True)
    msg = _assert_one_line(err)
    assert (
        msg == "task.chat_template=true but the tokenizer has no chat_template; "
        "set task.chat_template=false or auto"
    )
    with pytest.raises(ConfigError, match=r"^task.chat_template=true but no tokenizer was given"):
        format_prompt("Q", use_chat_template=True)
    with pytest.raises(ConfigError, match=r"^task.chat_template='yes' must be true, false or auto$"):
        format_prompt("Q", use_chat_template="yes")


# --------------------------------------------------------------------------------------- filter_by_length


def test_filter_by_length_counts():
    tok = _char_tokenizer(None)
    assert tok("abc", add_special_tokens=False).input_ids == [tok.convert_tokens_to_ids(c) for c in "abc"]
    texts = ["abcd", "ab", "abcdefgh", "abcde", ""]
    assert filter_by_length(texts, tok, max_length=4) == ([0, 1, 4], 2)
    assert filter_by_length(texts, tok, max_length=5) == ([0, 1, 3, 4], 1)
    assert filter_by_length(texts, tok, max_length=100, on_overflow="error") == ([0, 1, 2, 3, 4], 0)
    assert filter_by_length([], tok, max_length=1) == ([], 0)


def test_filter_by_length_error_and_unknown_mode():
    tok = _char_tokenizer(None)
    with pytest.raises(ConfigError) as err:
        filter_by_length(["ab", "abcdefgh", "abcdefghij"], tok, max_length=4, on_overflow="error")
    msg = _assert_one_line(err)
    assert msg == (
        "rollout.max_prompt_length=4 is shorter than prompt 1 (8 tokens: 'abcdefgh'); "
        "raise rollout.max_prompt_length or set task.on_long_prompt=filter"
    )
    with pytest.raises(ConfigError) as err:
        filter_by_length(["ab"], tok, max_length=4, on_overflow="truncate")
    assert _assert_one_line(err) == "task.on_long_prompt='truncate' is not one of filter, error"
    with pytest.raises(ConfigError, match=r"^rollout.max_prompt_length=0 must be >= 1$"):
        filter_by_length(["ab"], tok, max_length=0)


def test_hub_path_through_a_stand_in_datasets_module(monkeypatch):
    import sys
    import types

    calls = []

    class FakeDataset(list):
        def select(self, indices):
            return FakeDataset(self[i] for i in indices)

    def load_dataset(name, config=None, *, split):
        calls.append((name, config, split))
        if name == "missing/set":
            raise FileNotFoundError("Dataset 'missing/set' doesn't exist\non the Hub")
        return FakeDataset({"question": f"q{i}", "answer": f"work\n#### {i},000"} for i in range(5))

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    ex = load_examples("openai/gsm8k:main", split="test", limit=2)
    assert [(e.question, e.answer) for e in ex] == [("q0", "0000"), ("q1", "1000")]
    assert calls == [("openai/gsm8k", "main", "test")]
    with pytest.raises(ConfigError) as err:
        load_examples("missing/set", split="train")
    assert _assert_one_line(err) == (
        "data.path=missing/set not found: not a local file or directory (load_dataset failed: "
        "FileNotFoundError: Dataset 'missing/set' doesn't exist on the Hub); "
        "for a hub dataset install datasets (pip install datasets) and be online"
    )
    assert calls[-1] == ("missing/set", None, "train")
