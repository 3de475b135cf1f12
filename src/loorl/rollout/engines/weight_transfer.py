"""Weights from the trainer to vLLM servers, through vLLM's weight-transfer API.

vLLM 0.32 serves `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` and
`/finish_weight_update` (with `VLLM_SERVER_DEV_MODE=1`) and picks the backend that receives the bytes
from a registry (`vllm.distributed.weight_transfer.factory`), which a plugin may extend. Its built-in
backends (NCCL, CUDA IPC) need GPUs; this module registers one that runs anywhere:

`loorl_files`: the trainer writes the weights as safetensors shards into a folder every server can read
(`/dev/shm` on one node: shared memory; a shared file system across nodes), and each server's worker
loads them with vLLM's layerwise reload, the path its IPC backend takes. Chosen over gloo (a process
group between the trainer and each server's workers, whose rendezvous the servers' own start-up would
have to join) for having no rendezvous at all: a server that restarts, or one more server, needs
nothing but the folder. Measured in docs/performance/servers.md.

The worker side is loaded in every vLLM process by the `vllm.general_plugins` entry point `register`
(pyproject.toml); the trainer side drives the same four calls through vLLM's own trainer-engine
protocol (`TrainerWeightTransferEngine`, `VLLMWeightSyncClient`), so `nccl` is the same code with
another init info (GPU, untested: the project has had no GPU with vLLM).
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

FILES_BACKEND = "loorl_files"
SHARD_BYTES = 1 << 30  # one safetensors file per GiB of weights: the trainer holds one shard at a time


# ---- the worker side: in each vLLM server's worker process ------------------------------------------
@functools.cache
def _worker_classes():
    """The worker engine's classes, defined where vLLM is importable (the server's processes)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class FilesInitInfo(WeightTransferInitInfo):
        folder: str = ""  # where the trainer writes (for the server's log only: each update names its file)

    @dataclass
    class FilesUpdateInfo(WeightTransferUpdateInfo):
        path: str = ""  # one safetensors shard of the update

    class FilesWeightTransferEngine(WeightTransferEngine[FilesInitInfo, FilesUpdateInfo]):
        """Loads each shard the trainer names into the model, inside vLLM's layerwise reload."""

        init_info_cls = FilesInitInfo
        update_info_cls = FilesUpdateInfo

        def init_transfer_engine(self, init_info: FilesInitInfo) -> None:
            self.folder = init_info.folder

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # the base class's also syncs an
            # accelerator, which a CPU worker has not
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def receive_weights(self, update_info: FilesUpdateInfo) -> None:
            from safetensors import safe_open

            with safe_open(update_info.path, framework="pt", device=str(self.device)) as shard:
                self.model.load_weights((name, shard.get_tensor(name)) for name in shard.keys())

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            return None

    return FilesWeightTransferEngine


def register() -> None:
    """vLLM's general-plugin hook (run in every vLLM process): the `loorl_files` backend, both sides.
    Idempotent: vLLM may load plugins more than once per process."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if FILES_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(FILES_BACKEND, _worker_classes())
    if FILES_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(FILES_BACKEND, _trainer_classes()[1])


# ---- the trainer side -------------------------------------------------------------------------------
class FanOutClient:
    """vLLM's `VLLMWeightSyncClient` protocol over several servers: each call goes to every server (the
    `loorl_files` backend: each reads the same shards). `servers`: vLLM's own HTTP clients."""

    def __init__(self, urls: list[str], timeout: float = 600) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.clients = [HTTPVLLMWeightSyncClient(url, timeout=timeout) for url in urls]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        for c in self.clients:
            c.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        for c in self.clients:
            c.start_weight_update()

    def update_weights(self, update_info) -> None:
        for c in self.clients:
            c.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        for c in self.clients:
            c.finish_weight_update(weight_version)


@functools.cache
def _trainer_classes():
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

    @dataclass
    class FilesTrainerInitInfo(TrainerInitInfo):
        backend: ClassVar[str] = FILES_BACKEND
        folder: str = "/dev/shm"
        shard_bytes: int = SHARD_BYTES

    class FilesTrainerWeightTransferEngine(TrainerWeightTransferEngine[FilesTrainerInitInfo]):
        """Writes the source's tensors as safetensors shards into `folder` and has every server load
        each one (`update_weights` per shard); the shards are deleted once loaded. `bytes_sent`: the
        last update's bytes (the shards' tensors)."""

        init_info_cls = FilesTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            engine.folder, engine.shard_bytes = init_info.folder, init_info.shard_bytes
            if engine.is_sender:
                os.makedirs(engine.folder, exist_ok=True)
                client.init_weight_transfer_engine({"folder": engine.folder})
            return engine

        def send_weights(self, weight_version: str | None = None) -> None:
            """The full round trip: start, one `update_weights` per shard, finish (with the version)."""
            self.bytes_sent = 0
            if not self.is_sender:
                for _ in self.source:  # every rank iterates in step (FSDP gathers): only rank 0 writes
                    pass
                return
            self.client.start_weight_update()
            for shard in shards(self.source, self.shard_bytes):
                path = os.path.join(self.folder, f"loorl-weights-{uuid.uuid4().hex}.safetensors")
                write_shard(path, shard)
                try:
                    self.client.update_weights({"path": path})
                finally:
                    os.remove(path)
                self.bytes_sent += sum(t.numel() * t.element_size() for t in shard.values())
            self.client.finish_weight_update(weight_version)

    return FilesTrainerInitInfo, FilesTrainerWeightTransferEngine


def files_init_info(folder: str, *, rank: int = 0, shard_bytes: int = SHARD_BYTES):
    """The trainer-side init info of the `loorl_files` backend."""
    return _trainer_classes()[0](folder=folder, shard_bytes=shard_bytes, rank=rank)


def shards(tensors, limit: int) -> Iterator[dict[str, torch.Tensor]]:
    """(name, tensor) pairs grouped into dicts of at most `limit` bytes (a bigger tensor alone)."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > limit:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    if shard:
        yield shard


def write_shard(path: str, shard: dict[str, torch.Tensor]) -> None:
    """One safetensors file, written under a temporary name and renamed: a reader never sees half of it.
    Tied or shared tensors are written once each (safetensors refuses shared storage)."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp"
    save_file({k: v.detach().contiguous().cpu().clone() for k, v in shard.items()}, tmp)
    os.replace(tmp, path)


@dataclass
class PolicySource:
    """vLLM's `WeightSource` contract over loorl's weight stream (a list of (name, tensor) in the
    server's dtype), re-pointed before each send (`stream`): a fresh pass per iteration; `metadata()`
    (what the NCCL backend sizes its buffers from) read from the current stream."""

    stream: Any = ()

    def __iter__(self):
        return iter(self.stream)

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.stream]

    def held_names(self):
        return None

    def groups(self):
        from vllm.distributed.weight_transfer.base import layerwise_groups

        return layerwise_groups([m.name for m in self.metadata()])
