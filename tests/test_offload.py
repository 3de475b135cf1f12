"""FSDP CPU offload with NCCL (GPU-only, untested on GPU here): what can be checked on CPU.

With `trainer.strategy.offload_params=true` on GPUs the gradient shards live in CPU memory while the
process group is NCCL's, which has no CPU backend. Two things make it run: the process group gets
gloo for CPU tensors (`cpu:gloo,cuda:nccl`), and loorl's clipping sums the squared norms of the local
shards and all-reduces one scalar on the mesh's device, where torch's all-reduces a DTensor norm on
the gradients' device (the CPU). Here: the backend choice, and the clipping against torch's on the
full gradient (2 gloo processes; on CPU the mesh's device and the gradients' are the same, so the
NCCL case itself is untested).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import child_env
from loorl.parallel.fsdp import clip_grad_norm_
from loorl.training.strategies import FSDPStrategy, process_group_backend

ROOT = Path(__file__).resolve().parents[1]


# ---- the process group's backend -------------------------------------------------------------------
@pytest.mark.parametrize(
    "device_type, offload, expected",
    [
        ("cuda", True, "cpu:gloo,cuda:nccl"),  # offloaded gradients are CPU tensors
        ("cuda", False, "nccl"),
        ("cpu", True, "gloo"),  # offload is a no-op on a CPU device
        ("cpu", False, "gloo"),
    ],
)
def test_backend_adds_gloo_only_when_offloading_on_cuda(device_type, offload, expected):
    assert process_group_backend(configured=None, device_type=device_type, offload=offload) == expected


def test_a_configured_backend_wins():
    assert process_group_backend(configured="nccl", device_type="cuda", offload=True) == "nccl"


@pytest.mark.parametrize(
    "device, offload, expected",
    [("cuda", True, "cpu:gloo,cuda:nccl"), ("cuda", False, "nccl"), ("cpu", True, "gloo")],
)
def test_the_strategy_hands_lightning_the_chosen_backend(device, offload, expected):
    """What Lightning's `_setup_distributed` passes to init_process_group (no process group is made)."""
    strategy = FSDPStrategy(offload_params=offload)
    strategy.parallel_devices = [torch.device(device, 0) if device == "cuda" else torch.device("cpu")]
    assert strategy._get_process_group_backend() == expected


# ---- clipping ----------------------------------------------------------------------------------
def test_unsharded_gradients_are_clipped_as_torch_does():
    """One process or DDP (plain tensors): torch's clipping, its norm returned as a float."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    norm = clip_grad_norm_(params, max_norm=0.5)
    expected = torch.nn.utils.clip_grad_norm_(twins, 0.5)
    assert isinstance(norm, float) and norm == pytest.approx(float(expected), rel=1e-7)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("offload", [False, True], ids=["sharded", "sharded-cpu-offload"])
def test_sharded_clipping_equals_torch_on_the_full_gradient(tmp_path, offload):
    """2 gloo processes, FSDP2 over a toy model (one rank holds an empty shard of a 1-element bias):
    the norm and the clipped gradients equal torch's `clip_grad_norm_` on the unsharded gradient, and
    the only collective is one scalar all-reduce on the mesh's device."""
    out = tmp_path / "clip.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(ROOT / "tests" / "dist_clip.py"), "--out", str(out)] + (["--offload"] if offload else [])
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = torch.load(out, weights_only=False)
    for max_norm, r in results.items():
        assert r["norm"] == pytest.approx(r["torch_norm"], rel=1e-6), max_norm
        for got, want in zip(r["grads"], r["torch_grads"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert r["all_reduce_calls"] == [(1, "cpu")]  # one scalar, on the (CPU) mesh's device
        assert r["collectives"] == 1  # that one, and nothing else
    assert 0 in results[1e9]["local_sizes"][1]  # rank 1's shard of the 1-element bias is empty
    clipped = results[0.05]
    assert clipped["torch_norm"] > 0.05  # the second case really clips
    norm_after = torch.linalg.vector_norm(torch.cat([g.flatten() for g in clipped["grads"]]))
    assert float(norm_after) == pytest.approx(0.05, rel=1e-4)
    unclipped = results[1e9]
    assert unclipped["norm"] == pytest.approx(clipped["norm"], rel=1e-12)  # the same gradients both times
