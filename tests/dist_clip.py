"""Gradient-norm clipping over FSDP2 shards against torch's clipping of the full gradient, 2 processes.

Run by tests/test_offload.py with `torchrun --standalone --nproc_per_node=2`. Every rank builds the
same toy model (some dimensions smaller than the world, so a rank holds an empty shard), keeps an
unsharded copy, and runs the same input through both: FSDP averages the ranks' equal gradients, so
the sharded gradient is the copy's. Then `loorl.parallel.fsdp.clip_grad_norm_` clips the shards and
torch's `clip_grad_norm_` the copy. Rank 0 writes, for each max_norm, both norms, both clipped
gradients (the shards gathered) and the collectives the sharded clipping issued to `--out`.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from loorl.parallel.fsdp import clip_grad_norm_


def toy_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)
    )


def backward(model: torch.nn.Module) -> None:
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(1))  # [6, 7] the same on every rank
    model.zero_grad(set_to_none=True)
    (model(x).square().sum() * 10).backward()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--offload", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=False) if args.offload else OffloadPolicy()
    model = toy_model()
    full = copy.deepcopy(model)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)

    calls = []  # (numel, device) of every c10d all_reduce the sharded clipping issues
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **kw):
        calls.append((tensor.numel(), str(tensor.device)))
        return all_reduce(tensor, *a, **kw)

    results = {}
    for max_norm in (1e9, 0.05):  # no clipping (the norm alone), then clipping
        backward(model)
        backward(full)
        calls.clear()
        dist.all_reduce = counting_all_reduce
        try:
            with CommDebugMode() as comm:
                norm = clip_grad_norm_(list(model.parameters()), max_norm=max_norm)
        finally:
            dist.all_reduce = all_reduce
        collectives = comm.get_total_counts()  # what CommDebugMode sees: DTensor and c10d ones
        torch_norm = torch.nn.utils.clip_grad_norm_(list(full.parameters()), max_norm)
        results[max_norm] = {
            "norm": norm,
            "torch_norm": float(torch_norm),
            "grads": [p.grad.full_tensor() for p in model.parameters()],
            "torch_grads": [p.grad.clone() for p in full.parameters()],
            "all_reduce_calls": list(calls),
            "collectives": collectives,
        }
        sizes = [None] * dist.get_world_size()  # every rank's shard sizes, rank by rank
        dist.all_gather_object(sizes, [p.grad.to_local().numel() for p in model.parameters()])
        results[max_norm]["local_sizes"] = sizes
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads were seen to abort the interpreter's exit here ("terminate called without an
    # active exception", 1 run in 8 under CPU contention) after everything had succeeded: leave at once
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
