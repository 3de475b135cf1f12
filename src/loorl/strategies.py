"""Strategy factories that YAML cannot express directly."""

from __future__ import annotations

import importlib


def import_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def fsdp_strategy(
    *,
    layer_classes: list[str],
    sharding_strategy: str = "FULL_SHARD",
    cpu_offload: bool = False,
    state_dict_type: str = "sharded",
):
    """Lightning's FSDPStrategy with `auto_wrap_policy` as the Python set of layer classes it wants.

    Classes that cannot be imported (another architecture's module) are skipped.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    classes = set()
    for path in layer_classes:
        try:
            classes.add(import_class(path))
        except (ImportError, AttributeError):
            continue
    return FSDPStrategy(
        auto_wrap_policy=classes,
        activation_checkpointing_policy=None,
        sharding_strategy=sharding_strategy,
        cpu_offload=cpu_offload,
        state_dict_type=state_dict_type,
    )
