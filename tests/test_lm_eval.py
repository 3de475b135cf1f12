"""`src/eval.py ... lm_eval.tasks=[...]` (loorl.cli.lm_harness): lm-eval on the tiny model over the example
tasks' local jsonl (examples/lm_eval), checked against loorl's own greedy evaluation of the same problems
and against log-probabilities computed here; lm-eval absent: nothing imports it, and asking for it is
one line naming the install command; bad settings are one line."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import needs
from loorl.cli.evaluate import evaluate
from loorl.cli.lm_harness import HarnessSettings
from loorl.config import check_config, compose_config
from loorl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "lm_eval"
TASKS = "lm_eval.tasks=[loorl_arithmetic,loorl_arithmetic_mc]"
needs_lm_eval = needs("lm_eval", what="lm-eval (.[lm-eval], part of .[test])")


def eval_config(model_cache, out, *overrides):
    quick = [
        "debug=quick",
        "rollout=hf",
        f"model.cache_dir={model_cache}",
        "trainer.enable_progress_bar=false",
    ]
    return compose_config(f"output_dir={out}", *quick, *overrides, config_name="eval")


@pytest.fixture(scope="module")
def tiny_policy(model_cache, tmp_path_factory) -> Path:
    """The quick profile's tiny model folder (a warm start only, about 20% on the held-out sums): a plain
    Hugging Face folder, as any local model is."""
    from loorl.build import build_task
    from loorl.models.sources import resolve_model_path

    s = check_config(eval_config(model_cache, tmp_path_factory.mktemp("build"), "policy=unused"))
    return Path(resolve_model_path(s.model, s.task, build_task(s)))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_example_jsonl_is_the_arithmetic_tasks_held_out_set():
    from loorl.tasks.arithmetic import ArithmeticTask

    rows = read_jsonl(EXAMPLES / "arithmetic.jsonl")
    assert [(r["question"], r["answer"]) for r in rows] == [
        (p.text, p.answer) for p in ArithmeticTask().eval_prompts()
    ]
    for r in rows:  # four different sums, the right one at `label`
        assert len(set(r["choices"])) == 4 and r["choices"][r["label"]] == r["answer"]


def test_the_config_composes_with_lm_eval_off_by_default(model_cache, tmp_path):
    default = HarnessSettings.from_cfg(eval_config(model_cache, tmp_path, "policy=x").lm_eval, "lm_eval")
    assert default.tasks == [] and default.loorl is True
    cfg = eval_config(model_cache, tmp_path, "policy=x", TASKS, f"lm_eval.include_path={EXAMPLES}",
                      "lm_eval.limit=5", "lm_eval.loorl=false")  # fmt: skip
    s = HarnessSettings.from_cfg(cfg.lm_eval, "lm_eval")
    assert s.tasks == ["loorl_arithmetic", "loorl_arithmetic_mc"] and s.limit == 5 and not s.loorl


def continuation_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """The summed log-probability of `continuation` after `context` (no special tokens), by hand."""
    ids = tokenizer(context + continuation, add_special_tokens=False, return_tensors="pt").input_ids
    n = len(tokenizer(continuation, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
    return float(logprobs[-n:].gather(-1, ids[0, -n:, None]).sum())


@needs_lm_eval
def test_lm_eval_on_the_tiny_model_agrees_with_loorl_and_by_hand(
    tiny_policy, model_cache, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(tmp_path)  # the YAMLs' relative data_files resolve against their folder, not here
    out = tmp_path / "out"
    cfg = eval_config(model_cache, out, f"policy={tiny_policy}", "eval.samples=0", TASKS,
                      f"lm_eval.include_path={EXAMPLES}")  # fmt: skip
    results = evaluate(cfg)
    harness = results["lm_eval"]["results"]
    # generation: lm-eval's exact match is loorl's greedy pass@1 on the same 200 problems, problem by problem
    exact = harness["loorl_arithmetic"]["exact_match,none"]
    assert exact == pytest.approx(results["metrics"]["pass@1_greedy"], abs=1e-6)  # float32
    assert 0.05 < exact < 0.95  # a number that can disagree (the quick model: 21.5%)
    generated = read_jsonl(out / "lm_eval_samples_loorl_arithmetic.jsonl")
    assert len(generated) == 200
    right = {r["doc"]["question"] for r in generated if r["filtered_resps"][0] == r["target"]}
    assert len(right) / 200 == pytest.approx(exact)
    with (out / "samples.csv").open(newline="") as f:
        assert {r["prompt"] for r in csv.DictReader(f) if r["correct"] == "1"} == right
    # multiple choice: acc is the argmax of the continuations' log-probabilities, recomputed here
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    chosen = read_jsonl(out / "lm_eval_samples_loorl_arithmetic_mc.jsonl")
    hits = []
    for r in chosen:
        mine = [continuation_logprob(model, tokenizer, r["doc"]["question"], c) for c in r["doc"]["choices"]]
        assert [ll for ll, _ in r["filtered_resps"]] == pytest.approx(mine, abs=1e-4)
        hits.append(max(range(4), key=mine.__getitem__) == r["doc"]["label"])
    assert harness["loorl_arithmetic_mc"]["acc,none"] == pytest.approx(sum(hits) / len(hits))
    # the files: lm-eval's results json beside loorl's, both tables in results.md
    written = json.loads((out / "lm_eval_results.json").read_text())
    assert written["results"]["loorl_arithmetic"]["exact_match,none"] == exact
    assert json.loads((out / "results.json").read_text())["metrics"] == results["metrics"]
    table = (out / "results.md").read_text()
    assert table.startswith("## Evaluation:") and "| greedy pass@1 |" in table
    assert "## lm-eval:" in table and "|loorl_arithmetic   |" in table and "exact_match" in table


@needs_lm_eval
def test_lm_eval_only_with_a_limit(tiny_policy, model_cache, tmp_path):
    cfg = eval_config(model_cache, tmp_path, f"policy={tiny_policy}", "lm_eval.tasks=[loorl_arithmetic]",
                      f"lm_eval.include_path={EXAMPLES}", "lm_eval.loorl=false", "lm_eval.limit=10",
                      "lm_eval.log_samples=false")  # fmt: skip
    results = evaluate(cfg)
    assert set(results) == {"lm_eval"}  # loorl's own evaluation did not run
    assert not (tmp_path / "results.json").exists() and not list(tmp_path.glob("lm_eval_samples_*"))
    written = json.loads((tmp_path / "lm_eval_results.json").read_text())
    assert written["n-samples"]["loorl_arithmetic"]["effective"] == 10
    assert (tmp_path / "results.md").read_text().startswith("## lm-eval:")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lm_eval.include_path=/no/such", "lm_eval.tasks=[a]"], "include_path=/no/such is not a folder"),
        ([f"lm_eval.include_path={EXAMPLES}"], "lm_eval.include_path=.* is set but lm_eval.tasks is empty"),
        (["lm_eval.loorl=false"], "lm_eval.loorl=false leaves nothing to evaluate"),
        (["lm_eval.tasks=[a]", "lm_eval.batch_size=0"], "lm_eval.batch_size"),
    ],
)  # fmt: skip
def test_bad_lm_eval_settings_are_one_line(model_cache, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        evaluate(eval_config(model_cache, tmp_path, "policy=/no/such/policy", *overrides))
    assert "\n" not in str(err.value)


@needs_lm_eval
def test_an_unknown_task_name_is_one_line_before_the_model_loads(model_cache, tmp_path):
    tasks = "lm_eval.tasks=[loorl_arithmetic,nope]"
    cfg = eval_config(
        model_cache, tmp_path / "out", f"policy={tmp_path}", tasks, f"lm_eval.include_path={EXAMPLES}"
    )
    with pytest.raises(ConfigError, match="is a folder without config.json"):  # the policy is checked first
        evaluate(cfg)
    (tmp_path / "config.json").write_text("{}")  # a policy folder that would fail to load as a model
    with pytest.raises(ConfigError, match=r"lm_eval.tasks: no task, group or tag named 'nope' in lm_eval"):
        evaluate(cfg)


ABSENT = """
import sys
sys.modules["lm_eval"] = None  # as if not installed: `import lm_eval` raises ImportError
from loorl.cli.console import run_cli
from loorl.cli.evaluate import evaluate
from loorl.config import compose_config
base = ["debug=quick", "rollout=hf", "trainer.enable_progress_bar=false", "eval.samples=0"]
results = evaluate(compose_config(f"output_dir={sys.argv[2]}", f"policy={sys.argv[1]}", *base,
                                  config_name="eval"))
imported = [m for m, module in sys.modules.items() if m.split(".")[0] == "lm_eval" and module is not None]
print("loorl-only", results["metrics"]["pass@1_greedy"], imported)
cfg = compose_config(f"output_dir={sys.argv[2]}", "policy=/no/such/policy", "lm_eval.tasks=[x]", *base,
                     config_name="eval")
run_cli(evaluate, cfg)
"""


def test_without_lm_eval_nothing_imports_it_and_asking_is_one_line(tiny_policy, tmp_path):
    done = subprocess.run([sys.executable, "-c", ABSENT, str(tiny_policy), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ,
                          "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert any(line.startswith("loorl-only 0.") and line.endswith(" []") for line in lines), lines
    # checked before the policy path: nothing was loaded
    assert (
        lines[-1] == 'error: lm_eval.tasks needs lm-eval, which is not installed: pip install -e ".[lm-eval]"'
    )
