"""What the rest of loorl needs to know about a model sharded with FSDP2 (`torch.distributed.fsdp.
fully_shard`): which layers to shard, full weights for the rollout engines and the HF export.

Under FSDP each rank holds 1/W of every parameter (a DTensor shard) outside a forward pass. The
engines sample from full weights: the HF engine unshards the live model for the whole generation
phase (one all-gather per sharded module, at a point every rank reaches; no collective while it
generates, so ranks may generate different numbers of tokens), the vLLM engine copies full tensors
one parameter at a time (never a second full copy of the model).

With CPU offload (`trainer.strategy.offload_params`) the shards and their gradients live in CPU
memory while the device mesh (and its NCCL group, on GPUs) is CUDA's: a collective over a CPU tensor
on an NCCL-only group fails ("No backend type associated with device type cpu"). Everything here
that communicates therefore moves its tensors to the mesh's device first (gathers) or reduces one
scalar there (gradient clipping); `FSDPStrategy` adds gloo for whatever else does (torch's own
`clip_grad_norm_`, DTensor arithmetic). Offload on CUDA is untested on GPU: the project has none.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside an adapter wrapper (peft's `PeftModel.get_base_model`), else the
    model itself: its class names the decoder layers and writes `config.architectures`."""
    return model.get_base_model() if hasattr(type(model), "get_base_model") else model


def layer_class_names(model_class: type, configured: list[str] | None) -> list[str]:
    """The module classes sharded one by one: the configured names, else the model's own
    `_no_split_modules` (its decoder layer: transformers' unit of sharding and offloading)."""
    if configured:
        return list(configured)
    return list(getattr(model_class, "_no_split_modules", None) or [])


def shard(
    model: torch.nn.Module,
    *,
    mesh,
    layer_classes: list[str],
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> torch.nn.Module:
    """`fully_shard` each module whose class is named in `layer_classes`, then the whole model (the
    embeddings, final norm and a tied head stay in the root's group). `offload`: parameters,
    gradients and optimizer state in CPU memory between uses (FSDP2's CPUOffloadPolicy; on a CPU
    device this changes nothing)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    names = set(layer_classes)
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"strategy=fsdp: {type(model).__name__} has no module of class {sorted(names)}; "
            "name its decoder-layer class in strategy.layer_classes"
        )
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "offload_policy": policy}
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model._loorl_reshard_after_forward = reshard_after_forward  # restored after each generation phase
    return model


def unshard_for_generation(model: torch.nn.Module) -> None:
    """All-gather every sharded module's parameters and keep them until `reshard_after_generation`:
    generation then runs many forward passes without a collective."""
    modules = _fsdp_modules(model)
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    for m in modules:
        m.unshard()


def reshard_after_generation(model: torch.nn.Module) -> None:
    """Back to training: free the gathered parameters; layers reshard after forward as configured
    again (the root keeps FSDP's default of not resharding: backward needs its parameters first)."""
    configured = getattr(model, "_loorl_reshard_after_forward", True)
    for m in _fsdp_modules(model):
        m.set_reshard_after_forward(configured and m is not model, recurse=False)
        m.reshard()


def mesh_device(mesh) -> torch.device:
    """The device a collective over `mesh` runs on: the mesh's own type (CUDA's current device on a
    GPU mesh), wherever the tensors themselves live."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of the state dict, gathered one at a time on every rank
    (all ranks must iterate in step); plain tensors pass through. An offloaded (CPU) shard is moved to
    the mesh's device before its all-gather, so the full tensor is on the GPU there (untested on GPU)."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            device = mesh_device(tensor.device_mesh)
            tensor = (tensor if tensor.device == device else tensor.to(device)).full_tensor()
        yield name, tensor.detach()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict in CPU memory (a collective under FSDP: every rank calls it). torch's
    gather moves offloaded CPU shards to the mesh's device itself (`_gather_state_dict`)."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unwrapped_class(model: torch.nn.Module) -> type:
    """The model's own class (fully_shard swaps in a subclass `FSDP<Name>`)."""
    cls = type(model)
    return cls.__mro__[2] if is_sharded(model) else cls


def _sharded_grads(grads: list[torch.Tensor]):
    """The mesh of `grads` when each is a DTensor whose local shards partition it over one 1-D mesh
    (FSDP2's Shard(0)): then the squared norms of the local shards sum to the full one. Else None."""
    from torch.distributed.tensor import DTensor

    if not grads or not all(isinstance(g, DTensor) for g in grads):
        return None
    mesh = grads[0].device_mesh
    if mesh.ndim != 1 or any(g.device_mesh != mesh or not g.placements[0].is_shard() for g in grads):
        return None
    return mesh


@torch.no_grad()
def clip_grad_norm_(params: list[torch.nn.Parameter], *, max_norm: float) -> float:
    """Scale the gradients of `params` so that their global 2-norm is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` does; returns the norm before clipping.

    Under FSDP each rank sums the squared norms of its own gradient shards and one float64 scalar is
    all-reduced on the mesh's device: the norm of the full gradient, with no collective over the
    gradients themselves. torch's version all-reduces DTensor norms on the gradients' device, the CPU
    under offload, which an NCCL-only group refuses. Plain tensors (one process, DDP's all-reduced
    gradients) and other DTensor layouts go to torch's."""
    grads = [p.grad for p in params if p.grad is not None]
    mesh = _sharded_grads(grads)
    if mesh is None:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    import torch.distributed as dist

    shards = [g.to_local() for g in grads]  # this rank's rows of each gradient (CPU when offloaded)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for shard in shards:
        by_device.setdefault(shard.device, []).append(shard)
    device = mesh_device(mesh)
    squares = [  # [] one sum of squared norms per device the shards live on
        torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in ts]).double().square().sum()
        for ts in by_device.values()
    ]
    total = torch.stack([s.to(device) for s in squares]).sum()  # [] this rank's squared norm
    dist.all_reduce(total, group=mesh.get_group())  # [] the full gradient's squared norm
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)  # as torch: a non-finite norm makes every gradient non-finite
    if not coef >= 1.0:
        for ts in by_device.values():
            torch._foreach_mul_(ts, coef)
    return norm
