"""LoRA on vLLM servers (`model.lora` with `rollout=vllm_server`): each policy version's adapter saved
as a peft folder and loaded on every server under a name of its own (`/v1/load_lora_adapter`), the
versions more than `max_staleness` behind unloaded. The folders live in a folder of the run's own
under `rollout.server.transfer_folder` (`/dev/shm` by default), removed at `close` or, for an engine
never closed, when it is collected or the process exits."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

from loorl.errors import ConfigError
from loorl.models.lora import PEFT_PREFIX
from loorl.rollout.engines.server_pool import ServerPool


def adapter_name(version: int) -> str:
    """The name a LoRA adapter of policy version `version` is loaded under on every server."""
    return f"loorl-v{version}"


def base_weights(module):
    """A peft model's base weights under the base model's names (no adapter entries)."""
    for name, tensor in module.state_dict().items():
        if ".lora_" in name:
            continue
        yield name.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."), tensor


class ServerAdapters:
    """The adapters loaded on every server: `loaded` (version -> name), saved under `root`, a folder
    made in `parent` at the first `load`."""

    def __init__(self, parent: str, *, max_staleness: int) -> None:
        self.parent, self.max_staleness = parent, max_staleness
        self.loaded: dict[int, str] = {}  # version -> adapter name, loaded on every server
        self.root: Path | None = None
        self._remove_root: weakref.finalize | None = None

    def folder(self) -> Path:
        """The run's adapter folder, made at the first call; removed by `close`, or when this object is
        collected or the process exits without it (a run that never closed its engine)."""
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="loorl-adapters-", dir=self.parent))
            self._remove_root = weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)
        return self.root

    def newest(self) -> str | None:
        """The name of the newest adapter (the one requests sample with); None without one."""
        return self.loaded[max(self.loaded)] if self.loaded else None

    def load(self, module, version: int, servers: ServerPool) -> int:
        """Save `module`'s adapter (a peft model's) as version `version` and load it on every server;
        unload the versions more than `max_staleness` behind. The bytes of the adapter's tensors."""
        folder = self.folder() / f"v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        state = {k: v for k, v in module.state_dict().items() if ".lora_" in k}
        module.save_pretrained(str(folder), state_dict=state)
        sent = sum(t.numel() * t.element_size() for t in state.values())
        name = adapter_name(version)
        if name in self.loaded.values():
            servers.post_all("/v1/unload_lora_adapter", json={"lora_name": name})
        try:
            servers.post_all("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
        except RuntimeError as err:
            raise ConfigError(
                f"model.lora: a rollout server refused the adapter ({str(err)[:160]}): start it with "
                "--enable-lora, --max-lora-rank of at least model.lora.r and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (scripts/cluster/serve.py does)"
            ) from None
        self.loaded[version] = name
        for old in [v for v in self.loaded if v < version - self.max_staleness]:
            servers.post_all("/v1/unload_lora_adapter", json={"lora_name": self.loaded.pop(old)})
            shutil.rmtree(self.root / f"v{old}", ignore_errors=True)
        return sent

    def close(self) -> None:
        """Forget the loaded adapters and remove their folder."""
        self.loaded = {}
        if self._remove_root is not None:
            self._remove_root()
            self.root = self._remove_root = None
