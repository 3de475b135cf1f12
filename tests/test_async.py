"""One step off (`rollout.max_staleness=1`): step t+1's rollout is sampled with step t's weights while step t
trains (in a sampler process of its own, `rollout.devices=auto`), the loss corrects for the lag with the
sampler's log-probs, runs repeat exactly, the sampler process changes where the samples are drawn but
not what they are, and a resume trains on the rollout that was sampled ahead (it is in the checkpoint).
How fast it is: `scripts/bench/bench_async.py` (docs/how-to/one-step-off.md)."""

from __future__ import annotations

import copy
import csv
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fixtures import assert_same_run, metric_values
from loorl.algo.logprobs import completion_logprobs
from loorl.build import build_module, build_task
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.models.sources import resolve_model_path
from loorl.types import RolloutBatch
from test_resume import EVERY, RL_STEPS, ROOT, _command, _env, _run, _start_and_signal

ASYNC = "rollout.max_staleness=1"


# ---- the off-policy gradient ------------------------------------------------------------------------
def _module_and_stale_batch(quick_cfg, *overrides):
    """The quick run's learner, and a batch of 2 groups x K=2 sampled by an older policy: its sampler
    log-probs are those of the policy one (perturbed) update back."""
    sizes = ("rl.prompts_per_step=2", "rl.prompts_per_minibatch=2", "rl.prompts_per_microbatch=2",
             "rl.samples_per_prompt=2")  # fmt: skip
    s = check_config(quick_cfg(*sizes, *overrides))
    module = build_module(s, resolve_model_path(s.model, s.task, build_task(s)))
    module.configure_model()  # the policy, in float32 (the quick profile's master dtype)
    older = copy.deepcopy(module.policy)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in older.parameters():
            p.add_(0.05 * torch.randn_like(p))  # one step behind, roughly
    g = torch.Generator().manual_seed(1)
    n, prompt_len, c = 4, 3, 5
    vocab = module.policy.config.vocab_size
    ids = torch.randint(3, vocab, (n, prompt_len + c), generator=g)  # [N, P + C]
    ids[1::2, :prompt_len] = ids[0::2, :prompt_len]  # a group's samples share their prompt
    batch = RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones(n, prompt_len + c, dtype=torch.long),
        completion_mask=torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0], [1.0] * 5]),
        sampler_logprobs=torch.zeros(n, c),
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        samples_per_prompt=2,
        prompt_len=prompt_len,
    )
    with torch.no_grad():
        sampler = completion_logprobs(older, batch, sampling=module.sampling)  # [N, C]
    return module, replace(batch, sampler_logprobs=sampler)


def _gradient(module, batch) -> dict[str, torch.Tensor]:
    module.policy.zero_grad(set_to_none=True)
    module.accumulate_gradients(batch, lambda loss: loss.backward())
    return {k: p.grad.clone() for k, p in module.policy.named_parameters() if p.grad is not None}


# packed: micro-batches of at most 12 real tokens (a group's prompt once and its 2 completions: 11
# and 12 tokens, 2 micro-batches), the gradient still the whole mini-batch's
@pytest.mark.parametrize("packing", [(), ("rl.microbatch_tokens=12",)], ids=["padded", "packed"])
def test_a_stale_rollout_is_trained_with_the_hand_computed_off_policy_gradient(quick_cfg, packing):
    """With `stale=True` (what a one-step-off rollout gets) the gradient is the clipped importance-weighted
    one, with ratio r = pi / pi_sampler per token and `active` where PPO's unclipped branch is the minimum:
        g = -(1 / num_seqs) sum_i A_i sum_t active_it r_it grad log pi_it
    computed here by hand from the policy's log-probs; the synchronous path (ratio 1) gives another."""
    module, batch = _module_and_stale_batch(quick_cfg, *packing)
    prepared, _ = module.with_advantages(batch, stale=True)
    assert torch.equal(prepared.old_logprobs, batch.sampler_logprobs)  # the behaviour policy's log-probs

    got = _gradient(module, prepared)

    module.policy.zero_grad(set_to_none=True)
    logp = completion_logprobs(module.policy, batch, sampling=module.sampling)  # [N, C] with gradient
    ratio = torch.exp(logp.detach() - batch.sampler_logprobs)  # [N, C]
    a = prepared.advantages[:, None]  # [N, 1]
    low, high = 1 - module.loss_settings.clip_low, 1 + module.loss_settings.clip_high
    # PPO's min(r A, clip(r) A) has the gradient of r A where the unclipped branch is the minimum
    active = torch.where(a > 0, ratio <= high, ratio >= low).float()  # [N, C]
    mask = batch.completion_mask
    by_hand = -(a * active * ratio * logp * mask).sum() / len(mask)  # seq-mean-token-sum over 4 sequences
    by_hand.backward()
    expected = {k: p.grad.clone() for k, p in module.policy.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for k in got:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-4, atol=1e-6)
    assert float(((ratio - 1).abs() * mask).max()) > 0.01  # the lag is real: the ratios are not 1

    on_policy, _ = module.with_advantages(batch, stale=False)
    assert on_policy.old_logprobs is None  # the synchronous loss (REINFORCE, ratio 1)
    sync = _gradient(module, on_policy)
    assert max(float((sync[k] - got[k]).abs().max()) for k in got) > 1e-4


# ---- runs -------------------------------------------------------------------------------------------
def _rows(run: Path) -> list[dict[str, str]]:
    with (run / "csv" / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("rollout/policy_lag")]


def _assert_lagged_and_corrected(run: Path) -> list[dict[str, str]]:
    rows = _rows(run)
    assert [float(r["rollout/policy_lag"]) for r in rows] == [0.0] + [1.0] * (RL_STEPS - 1)
    assert rows[0].get("train/ratio_mean", "") == ""  # the first step samples its own rollout: on-policy
    for r in rows[1:]:  # the others are corrected: importance ratios, their spread, the clipped share
        assert abs(float(r["train/ratio_mean"]) - 1) < 0.5 and float(r["train/ratio_std"]) > 0
        assert 0 <= float(r["train/clip_frac"]) <= 1
    return rows


@pytest.mark.slow  # the resume test below repeats a run exactly too (resumed == uninterrupted)
def test_one_step_off_lags_one_version_corrects_and_repeats_exactly(tmp_path, model_cache):
    runs = [tmp_path / name for name in ("a", "b", "sync")]
    for run in runs[:2]:
        _run(_command(run, model_cache, ASYNC))
    _run(_command(runs[2], model_cache))
    rows = _assert_lagged_and_corrected(runs[0])
    assert_same_run(runs[0], runs[1])  # two runs, one seed: the same to the last digit
    sync = {r["epoch"]: r["rollout/reward"] for r in csv.DictReader((runs[2] / "csv" / "metrics.csv").open())
            if r.get("rollout/reward")}  # fmt: skip
    assert sync["0"] == rows[0]["rollout/reward"]  # the same first step (the same weights sample it)
    assert any(sync[r["epoch"]] != r["rollout/reward"] for r in rows[1:])  # then older weights sample


def _run_placed(run: Path, model_cache: Path, devices: str, *overrides: str) -> None:
    """The quick run one step off with `rollout.devices=devices`; `trainer` with one thread, as the sampler
    process and the trainer beside it each have. Checks where the sampler ran."""
    cmd = _command(run, model_cache, ASYNC, f"rollout.devices={devices}", *overrides)
    env = dict(_env(), OMP_NUM_THREADS="1") if devices == "trainer" else _env()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    in_its_own = "the sampler process (pid" in done.stderr + done.stdout
    assert in_its_own == (devices != "trainer")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, model_cache) -> Path:
    """The quick run, one step off, uninterrupted, its sampler in a process of its own (the default)."""
    run = tmp_path_factory.mktemp("async") / "straight"
    _run_placed(run, model_cache, "auto")
    _assert_lagged_and_corrected(run)
    return run


# slow: the default suite keeps the sampler process's run resumed to the same values after kill -9
# (below) and its samples against this process's, one step (tests/test_sampler_process.py)
@pytest.mark.slow
def test_the_sampler_process_samples_what_the_training_process_would(tmp_path, model_cache, straight_run):
    """Where the samples are drawn does not change them: the same run with the sampler in the training
    process (`rollout.devices=trainer`, one thread, as the sampler process and the trainer each have)
    logs the same values, to the last digit. What the sampler process is given decides them (weights,
    seed, prompts, autocast dtype), not when it runs. (Validation runs on both cores in the one run and
    on one in the other: the quick model's float32 kernels give the same values either way.)"""
    inline = tmp_path / "inline"
    _run_placed(inline, model_cache, "trainer")
    assert_same_run(straight_run, inline)


@pytest.mark.slow  # two more runs; the float32 case above is in the default suite
def test_the_sampler_process_samples_in_the_trainers_bf16_autocast(tmp_path, model_cache, quick_cfg):
    """Under bf16-mixed the request carries the trainer's autocast dtype: the sampler process samples as
    the training process would, to the last digit (validation included)."""
    from loorl.cli.trainer_parts import trainer_precision

    assert trainer_precision(quick_cfg("model.dtype=bfloat16")) == "bf16-mixed"
    runs = {devices: tmp_path / devices for devices in ("auto", "trainer")}
    for devices, run in runs.items():
        _run_placed(run, model_cache, devices, "model.dtype=bfloat16", "rl.steps=10")
    assert_same_run(runs["auto"], runs["trainer"])


@pytest.mark.slow  # two more runs
def test_a_lora_policy_is_sampled_with_its_merged_weights_in_the_sampler_process(tmp_path, model_cache):
    """The sampler process holds a LoRA policy's merged weights, W + B @ A * scale (as a copying engine
    does); the training process samples with the adapters unmerged. The same samples, here; their
    log-probs differ in the last digits, and so the importance ratios and the loss a little."""
    pytest.importorskip("peft")
    runs = {devices: tmp_path / devices for devices in ("auto", "trainer")}
    for devices, run in runs.items():
        _run_placed(run, model_cache, devices, "model.lora={r: 8}", "rl.steps=6")
    merged, unmerged = metric_values(runs["auto"]), metric_values(runs["trainer"])
    assert merged.keys() == unmerged.keys()
    for key in merged:
        if key[0].startswith(("rollout/", "val/")):  # what was sampled and how it scored
            assert merged[key] == unmerged[key], key
        else:
            for a, b in zip(map(float, merged[key]), map(float, unmerged[key]), strict=True):
                assert abs(a - b) <= 0.05 * max(1.0, abs(a), abs(b)), key


def test_a_killed_one_step_off_run_resumes_to_the_same_run(tmp_path, model_cache, straight_run):
    """The rollout sampled ahead is in the checkpoint: the resumed run trains on it, as the
    uninterrupted run did (regenerating it would need the previous step's weights)."""
    straight, run = straight_run, tmp_path / "run"
    kill_at = 2 * EVERY  # after the second checkpoint
    first = run / "checkpoints" / f"epoch={kill_at - 1}-step={kill_at}.ckpt"
    killed = _start_and_signal(_command(run, model_cache, ASYNC), first, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    saved = torch.load(first, map_location="cpu", weights_only=False)["RolloutDataModule"]["pending_by_rank"][
        0
    ]
    # step kill_at's rollout, sampled with step kill_at - 1's weights
    assert list(saved) == [kill_at] and saved[kill_at]["policy_version"] == kill_at - 1
    _run(_command(run, model_cache, ASYNC, "resume_from=auto"))
    assert_same_run(straight, run)


@pytest.mark.slow  # two data-parallel runs and a resume, ~2 min
def test_a_stopped_data_parallel_one_step_off_run_resumes_to_the_same_run(tmp_path, model_cache):
    """strategy=ddp: each rank samples its own block of prompts one step off, and every rank's rollout
    sampled ahead goes into the checkpoint (rank 0 writes it), so a resumed run trains on them."""
    ddp = (ASYNC, "strategy=ddp", "trainer.devices=2")
    straight, run = tmp_path / "straight", tmp_path / "run"
    _run(_command(straight, model_cache, *ddp))
    _assert_lagged_and_corrected(straight)
    first = run / "checkpoints" / f"epoch={EVERY - 1}-step={EVERY}.ckpt"
    stopped = _start_and_signal(_command(run, model_cache, *ddp), first, signal.SIGTERM)
    assert stopped.returncode == 0  # finished its step, wrote last.ckpt, stopped
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    by_rank = saved["RolloutDataModule"]["pending_by_rank"]
    assert len(by_rank) == 2 and all(len(p) == 1 for p in by_rank)  # each rank's next rollout
    _run(_command(run, model_cache, *ddp, "resume_from=auto"))
    assert_same_run(straight, run)


# ---- settings -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            (ASYNC, "strategy=fsdp", "trainer.devices=2"),
            "rollout.max_staleness=1 is not supported with strategy=fsdp",
        ),
        (
            (ASYNC, "strategy=ddp", "trainer.devices=2", "rollout.devices=cpu:1"),
            "places one sampler, but a data",
        ),
        (("rollout.max_staleness=-1",), "rollout.max_staleness"),
    ],
)
def test_one_step_off_settings_that_cannot_run_are_one_line(quick_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        check_config(quick_cfg(*overrides))
    assert "\n" not in str(err.value)


def test_max_staleness_composes_with_every_engine(quick_cfg):
    for engine in ("hf", "vllm", "auto"):
        s = check_config(quick_cfg(f"rollout={engine}", ASYNC))
        assert s.rollout.max_staleness == 1
    assert check_config(quick_cfg()).rollout.max_staleness == 0  # synchronous by default
