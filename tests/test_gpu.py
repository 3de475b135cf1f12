"""The CUDA path on the tiny model: `python -m pytest -m gpu tests/test_gpu.py` (skipped without CUDA).

The default suite runs where CUDA is visible too, but pins the CPU where its figures are the CPU's
(`fixtures.ON_CPU`: bit-exact repeats and resumes, learning bars, host memory). These are the CUDA
counterparts, small (the quick profile, a few steps): bf16-mixed keeps float32 weights that all move;
the HF engine samples on the GPU the log-probs the trainer computes; the shared-prompt forward equals
the full one; one DDP step in one process (NCCL); export and resume. Written without a GPU: untested on
GPU until a GPU node runs them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from safetensors.torch import load_file

from fixtures import child_env, needs_cuda, tiny_model_and_prompts
from loorl.algo.logprobs import completion_logits, completion_logprobs, token_logprobs
from loorl.cli.train import train
from loorl.cli.trainer_parts import trainer_precision
from loorl.models.tiny import ensure_tiny_model
from loorl.rollout.batch import assemble
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.types import SamplingConfig

pytestmark = [pytest.mark.gpu, needs_cuda]

ROOT = Path(__file__).resolve().parents[1]
ON_GPU = ("trainer=gpu",)  # one GPU; the quick profile samples with the HF engine (tests/conftest.py)
SAMPLING = SamplingConfig(max_new_tokens=5, temperature=0.7)
TOLERANCE = 1e-4  # float32 on CUDA: the cached decode and the full forward run other kernels


def _history(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())["history"]


def _policy_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}


@pytest.fixture(scope="module")
def tiny_cuda(quick_config):
    """The quick tiny model in float32 on the GPU, its tokenizer, 6 held-out prompts of several lengths."""
    tok, model, ids = tiny_model_and_prompts(quick_config())
    return tok, model.to("cuda").eval(), ids


def _samples(tiny_cuda, *, seed: int = 11):
    tok, model, ids = tiny_cuda
    engine = HFEngine(SAMPLING, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    engine.sync(model)
    return engine.generate(ids, n=4, seed=seed)


def _batch(tiny_cuda):
    tok, _, ids = tiny_cuda
    groups = _samples(tiny_cuda)
    return assemble(ids, groups, pad_token_id=tok.pad_token_id, rewards=torch.zeros(len(ids), 4)).to("cuda")


# ---- bf16-mixed on CUDA ------------------------------------------------------------------------
def test_bf16_mixed_on_cuda_keeps_float32_weights_that_all_move(quick_config, tmp_path):
    """tests/test_precision.py's check on CUDA's bf16 autocast: two steps at lr 1e-6 move the float32
    master weights (bf16 weights would round most of those updates away)."""
    steps = ["optimizer.lr=1e-6", "rl.steps=2", "checkpoint_every=1"]
    cfg = quick_config(*ON_GPU, "model.dtype=bfloat16", *steps, output_dir=tmp_path)
    assert trainer_precision(cfg) == "bf16-mixed"
    initial = load_file(ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task)) / "model.safetensors")
    torch.cuda.reset_peak_memory_stats()
    train(cfg)
    assert torch.cuda.max_memory_allocated() > 0  # it trained on the GPU
    trained = _policy_weights(tmp_path / "checkpoints" / "last.ckpt")
    assert {v.dtype for v in trained.values()} == {torch.float32}
    changed = sum(int((trained[k] != v.to(trained[k].dtype)).sum()) for k, v in initial.items())
    assert changed / sum(v.numel() for v in initial.values()) > 0.5  # CPU: 99.99%


# ---- the HF engine on CUDA ---------------------------------------------------------------------
def test_the_hf_engine_samples_on_cuda_what_the_trainer_scores(tiny_cuda):
    """A seeded call repeats its samples and leaves the global CPU and CUDA streams alone; the sampler's
    log-probs are those the trainer recomputes (left padding, position ids, temperature)."""
    _, model, ids = tiny_cuda
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    groups = _samples(tiny_cuda)
    assert torch.equal(torch.get_rng_state(), cpu_rng) and torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    tokens = [[c.token_ids for c in g] for g in groups]
    assert tokens == [[c.token_ids for c in g] for g in _samples(tiny_cuda)]
    assert tokens != [[c.token_ids for c in g] for g in _samples(tiny_cuda, seed=12)]
    batch = _batch(tiny_cuda)
    with torch.no_grad():
        recomputed = completion_logprobs(model, batch, sampling=SAMPLING)  # [N, C]
    mask = batch.completion_mask.bool()
    assert mask.sum() > 0 and recomputed.is_cuda
    assert (recomputed - batch.sampler_logprobs)[mask].abs().max() < TOLERANCE


# ---- the shared-prompt forward on CUDA ---------------------------------------------------------
def _loss_and_grads(model, batch, *, share: bool):
    model.zero_grad(set_to_none=True)
    logits = completion_logits(model, batch, share_prompt=share)  # [N, C, V]
    logp = token_logprobs(logits, batch.completion_ids, temperature=SAMPLING.temperature)  # [N, C]
    weights = torch.linspace(-1, 1, logp.shape[0], device=logp.device)[:, None]  # [N, 1] one per row
    (-(logp * weights * batch.completion_mask).sum()).backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_shared_prompt_forward_on_cuda_equals_the_full_forward(tiny_cuda):
    """tests/test_shared_prompt.py's check on CUDA: each group's prompt run once, its key/value cache
    repeated K times, gives the full forward's log-probs and gradients."""
    _, model, _ = tiny_cuda
    batch = _batch(tiny_cuda)
    mask = batch.completion_mask.bool()  # [N, C]
    model.train()
    try:
        full_logp, full_grads = _loss_and_grads(model, batch, share=False)
        shared_logp, shared_grads = _loss_and_grads(model, batch, share=True)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    assert (full_logp[mask] - shared_logp[mask]).abs().max() < TOLERANCE
    for name, g in full_grads.items():
        assert g.abs().max() > 0, name  # every parameter gets a gradient (the prompt's too)
        assert (shared_grads[name] - g).abs().max() < TOLERANCE * g.abs().max(), name


# ---- one DDP step, one process, NCCL -----------------------------------------------------------
def test_one_ddp_step_in_one_process_on_cuda(model_cache, tmp_path):
    """`python src/train.py trainer=gpu strategy=ddp trainer.devices=1`: Lightning's DDP on one GPU
    (an NCCL process group of one), one RL step, a validation and a checkpoint."""
    run = tmp_path / "run"
    cmd = [sys.executable, "src/train.py", "debug=quick", "rollout=hf", *ON_GPU, "strategy=ddp",
           "trainer.devices=1", "rl.steps=1", "val_every=1", "checkpoint_every=1", "export_policy=false",
           f"model.cache_dir={model_cache}", f"hydra.run.dir={run}",
           "trainer.enable_progress_bar=false"]  # fmt: skip
    env = child_env(TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run / "metrics.json").read_text())["summary"]
    assert summary["rl_steps"] == 1 and summary["optimizer_steps"] == 1
    history = _history(run)
    assert all(math.isfinite(v) for key in ("train/loss", "train/grad_norm") for _, v in history[key])
    assert (run / "checkpoints" / "last.ckpt").is_file()


# ---- export and resume on CUDA -----------------------------------------------------------------
def test_export_and_resume_on_cuda(quick_config, tmp_path):
    """A CUDA run exports a policy that loads anywhere (the checkpoint's weights), and a resume from its
    checkpoint continues the step count with the history restored. Statistically, not bitwise, the
    run it replaces: the CPU suite compares resumes bit for bit (tests/test_resume.py)."""
    from transformers import AutoModelForCausalLM

    first, second = tmp_path / "first", tmp_path / "second"
    train(quick_config(*ON_GPU, "rl.steps=2", "checkpoint_every=1", output_dir=first))
    checkpoint = first / "checkpoints" / "last.ckpt"
    exported = AutoModelForCausalLM.from_pretrained(first / "policy").state_dict()  # on the CPU
    weights = _policy_weights(checkpoint)
    assert all(torch.equal(exported[k], weights[k]) for k in exported if k in weights)
    assert "model.embed_tokens.weight" in exported and "model.embed_tokens.weight" in weights
    summary = train(quick_config(*ON_GPU, "rl.steps=3", f"resume_from={checkpoint}", output_dir=second))
    assert summary["rl_steps"] == 3 and summary["optimizer_steps"] == 3
    before, after = _history(first), _history(second)
    assert [s for s, _ in after["rollout/reward"]] == [0, 1, 2]  # the whole run, not its tail
    assert after["rollout/reward"][:2] == before["rollout/reward"]  # restored from the checkpoint
    assert all(math.isfinite(v) for _, v in after["train/loss"])


# ---- the decoding loop on CUDA (rollout.hf_decode) ---------------------------------------------
def test_the_compiled_decode_loop_draws_the_same_tokens_faster(tiny_cuda):
    """`rollout.hf_decode=auto` is `compiled` on CUDA: each one-token step a CUDA graph. Greedy tokens
    equal the eager loop's, and after its warm-up (compilation, graph capture) a rollout of 32 rows
    runs at least twice as fast (issue figure on SmolLM2/H100: 442 tokens/s eager, 5x wanted)."""
    import time

    tok, model, ids = tiny_cuda
    rows = (ids * 6)[:32]

    def engine(decoding: str) -> HFEngine:
        e = HFEngine(SamplingConfig(max_new_tokens=24), decoding=decoding,
                     eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)  # fmt: skip
        e.sync(model)
        return e

    def seconds(e: HFEngine) -> float:
        e.generate(rows, n=1, greedy=True)  # warm-up: compilation and capture for `compiled`
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            e.generate(rows, n=1, greedy=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 3

    eager, compiled = engine("dynamic"), engine("compiled")
    reference, fast = eager.generate(rows, n=1, greedy=True), compiled.generate(rows, n=1, greedy=True)
    assert [g[0].token_ids for g in reference] == [g[0].token_ids for g in fast]
    assert seconds(compiled) * 2 <= seconds(eager)


# ---- log-probs from the hidden states in chunks, and packed micro-batches, on CUDA ----------------
@pytest.mark.parametrize("autocast", [False, True])
def test_the_chunked_head_on_cuda_equals_the_plain_path_and_holds_a_chunk(autocast):
    """tests/test_head_logprobs.py's checks on CUDA (the weight's gradient summed as [V, H] there):
    values and gradients against the whole logits, float32 and under bf16 autocast; and the extra
    peak of a 4 x 512 pass over Qwen2.5's 151,936-entry vocabulary, from CUDA's allocator, stays under
    2 chunks of float32 logits beyond the weight-sized gradient (the whole logits: 1.2 GiB)."""
    from loorl.algo.head_logprobs import head_logprobs

    gen = torch.Generator(device="cuda").manual_seed(0)
    v, h, chunk = 151_936, 64, 256
    hidden = torch.randn(4 * 512, h, device="cuda", generator=gen).requires_grad_()  # [T, H]
    weight = (torch.randn(v, h, device="cuda", generator=gen) * 0.1).requires_grad_()  # [V, H]
    tokens = torch.randint(v, (4 * 512,), device="cuda", generator=gen)  # [T]
    upstream = torch.randn(tokens.shape, device="cuda", generator=gen)  # [T]
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-4, "atol": 1e-5}

    def run(chunked: bool):
        hidden.grad = weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            if chunked:
                logp = head_logprobs(hidden, weight, tokens, temperature=0.7, chunk_tokens=chunk)[0]
            else:
                logp = token_logprobs(torch.nn.functional.linear(hidden, weight), tokens, temperature=0.7)
        (logp * upstream).sum().backward()
        return logp.detach().float(), hidden.grad.clone(), weight.grad.clone()

    want = run(chunked=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() + sum(w.numel() * w.element_size() for w in want)
    got = run(chunked=True)
    extra = torch.cuda.max_memory_allocated() - base - weight.numel() * 4  # beyond the weight's gradient
    for name, g, w in zip(("logp", "d/dhidden", "d/dweight"), got, want):
        torch.testing.assert_close(g, w, **tol, msg=name)
    assert extra < 2 * chunk * v * 4, f"{extra / 2**20:.0f} MiB beyond the weight-sized gradient"


@pytest.mark.parametrize("share", [False, True])
def test_a_packed_pass_on_cuda_scores_what_the_padded_pass_scores(tiny_cuda, share):
    """tests/test_packing.py's check on CUDA with sdpa: packed micro-batches (block-diagonal mask,
    positions per sequence) give the padded batch's log-probs at every token budget."""
    _, model, _ = tiny_cuda
    batch = _batch(tiny_cuda)
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        padded = completion_logprobs(model, batch, sampling=SAMPLING)  # [N, C]
        for budget in (10, 64, 10_000):
            packed = completion_logprobs(model, batch, sampling=SAMPLING, share_prompt=share,
                                         microbatch_tokens=budget)  # fmt: skip
            assert (packed[mask] - padded[mask]).abs().max() < TOLERANCE, budget
