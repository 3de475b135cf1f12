"""The `strategy=fsdp` strategy: FSDP2 (torch's `fully_shard`) on Lightning's ModelParallelStrategy.

Why this and not Lightning's `FSDPStrategy`: that one wraps with FSDP1 and refuses
`accelerator="cpu"`, so it could not be run or tested on a CPU machine. `ModelParallelStrategy`
initialises the process group (gloo on CPU, NCCL on GPU; both when offloading on GPU:
`process_group_backend`), builds a device mesh, launches processes (its own launcher, torchrun or
SLURM), saves distributed checkpoints and restores them, and leaves the sharding to the
LightningModule's `configure_model`. This subclass fixes the mesh to pure data
parallelism (every rank one data-parallel shard, no tensor parallelism) and carries the sharding
settings, which `PolicyGradientModule.configure_model` applies through `shard`.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed import Backend
from torch.distributed.constants import default_pg_timeout

from loorl.training.checkpoints import atomic_directory


def process_group_backend(*, configured: str | None, device_type: str, offload: bool) -> str:
    """The backend `init_process_group` gets: `configured` when set, else the device's default (nccl
    on CUDA, gloo on CPU), with gloo added for CPU tensors when FSDP offloads to the CPU on another
    device (`cpu:gloo,cuda:nccl`). Offloaded gradients are CPU DTensors: torch's `clip_grad_norm_`,
    DTensor arithmetic and gathers of CPU shards run collectives on them, which NCCL alone refuses
    ("No backend type associated with device type cpu"). loorl's own clipping and gathers use the
    mesh's device either way (loorl.parallel.fsdp); gloo covers the rest. Untested on GPU."""
    if configured:
        return configured
    default = Backend.default_device_backend_map.get(device_type, "gloo")
    if offload and device_type != "cpu" and default != "gloo":
        return f"cpu:gloo,{device_type}:{default}"
    return default


class FSDPStrategy(ModelParallelStrategy):
    def __init__(
        self,
        *,
        layer_classes: list[str] | None = None,
        reshard_after_forward: bool = True,
        offload_params: bool = False,
        shard_reference: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.layer_classes = list(layer_classes) if layer_classes else None
        self.reshard_after_forward = reshard_after_forward
        self.offload_params = offload_params
        self.shard_reference = shard_reference

    def setup_environment(self) -> None:
        # every process a data-parallel rank (the parent's "auto" would mean one per node)
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def _get_process_group_backend(self) -> str:
        # what Lightning's ModelParallelStrategy._setup_distributed passes to init_process_group
        return process_group_backend(
            configured=self._process_group_backend,
            device_type=self.root_device.type,
            offload=self.offload_params,
        )

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A folder of shards, written beside the old one and swapped in (checkpoints.atomic_directory):
        a kill while writing leaves the previous checkpoint loadable."""
        if not self._save_distributed_checkpoint:  # one file, through the (atomic) checkpoint IO
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        target = Path(self.broadcast(str(filepath)))
        with atomic_directory(target, is_writer=self.global_rank == 0, barrier=self.barrier) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)

    def shard(self, model, *, offload: bool | None = None):
        """Shard `model` over all ranks (decoder layers one by one, then the root); `offload`
        overrides `offload_params` (the frozen reference follows `model.ref_offload` too)."""
        from loorl.parallel.fsdp import inner_model, layer_class_names, shard

        return shard(
            model,
            mesh=self.device_mesh["data_parallel"],
            layer_classes=layer_class_names(type(inner_model(model)), self.layer_classes),
            reshard_after_forward=self.reshard_after_forward,
            offload=self.offload_params if offload is None else offload,
        )
