"""Loading a tokenizer and a causal LM from a resolved model path, in a named dtype."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loorl.errors import ConfigError
from loorl.util.onednn import cap_onednn_primitive_cache

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # tokenizer.json as it is


def declared_tokenizer_class(path: str) -> str | None:
    """The `tokenizer_class` a local folder's tokenizer_config.json declares (None: none, or not local)."""
    config = Path(path) / "tokenizer_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("tokenizer_class")


def load_tokenizer(path: str):
    """The tokenizer at `path`, padding on the left.

    A folder that declares the generic fast tokenizer (tokenizer.json with its own pre-tokenizer, as
    the tiny model's character-level one) is loaded as exactly that: transformers 5.19's AutoTokenizer
    picks the class of the model's type instead (Qwen2Tokenizer for the tiny Qwen2 model), whose
    pre-tokenizer dropped every space of the tiny model's prompts."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if declared_tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES:
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
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
