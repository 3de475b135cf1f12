"""task=mix: several sources in one run, rewards dispatched by source, metrics per source."""

from __future__ import annotations

import json

import pytest
from hydra.utils import instantiate

from fixtures import write_gsm8k, write_math
from loorl.build import instantiate_unwrapped
from loorl.cli.train import train
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.tasks.mixed import MixedTask, quotas

QUICK = [
    "debug=quick",
    "rollout=hf",  # as tests/conftest.py's quick profile: not vLLM on a GPU node that has it
    "rollout.max_new_tokens=16",
    "val_pass_k=0",
    "model.tiny.warm_start.max_steps=20",
    "rl.steps=2",
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return write_gsm8k(root / "gsm8k"), write_math(root / "math")


def mix_overrides(gsm8k, math, *extra):
    return ["experiment=mix_gsm8k_math", f"data.sources.gsm8k.path={gsm8k}", f"data.sources.math.path={math}",
            *extra]  # fmt: skip


def test_quotas_by_hand():
    assert quotas(10, [1, 1]) == [5, 5]
    assert quotas(7, [2, 1]) == [5, 2]  # 4.67 and 2.33: the larger remainder gets the spare
    assert quotas(8, [1, 1, 1]) == [3, 3, 2]
    assert all(sum(quotas(n, [0.2, 0.5, 0.3])) == n for n in range(1, 40))


def test_prompts_carry_their_source_and_the_split_follows_the_weights(make_config, sources):
    task = instantiate(make_config(*mix_overrides(*sources, "data.sources.gsm8k.weight=3")).task)
    step = task.prompts_for_step(0, 8, seed=0)
    assert [p.meta["source"] for p in step].count("gsm8k") == 6  # 3:1 of 8
    assert step == task.prompts_for_step(0, 8, seed=0)  # a pure function of (seed, step)
    assert task.prompts_for_step(1, 8, seed=0) != step
    held_out = task.eval_prompts()
    assert [p.meta["source"] for p in held_out] == ["gsm8k"] * 16 + ["math"] * 8  # every source's split


def test_rewards_dispatch_by_source(make_config, sources):
    task = instantiate(make_config(*mix_overrides(*sources)).task)
    held_out = task.eval_prompts()
    g, m = held_out[0], held_out[-1]
    g_answer, m_answer = g.answer.split("####")[-1].strip(), "\\boxed{" + m.answer.split("boxed{")[1]
    assert task.grade(g, f"so #### {g_answer}") == (1.0, True)
    assert task.grade(m, f"thus {m_answer}") == (1.0, True)
    assert task.grade(g, f"thus \\boxed{{{g_answer}}}")[1] is False  # GSM8K's verifier wants ####
    rewards, correct, _ = task.grade_many([m, g], [f"thus {m_answer}", f"#### {g_answer}"])
    assert rewards == [1.0, 1.0] and correct == [True, True]


@pytest.mark.parametrize(
    ("override", "message"),
    [("data.sources.math.verifier=code", "data.sources.math.verifier='code' is not one of"),
     ("data.sources.math.weight=0", "data.sources.math.weight=0 must be positive"),
     ("+data.sources.math.wieght=2", "data.sources.math.wieght is not a source setting")],
)  # fmt: skip
def test_bad_sources_are_one_line(make_config, sources, override, message):
    with pytest.raises(ConfigError, match=message):
        instantiate_unwrapped(make_config(*mix_overrides(*sources), override).task)


def test_a_source_without_a_path_is_refused_before_any_model(make_config, sources):
    with pytest.raises(ConfigError, match="data.sources.math.path is not set"):
        check_config(make_config("experiment=mix_gsm8k_math", f"data.sources.gsm8k.path={sources[0]}"))
    with pytest.raises(ConfigError, match="data.sources is empty"):
        MixedTask(sources={})


def test_a_mixed_run_reports_every_source(make_config, sources, model_cache, tmp_path):
    out = tmp_path / "run"
    summary = train(
        make_config(*QUICK, f"model.cache_dir={model_cache}", *mix_overrides(*sources), output_dir=out)
    )
    history = json.loads((out / "metrics.json").read_text())["history"]
    for key in ("rollout/reward/gsm8k", "rollout/reward/math", "val/accuracy/gsm8k", "val/accuracy/math"):
        assert len(history[key]) >= 2, key
    # the overall held-out accuracy is the prompt-weighted mean of the sources' (16 GSM8K, 8 MATH)
    for (step, total), (_, g), (_, m) in zip(history["val/accuracy"], history["val/accuracy/gsm8k"],
                                             history["val/accuracy/math"]):  # fmt: skip
        assert total == pytest.approx((16 * g + 8 * m) / 24, abs=1e-6), step
    text = (out / "summary.md").read_text()
    assert "| gsm8k: held-out accuracy; reward (first -> last steps) |" in text and "| math: held-out" in text
    assert summary["rl_steps"] == 2
