"""Bad input fails in one clear line that names the setting, before any model is built or loaded."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import DictConfig

from fixtures import child_env
from loorl.cli.train import train
from loorl.config import CONF_DIR
from loorl.errors import ConfigError

REPO = CONF_DIR.parent
QWEN = "Qwen/Qwen2.5-7B-Instruct"


@pytest.fixture
def bad_cfg(make_config, tmp_path):
    """The default config with `overrides`, its model cache and output in `tmp_path` (to check
    that nothing was written there)."""
    return lambda *overrides: make_config(
        f"model.cache_dir={tmp_path / 'cache'}", *overrides, output_dir=tmp_path / "out"
    )


def train_fails(tmp_path: Path, cfg: DictConfig) -> str:
    """Run train() on a bad config; return the one-line message after checking nothing was built."""
    with pytest.raises(ConfigError) as err:
        train(cfg)
    msg = str(err.value)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    assert not (tmp_path / "cache").exists(), "a model was built before the config was checked"
    assert not (tmp_path / "out").exists(), "the run folder was written before the config was checked"
    return msg


# (overrides, the setting the message must name, further words the message must contain)
CASES = [
    (["estimator.name=foo"], "estimator.name", ["foo", "rloo", "grpo"]),
    (["estimator=rloo", "rl.samples_per_prompt=1"], "rl.samples_per_prompt", ["rloo", "2"]),
    (["estimator=grpo", "rl.samples_per_prompt=1"], "rl.samples_per_prompt", ["grpo", "2"]),
    (["estimator=w_reinforce", "+estimator.options.lam=0.5"], "estimator.options.lam", ["positive_weight"]),
    (["rl.samples_per_prompt=0"], "rl.samples_per_prompt", []),
    (
        ["rl.prompts_per_step=30", "rl.prompts_per_minibatch=8"],
        "rl.prompts_per_step",
        ["prompts_per_minibatch"],
    ),
    (["rl.steps=0"], "rl.steps", []),
    (  # a renamed key names its new spelling (it always held GiB)
        ["rollout=vllm", "+rollout.vllm.kv_cache_memory_gb=2"],
        "rollout.vllm.kv_cache_memory_gb",
        ["is now called", "rollout.vllm.kv_cache_memory_gib=2"],
    ),
    (
        ["rollout=vllm_server", "+rollout.server.kv_cache_memory_gb=2"],
        "rollout.server.kv_cache_memory_gb",
        ["rollout.server.kv_cache_memory_gib=2"],
    ),
    (["rl.dynamic_sampling.max_rounds=0"], "rl.dynamic_sampling.max_rounds", ["1 or more"]),
    (["reward.overlong.buffer=1000"], "reward.overlong.buffer", ["rollout.max_new_tokens"]),
    (  # with tools, the limit is a sample's budget over its turns
        ["tools=calculator", "tools.max_turns=1", "tools.max_tokens=64", "reward.overlong.buffer=65"],
        "reward.overlong.buffer",
        ["tools.max_tokens=64", "reward.overlong.buffer=64"],
    ),
    (["loss.is_mode=token_mask", "loss.is_low=2", "loss.is_high=2"], "loss.is_low", ["is_high"]),
    (["loss.is_mode=sequence_mask", "loss.tis_cap=2"], "loss.is_mode", ["loss.tis_cap=null"]),
    (["loss.is_mode=bogus"], "loss.is_mode", ["bogus", "token_mask", "sequence_mask"]),
    (["rl.epochs_per_rollout=0"], "rl.epochs_per_rollout", []),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens", []),
    (["rollout.max_new_tokens=-3"], "rollout.max_new_tokens", ["-3"]),
    (["rollout.temperature=0"], "rollout.temperature", []),
    (["rollout.top_p=1.5"], "rollout.top_p", ["1.5"]),
    (["rollout.top_k=-1"], "rollout.top_k", []),
    (["rollout.truncated=bogus"], "rollout.truncated", ["bogus", "score", "zero", "mask"]),
    (["loss.agg=bogus"], "loss.agg", ["bogus", "token-mean"]),
    (["loss.ratio_level=bogus"], "loss.ratio_level", ["token", "sequence"]),
    (["loss.ratio_level=sequence"], "loss.ratio_level=sequence", ["seq-mean-token-mean", "experiment=gspo"]),
    (["estimator=dr_grpo", "rl.samples_per_prompt=1"], "rl.samples_per_prompt=1", ["K >= 2"]),
    (["estimator=reinforce_pp_baseline", "rl.samples_per_prompt=1"], "rl.samples_per_prompt", ["K >= 2"]),
    (["model.master_dtype=bfloat16"], "model.master_dtype=bfloat16", ["model.master_dtype=float32"]),
    (["loss.clip_low=-0.1"], "loss.clip_low", []),
    (["kl.estimator=k9"], "kl.estimator", ["k9", "k3"]),
    (["kl.estimator=abs"], "kl.estimator", ["abs", "k1", "k2", "k3"]),
    (["kl.coef=0.1", "kl.estimator=abs"], "kl.estimator", ["abs", "k1", "k2", "k3"]),
    (
        ["kl.coef=0.1", "kl.in_reward=false", "kl.estimator=k1"],
        "kl.estimator=k1",
        ["kl.in_reward=false", "gradient 0", "kl.estimator=k2", "kl.estimator=k3"],
    ),
    (
        ["kl.coef=0.1", "kl.estimator=k3"],
        "kl.estimator=k3",
        ["kl.in_reward=true", "kl.estimator=k1", "KL(ref||pi)"],
    ),
    (
        ["kl.coef=0.1", "kl.adaptive=true", "kl.estimator=k2"],
        "kl.estimator=k2",
        ["kl.in_reward=true", "kl.estimator=k1"],
    ),
    (["kl.coef=-1"], "kl.coef", ["-1"]),
    (["kl.adaptive=true", "kl.coef=0"], "kl.coef", ["kl.adaptive"]),
    (["model.dtype=float8"], "model.dtype", ["float8", "bfloat16"]),
    (["model.name_or_path=/nonexistent/model"], "model.name_or_path", ["/nonexistent/model"]),
    # 5 divides no recipe's prompts per step (a case that passed would launch real processes here)
    (["strategy=ddp", "trainer.devices=5"], "rl.prompts_per_step", ["multiple of 5"]),
    (["trainer.devices=2"], "strategy=auto", ["strategy=ddp", "strategy=fsdp"]),
    (["trainer.strategy=deepspeed"], "trainer.strategy=deepspeed", ["strategy=ddp", "strategy=fsdp"]),
    (["rollout.engine=sglang"], "rollout.engine", ["sglang", "hf", "vllm", "auto"]),
    (["seed=abc"], "seed", ["abc", "integer"]),
    (["optimizer.lr=-1"], "optimizer", ["-1", "learning rate"]),
    (["rl.steps=2.5"], "rl.steps", ["2.5", "integer"]),
    (["+kl.coeff=0.1"], "kl.coeff", ["not a setting"]),
    (["model.recipe.lr=0"], "model.recipe.lr", ["greater than 0"]),
    (["model.tiny=null"], "model.tiny", ["model.name_or_path"]),
    # LoRA (model.lora): checked from the settings and the model's config alone, before any weights load
    (["model.lora={r: 0}"], "model.lora.r", ["greater than 0"]),
    (["model.lora={dropout: 1.0}"], "model.lora.dropout", ["less than 1"]),
    (
        ["model.lora={}", "model.dtype=bfloat16", "model.master_dtype=bfloat16"],
        "model.master_dtype=bfloat16",
        ["model.lora", "model.master_dtype=float32"],
    ),
    (
        ["model.lora={base_dtype: bfloat16}"],
        "model.lora.base_dtype=bfloat16",
        ["float32", "model.dtype=bfloat16"],
    ),
    (["model.lora={}", "model.ref_offload=true"], "model.ref_offload=true", ["model.ref_offload=false"]),
    (["model.lora={target_modules: []}"], "model.lora.target_modules", ["q_proj"]),
    (
        ["model.lora={target_modules: [q_proj, qkv, mlp]}"],
        "model.lora.target_modules",
        ["Qwen2ForCausalLM", "qkv, mlp", "down_proj"],
    ),
    (
        ["model.lora={target_modules: [q_proj, lm_head]}", "model.tiny.tie_embeddings=true"],
        "model.lora.target_modules",
        ["lm_head", "ties", "leave it out"],
    ),
    # tools (tools.*): the tool set, the budget, the tags and the engine, before any model loads
    (["tools=calculator", "tools.max_turns=-1"], "tools.max_turns", ["-1", "greater than or equal to 0"]),
    (["tools=calculator", "tools.max_tokens=3"], "tools.max_tokens=3", ["less than one turn", "set tools"]),
    (
        ["tools=calculator", "tools.available.calculator._target_=mypkg.Abacus"],
        "tools.available.calculator._target_=mypkg.Abacus",
        ["cannot be imported"],
    ),
    (["tools=calculator", "tools.available.calculator.end=''"], "tools.available.calculator", ["start and"]),
    (["tools=calculator", "tools.result_format=x"], "tools.result_format", ["{result}"]),
    (["tools=none", "tools.max_turns=2"], "tools.max_turns > 0", ["tools.available"]),
    (["tools=calculator", "tools.insert=chat"], "tools.insert", ["chat", "template"]),
    (
        ["tools=calculator", "rollout._target_=plugins.engines.GenerateEngine"],
        "tools.max_turns > 0",
        ["stops_on_sequences", "rollout=hf", "rollout=vllm", "tools.max_turns=0"],
    ),
    (
        [
            "tools=calculator",
            "+tools.available.abacus={_target_: loorl.tools.Calculator, start: a, end: 'c>'}",
        ],
        "tools.available.abacus.end='c>'",
        ["ends like tools.available.calculator.end"],
    ),
    # what ReMax's and GDPO's inputs rule out (loorl.estimator_inputs)
    (
        ["estimator=remax", "rollout.max_staleness=1"],
        "estimator=remax",
        ["greedy", "rollout.max_staleness=0"],
    ),
    (["estimator=gdpo"], "estimator=gdpo", ["has one (correct)", "reward=custom", "estimator=grpo"]),
    (["estimator=gdpo", "reward=custom"], "reward.clip=[-1.0, 1.0]", ["reward.clip=null"]),
    (
        ["estimator=gdpo", "reward=custom", "reward.clip=null", "kl.coef=0.01"],
        "kl.in_reward=true",
        ["estimator=gdpo", "kl.in_reward=false"],
    ),
    (
        [
            "estimator=gdpo",
            "reward=custom",
            "reward.clip=null",
            "tools.max_turns=1",
            "environment._target_=plugins.environments.Counter",
        ],  # fmt: skip
        "estimator=gdpo",
        ["get_reward()", "estimator=grpo"],
    ),
]


@pytest.mark.parametrize(("overrides", "setting", "words"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_setting_fails_in_one_line(tmp_path, bad_cfg, overrides, setting, words):
    msg = train_fails(tmp_path, bad_cfg(*overrides))
    assert setting in msg
    for word in words:
        assert word in msg


def test_lora_without_peft_fails_in_one_line(tmp_path, bad_cfg, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a)
    )
    msg = train_fails(tmp_path, bad_cfg("model.lora={r: 8}"))
    assert "model.lora" in msg and 'pip install -e ".[lora]"' in msg


def test_hub_model_offline_fails_fast_with_the_fix(tmp_path, bad_cfg, monkeypatch):
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(QWEN, "config.json"), str):
        pytest.skip(f"{QWEN} is in the local Hugging Face cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    msg = train_fails(tmp_path, bad_cfg("model=qwen7b"))
    assert time.perf_counter() - t0 < 5
    assert "model.name_or_path" in msg and QWEN in msg
    assert "download" in msg  # how to get it
    assert "model.name_or_path=/path" in msg  # or where to point instead


# ---- the command line -------------------------------------------------------------------------


def run_cli(tmp_path: Path, *args: str) -> tuple[int, str]:
    """`python src/train.py args`; leading `-X ...` pairs are the interpreter's flags."""
    python_flags = []
    while args[:1] == ("-X",):
        python_flags, args = [*python_flags, *args[:2]], args[2:]
    env = child_env(LOORL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, *python_flags, "src/train.py", *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,  # a hang guard: the start-up (torch, Lightning) is slow on a busy node (pytest -n 14)
    )
    return proc.returncode, proc.stdout


def error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert "Traceback" not in output, output
    return errors[0]


# The CLI's own tests run one command of each kind: every setting's message is CASES' (in this process);
# what the command line adds (exit code 2, one `error:` line, no traceback, nothing written) is the same
# `run_cli` for all of them.
@pytest.mark.parametrize(
    ("arg", "group", "listed"),
    [
        ("estimator=foo", "estimator", ["rloo", "grpo", "dr_grpo"]),
        ("task=nope", "task", ["arithmetic"]),
        ("model=nope", "model", ["tiny", "qwen7b"]),
    ],
)
def test_an_unknown_group_option_names_the_options(arg, group, listed):
    from loorl.config import check_group_choices

    with pytest.raises(ConfigError) as err:
        check_group_choices([arg])
    line = str(err.value)
    assert "\n" not in line and group in line and arg.split("=")[1] in line
    for option in listed:
        assert option in line


def test_cli_unknown_group_option(tmp_path):
    code, out = run_cli(tmp_path, "estimator=foo")
    assert code == 2, out
    assert "rloo" in error_line(out)
    assert not (tmp_path / "cache").exists()
    assert not (tmp_path / "run").exists()  # Hydra never started


def test_cli_kl_term_without_a_kl_gradient(tmp_path):
    code, out = run_cli(tmp_path, "kl.coef=0.1", "kl.in_reward=false", "kl.estimator=k1")
    assert code == 2, out
    line = error_line(out)
    assert "kl.estimator=k2" in line and "kl.estimator=k3" in line
    assert not (tmp_path / "cache").exists()


def test_kl_off_accepts_any_estimator_placement(bad_cfg):
    from loorl.config import check_config

    check_config(bad_cfg("kl.coef=0", "kl.in_reward=false", "kl.estimator=k1"))


def test_gspo_experiment_pairs_the_sequence_ratio_with_its_aggregation(bad_cfg):
    from loorl.config import check_config

    cfg = bad_cfg("experiment=gspo")
    assert (cfg.loss.ratio_level, cfg.loss.agg, cfg.estimator.name) == (
        "sequence",
        "seq-mean-token-mean",
        "grpo",
    )
    assert cfg.rl.prompts_per_step // cfg.rl.prompts_per_minibatch > 1  # off-policy steps: the ratio matters
    check_config(cfg)


def test_cli_bad_type_is_one_error_line(tmp_path):
    """`python src/train.py seed=abc`: exit 2 and one `error:` line, no traceback."""
    code, out = run_cli(tmp_path, "seed=abc")
    assert code == 2, out
    line = error_line(out)
    assert "seed" in line and "abc" in line
    assert not (tmp_path / "cache").exists()


def test_a_bad_setting_is_reported_before_lightning_and_transformers_load(tmp_path):
    """The settings are checked before the run's heavy libraries are imported: the error comes in about
    4 s, not 11 (`-X importtime` lists every module the command imported)."""
    code, out = run_cli(tmp_path, "-X", "importtime", "rl.samples_per_prompt=1")
    assert code == 2 and "rl.samples_per_prompt" in error_line(out), out[-2000:]
    assert not (tmp_path / "cache").exists()
    lines = [line for line in out.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[1].strip() for line in lines}
    assert "loorl.config" in imported  # (the listing is there)
    assert not {"lightning", "lightning.pytorch", "transformers", "loorl.cli.train_job"} & imported
