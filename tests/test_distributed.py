"""Multi-process training on CPU with two processes (gloo): DDP and FSDP give the single-process update,
groups stay whole on one rank, and the CLI trains, checkpoints, resumes and exports under both.

The processes are real: `torchrun` runs tests/dist_one_step.py; the CLI runs Lightning's own launcher.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import DIGIT_TOOLS, ON_CPU, assert_close_runs, child_env
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.parallel.distributed import rank_block
from loorl.settings import RLSettings
from loorl.training.batches import minibatch_prompts

ROOT = Path(__file__).resolve().parents[1]
ONE_STEP = ROOT / "tests" / "dist_one_step.py"
# every learner part whose normalisation could go wrong across ranks: a KL reference folded into the
# reward with the adaptive controller, batch whitening (REINFORCE++), the token-mean normaliser,
# several micro-batches per rank, and plain SGD, whose update is proportional to the gradient
# (Adam's first step hides its scale); clipping at a norm it never reaches still computes and logs
# the global gradient norm
SETTINGS = [
    "estimator=reinforce_pp",
    "kl.coef=0.05",
    "kl.adaptive=true",
    "loss.agg=token-mean",
    "optimizer._target_=torch.optim.SGD",
    "~optimizer.betas",
    "~optimizer.weight_decay",
    "optimizer.lr=0.5",
    "loss.max_grad_norm=1e9",
]
RTOL = 1e-5  # float32, relative to the largest parameter of each tensor


def _env() -> dict:
    env = child_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # the GPU node's packages kept
    env.pop("LOCAL_RANK", None)
    return env


def one_step(out: Path, model_cache: Path, strategy: str = "auto", procs: int = 1, *extra: str) -> dict:
    """tests/dist_one_step.py's CPU trainer (gloo) with the HF engine for its rollout, on any machine."""
    args = [str(ONE_STEP), "--strategy", strategy, "--out", str(out), "--model-cache", str(model_cache)]
    args += SETTINGS + ["rollout=hf"] + list(extra)
    if procs > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    else:
        launch = [sys.executable]
    done = subprocess.run(launch + args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def single(tmp_path_factory, model_cache) -> dict:
    return one_step(tmp_path_factory.mktemp("one") / "out.pt", model_cache)


def _relative_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


# ---- pure: which groups a rank owns ----------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_blocks_cover_every_prompt_once_in_order(world):
    blocks = [list(rank_block(8, r, world)) for r in range(world)]
    assert sum(blocks, []) == list(range(8))
    assert len({len(b) for b in blocks}) == 1


def test_rank_block_refuses_an_uneven_split():
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        rank_block(8, 0, 3)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_minibatches_take_whole_groups_from_every_rank(world):
    rl = RLSettings(
        steps=1,
        prompts_per_step=8,
        samples_per_prompt=4,
        prompts_per_minibatch=4,
        prompts_per_microbatch=1,
        epochs_per_rollout=2,
    )
    batches = minibatch_prompts(rl, seed=0, step=3, world_size=world)
    per_pass = 8 // 4
    assert len(batches) == 2 * per_pass  # the same number of optimizer steps on every rank
    assert all(len(b) == 4 // world for b in batches)  # M/W of this rank's groups per mini-batch
    for p in range(2):  # every local group exactly once per pass
        assert sorted(sum(batches[p * per_pass : (p + 1) * per_pass], [])) == list(range(8 // world))


# ---- two processes: the update of one process ----------------------------------------------------
@pytest.mark.parametrize(
    "strategy, extra",
    [
        ("ddp", ()),
        ("fsdp", ()),
        # FSDP2's CPU offload (a no-op on a CPU device: it must compose and not change the update)
        # with activation checkpointing, and an unsharded reference. Slow: offload's sharded clipping
        # (tests/test_offload.py) and checkpointing's gradients (tests/test_lora.py,
        # tests/test_shared_prompt.py) stay in the default suite
        pytest.param(
            "fsdp",
            (
                "trainer.strategy.offload_params=true",
                "model.gradient_checkpointing=true",
                "trainer.strategy.shard_reference=false",
            ),
            marks=pytest.mark.slow,
        ),
        # packed token-budget micro-batches (the chunked output layer inside FSDP's root forward). Slow:
        # packing's equality with the padded step (tests/test_packing.py) stays in the default suite
        pytest.param("fsdp", ("rl.microbatch_tokens=64",), marks=pytest.mark.slow),
    ],
    ids=["ddp", "fsdp", "fsdp-offload-checkpointing", "fsdp-packed"],
)
def test_two_processes_take_the_single_process_step(tmp_path, model_cache, single, strategy, extra):
    two = one_step(tmp_path / "out.pt", model_cache, strategy, 2, *extra)
    assert_the_single_process_step(single, two, strategy)


# GDPO reads every rank's reward parts, gathered in the same collective as the rewards (beside ReMax's
# greedy baselines): two processes take the one-process step
GDPO = ("estimator=gdpo", "reward=custom", "reward.clip=null", "kl.in_reward=false", "kl.estimator=k3")


@pytest.mark.slow  # two more runs: the ddp case gathers the rewards but has no reward parts (reward=task)
def test_two_processes_take_the_single_process_gdpo_step(tmp_path, model_cache):
    single = one_step(tmp_path / "one.pt", model_cache, "auto", 1, *GDPO)
    assert_the_single_process_step(single, one_step(tmp_path / "two.pt", model_cache, "ddp", 2, *GDPO), "ddp")


# LoRA: adapters over frozen base weights, the KL reference the base with the adapters off (peft's
# disable_adapter() inside DDP's and FSDP's forward), FSDP's layer classes found inside the PeftModel
LORA = ("model.lora={r: 4}",)


@pytest.fixture(scope="module")
def single_lora(tmp_path_factory, model_cache) -> dict:
    pytest.importorskip("peft")
    return one_step(tmp_path_factory.mktemp("one-lora") / "out.pt", model_cache, "auto", 1, *LORA)


# FSDP's LoRA step is slow: the default suite trains LoRA under FSDP in two processes and resumes it
# exactly (test_cli_two_processes_resume_a_lora_run_exactly[fsdp])
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_processes_take_the_single_process_lora_step(tmp_path, model_cache, single_lora, strategy):
    two = one_step(tmp_path / "out.pt", model_cache, strategy, 2, *LORA)
    assert_the_single_process_step(single_lora, two, strategy)
    assert [k for k in two["state"] if ".lora_B." in k]
    for key, value in two["state"].items():  # the base weights never move; the adapters do
        moved = not torch.equal(value, two["initial"][key])
        assert moved == (".lora_B." in key), key  # A's gradient is 0 while B is 0 (the first step)


def assert_the_single_process_step(single: dict, two: dict, strategy: str) -> None:
    assert two["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # whole groups, each on one rank
    assert two["sharded"] == (strategy == "fsdp") and not single["sharded"]
    assert _relative_gap(single["state"], two["state"]) <= RTOL
    # the update itself (new - initial), not only the parameters, agrees
    delta = {k: single["state"][k] - single["initial"][k] for k in single["state"]}
    delta_two = {k: two["state"][k] - two["initial"][k] for k in two["state"]}
    assert max(float(d.abs().max()) for d in delta.values()) > 1e-4  # the step moved the weights
    assert _relative_gap(delta, delta_two) <= 1e-3
    # every logged statistic is the whole step's (reduced over ranks, weighted by counts)
    for key, value in single["metrics"].items():
        if not key.startswith("perf/"):
            assert two["metrics"][key] == pytest.approx(value, rel=RTOL, abs=1e-6), key
    # the environment's statistics (reward spread, accuracy, lengths, unscorable count, each reward
    # function's mean) are those of all B groups, gathered, not means of per-rank statistics
    assert two["rollout_stats"] == pytest.approx(single["rollout_stats"], rel=1e-6)
    # ... and the DataModule's own rollout logs them: every rank the same numbers, though each rank
    # sampled other groups
    assert two["collected_stats"][0] == two["collected_stats"][1]
    assert two["kl_coef"] == pytest.approx(single["kl_coef"], rel=1e-9)  # adapted to the global KL
    assert two["kl_coef"] != 0.05
    # the real DataModule draws the single process's prompts, split in rank blocks
    assert sum(two["prompts"], []) == single["prompts"][0]
    assert len(two["prompts"][0]) == len(two["prompts"][1])


# ---- two processes: the CLI trains, checkpoints, resumes, exports ---------------------------------
def _cli(run_dir: Path, model_cache: Path, *overrides: str, devices: int = 2) -> subprocess.CompletedProcess:
    """`devices` CPU processes (gloo), also on a GPU node: these tests are about CPU data parallelism and
    compare with a one-process CPU run (a node with one GPU could not start two GPU processes anyway)."""
    cmd = [sys.executable, str(ROOT / "src" / "train.py"), "debug=quick", f"model.cache_dir={model_cache}"]
    cmd += [*ON_CPU, f"hydra.run.dir={run_dir}", f"trainer.devices={devices}", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def single_validation(quick_config, tmp_path_factory) -> float:
    """The held-out greedy accuracy of the quick profile's model before training, in one process (this
    one: a process of its own would only add its start)."""
    from loorl.cli.train import train

    run = tmp_path_factory.mktemp("single") / "run"
    train(quick_config(*ON_CPU, "rl.steps=1", "val_every=1", "checkpoint_every=0", "export_policy=false",
                       output_dir=run))  # fmt: skip
    return json.loads((run / "metrics.json").read_text())["history"]["val/accuracy"][0][1]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, model_cache):
    """`two_process_run(strategy)`: the quick profile trained by the CLI in two processes (Lightning's own
    launcher, the README's `trainer.devices=2`), once per strategy for the module's tests."""
    runs = {}

    def run(strategy: str) -> Path:
        if strategy not in runs:
            runs[strategy] = tmp_path_factory.mktemp(f"two_processes_{strategy}") / "run"
            _cli(runs[strategy], model_cache, f"strategy={strategy}")
        return runs[strategy]

    return run


# FSDP's CLI run is slow (40 s on a slow day); FSDP's two-process step stays in the default suite
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_cli_two_processes_train_resume_and_export(tmp_path, model_cache, two_process_run, single_validation,
                                                   strategy):  # fmt: skip
    from transformers import AutoConfig, AutoModelForCausalLM

    run = two_process_run(strategy)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["summary"]["rl_steps"] == 4 and (run / "summary.md").exists()
    # validation is sharded (100 prompts per rank) and its accuracy reduced: the one-process figure
    # (greedy decoding; in other batch shapes an argmax may flip, hence one prompt of slack)
    assert abs(metrics["history"]["val/accuracy"][0][1] - single_validation) <= 0.005
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_dir() if strategy == "fsdp" else last.is_file()  # FSDP: one shard per rank
    exported = run / "policy"
    assert AutoConfig.from_pretrained(exported).architectures == ["Qwen2ForCausalLM"]
    policy = AutoModelForCausalLM.from_pretrained(exported)  # one full model, loadable as it is
    assert sum(p.numel() for p in policy.parameters()) > 0

    resumed = tmp_path / "resumed"
    _cli(resumed, model_cache, f"strategy={strategy}", f"resume_from={last}", "rl.steps=6")
    summary = json.loads((resumed / "metrics.json").read_text())["summary"]
    assert summary["rl_steps"] == 6 and summary["optimizer_steps"] == 6  # 4 restored + 2 trained


# tests/test_multinode.py's launcher (two torchrun agents, each pinned to its half of the CPUs with its own
# copy of the model cache), here beside the one-node run it is compared with. Slow: the default suite
# keeps the rank read from torchrun's environment before Lightning loads (RANK=1 beside LOCAL_RANK=0,
# tests/test_launch.py) and the two-process run through Lightning's launcher
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_torchrun_nodes_train_as_one_node(strategy, tmp_path, model_cache, two_process_run):
    """Two "nodes" of one process each train as one node of two processes does: the same metrics and
    policy; one writer in the shared folder (one config, one log per rank)."""
    from test_multinode import TwoNodes, node_caches, policy_difference

    one = two_process_run(strategy)  # builds the quick model into the cache if needed
    two = tmp_path / "two_nodes"
    nodes = TwoNodes(tmp_path, [two, two], node_caches(tmp_path, model_cache), f"strategy={strategy}")
    assert nodes.wait() == [0, 0], nodes.output(0)[-3000:] + nodes.output(1)[-3000:]
    assert_close_runs(one, two, rtol=RTOL)
    assert policy_difference(one, two) <= RTOL
    assert sorted(p.name for p in two.glob("*.log")) == ["train.log", "train_rank1.log"]
    assert (two / ".hydra").is_dir() and not list(two.glob(".hydra_*"))
    assert "intra-op threads: " in nodes.output(0) + nodes.output(1)


@pytest.mark.slow
def test_cli_two_processes_fill_every_rank_with_the_same_number_of_groups(tmp_path, model_cache):
    """Dynamic sampling under DDP: the ranks run the same rounds (the stopping rule is reduced over
    ranks, so their collectives meet), and every step trains B/W groups on each rank: the groups with
    signal and the fillers add up to B, over the whole run."""
    run = tmp_path / "run"
    _cli(run, model_cache, "strategy=ddp", "rl.dynamic_sampling.enabled=true", "rl.steps=6", "val_every=6",
         "checkpoint_every=0", "export_policy=false")  # fmt: skip
    history = json.loads((run / "metrics.json").read_text())["history"]
    signal, fillers = history["dynamic/groups_with_signal"], history["dynamic/filler_groups"]
    assert len(signal) == 6 and all(s[1] + f[1] == 8 for s, f in zip(signal, fillers))  # B = 8
    assert all(r[1] >= 1 for r in history["dynamic/rounds"])


@pytest.mark.slow
def test_cli_two_processes_run_tools_and_log_the_whole_steps_tool_metrics(tmp_path, model_cache):
    """Multi-turn rollouts with tools under DDP: each rank runs its own samples' calls, and what is
    logged is the whole step's: the tool counts are summed over the ranks (a rank's own would be about
    half the step's generated tokens), and the sharded greedy validation before training reports the
    one-process accuracy and tool use."""
    tools = (*DIGIT_TOOLS, "rl.steps=2", "val_every=2", "checkpoint_every=0", "export_policy=false")
    one, two = tmp_path / "one", tmp_path / "two"
    _cli(one, model_cache, *tools, devices=1)
    _cli(two, model_cache, "strategy=ddp", *tools)
    single, both = (json.loads((run / "metrics.json").read_text())["history"] for run in (one, two))
    calls = [value for _, value in both["tools/calls_per_sample"]]
    assert len(calls) == 2 and max(calls) > 0  # the tiny model calls the digit tool on its own
    for (_, generated), (_, sampled) in zip(both["tools/generated_tokens"], both["rollout/gen_tokens"]):
        assert generated == sampled  # the policy's own tokens of all B x K samples, on both ranks
    for (_, used), (_, turns) in zip(both["tools/used_frac"], both["tools/turns_per_sample"]):
        assert (used * 32).is_integer() and turns >= 1  # a share of the step's B x K = 32 samples
    # greedy decoding in other batch shapes may flip an argmax: one prompt of slack in 200
    for key in ("val/accuracy", "val/tool_used_frac"):
        assert both[key][0][0] == single[key][0][0] == 0
        assert abs(both[key][0][1] - single[key][0][1]) <= 0.005, key


# FSDP's folders of shards go through the module's state_dict/load_state_dict too (DDP's one file is
# tests/test_resume.py's); FSDP in the default suite, DDP on request
@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_cli_two_processes_resume_a_lora_run_exactly(tmp_path, model_cache, strategy):
    pytest.importorskip("peft")
    lora = (f"strategy={strategy}", "model.lora={r: 4}", "kl.coef=0.05")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _cli(straight, model_cache, *lora)
    first = straight / "checkpoints" / "epoch=1-step=2.ckpt"
    if strategy == "fsdp":  # a folder of shards: adapters and their AdamW state, no base weight
        from torch.distributed.checkpoint import FileSystemReader

        keys = list(FileSystemReader(str(first)).read_metadata().state_dict_metadata)
        weights = [k for k in keys if k.startswith("state_dict.")]
        assert weights and all(".lora_" in k for k in weights), weights[:3]
    _cli(resumed, model_cache, *lora, f'resume_from="{first}"')

    def history(run):
        h = json.loads((run / "metrics.json").read_text())["history"]
        return {k: v for k, v in h.items() if not k.startswith("perf/")}

    assert history(resumed) == history(straight)
    assert history(straight)["rollout/kl"][0][1] == 0.0
    assert (straight / "adapter" / "adapter_config.json").is_file()


# ---- bad input: one line before any model loads -----------------------------------------------
@pytest.mark.parametrize(
    "overrides, names",
    [
        (["strategy=ddp", "trainer.devices=3"], ["rl.prompts_per_step=8", "multiple of 3"]),
        (
            ["strategy=fsdp", "trainer.devices=2", "rl.prompts_per_minibatch=3", "rl.prompts_per_step=6"],
            ["rl.prompts_per_minibatch=3", "multiple of 2"],
        ),
        (
            ["strategy=ddp", "trainer.devices=2", "trainer.num_nodes=3"],
            ["trainer.num_nodes=3", "multiple of 6"],
        ),
        (["trainer.devices=2"], ["strategy=auto", "strategy=ddp"]),
        (
            ["strategy=ddp", "trainer.devices=2", "rollout=vllm", "rollout.vllm.tensor_parallel_size=2"],
            ["rollout.vllm.tensor_parallel_size=2", "tensor_parallel_size=1"],
        ),
    ],
)
def test_bad_multiprocess_settings_fail_in_one_line(quick_cfg, overrides, names):
    if "rollout=vllm" in overrides:
        pytest.importorskip("vllm")
    with pytest.raises(ConfigError) as err:
        check_config(quick_cfg(*overrides))
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in names), message


def test_fsdp_refuses_a_model_without_a_decoder_layer_class(quick_cfg, tmp_path):
    from transformers import CTRLConfig

    CTRLConfig(n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(tmp_path / "ctrl")
    cfg = quick_cfg("strategy=fsdp", f"model.name_or_path={tmp_path / 'ctrl'}")
    with pytest.raises(ConfigError, match=r"CTRLLMHeadModel.*strategy.layer_classes=\["):
        check_config(cfg)
    named = quick_cfg(
        "strategy=fsdp",
        f"model.name_or_path={tmp_path / 'ctrl'}",
        "trainer.strategy.layer_classes=[EncoderLayer]",
    )
    check_config(named)  # a named layer class is taken at its word (shard() fails if it is absent)


# ---- slow: whole runs (python -m pytest -m slow tests/test_distributed.py) ------------------------
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_with_vllm_engines_keep_the_sampler_gap_small(tmp_path, model_cache, strategy):
    """One colocated vLLM engine per rank; the sampler/trainer log-prob gap stays at float32 noise."""
    pytest.importorskip("vllm")
    run = tmp_path / "run"
    _cli(run, model_cache, f"strategy={strategy}", "rollout=vllm", "rl.steps=3", "val_every=3")
    history = json.loads((run / "metrics.json").read_text())["history"]
    gaps = [v for _, v in history["train/sampler_logratio_max"]]
    assert len(gaps) == 3 and max(gaps) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_learn_the_default_task(tmp_path, strategy):
    """The default run (150 steps) with 2 processes gains at least 25 held-out points."""
    cmd = [sys.executable, str(ROOT / "src" / "train.py"), f"strategy={strategy}", "trainer.devices=2"]
    cmd += [*ON_CPU, f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())["summary"]
    assert summary["val_accuracy_gain"] >= 0.25, summary
