"""What the rest of loorl needs to know about a model sharded with FSDP2 (`torch.distributed.fsdp.
fully_shard`): which layers to shard, full weights for the rollout engines and the HF export.

Under FSDP each rank holds 1/W of every parameter (a DTensor shard) outside a forward pass. The
engines sample from full weights: the HF engine unshards the live model for the whole generation
phase (one all-gather per sharded module, at a point every rank reaches; no collective while it
generates, so ranks may generate different numbers of tokens), the vLLM engine copies full tensors
one parameter at a time (never a second full copy of the model).
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


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of the state dict, gathered one at a time on every rank
    (all ranks must iterate in step); plain tensors pass through."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict in CPU memory (a collective under FSDP: every rank calls it)."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unwrapped_class(model: torch.nn.Module) -> type:
    """The model's own class (fully_shard swaps in a subclass `FSDP<Name>`)."""
    cls = type(model)
    return cls.__mro__[2] if is_sharded(model) else cls
