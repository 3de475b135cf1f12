"""Loading a tokenizer and a causal LM from a resolved model path, in a named dtype."""

from __future__ import annotations

import torch

from loorl.errors import ConfigError
from loorl.util.onednn import cap_onednn_primitive_cache

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, *, dtype: str, attn_implementation: str | None = None, trainable: bool = True):
    """The model at `path` in `dtype`. oneDNN's cache is capped first: the model's products may be
    the process's first bf16 ones (a script or notebook that loads without the CLI)."""
    from transformers import AutoModelForCausalLM

    cap_onednn_primitive_cache()

    kwargs = {"dtype": torch_dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not trainable:
        model.eval().requires_grad_(False)
    return model
