"""LoRA policies with peft: adapters over frozen base weights, the base model as a free reference, and
the merged weights that a copying engine (vLLM) and the export receive.

- `apply_lora(model, lora, seed=)`: peft's `get_peft_model` over the loaded policy; only the adapters
  train. Their initial values (A Kaiming-uniform, B zero: peft's defaults) come from torch's CPU
  generator seeded with the run's seed inside `fork_rng`: every rank and every resume builds the same
  adapters, and the run's own random stream is left as it was.
- `AdapterFreeReference`: the KL reference is the policy itself under peft's `disable_adapter()`, no
  second model. B is zero at the start, so the policy is its reference bit for bit and the KL is 0.
- `merged_weights(tensors, scalings=)`: the base model's (name, tensor) pairs, each adapted linear's
  weight W + (B @ A) * scale, computed one layer at a time from a stream of the peft model's entries
  (gathered one at a time under FSDP), never modifying the live model.
- `check_target_modules`: every target names a linear layer of the model, in one line otherwise; before
  any model loads from its config alone (`check_lora`, a module tree on the meta device), and
  again on the loaded model.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from loorl.algo.logprobs import FrozenReference
from loorl.errors import ConfigError
from loorl.settings import LoraSettings, ModelSettings

PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model, in state-dict names
ADAPTER = "default"  # peft's name of the one adapter loorl trains


def is_lora(model) -> bool:
    """Whether `model` is a peft model (also when FSDP has swapped in its subclass). Imports nothing:
    a model can only be one if peft was imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


# ---- targets -----------------------------------------------------------------------------------
def linear_names(model: torch.nn.Module) -> list[str]:
    """The names of the model's `nn.Linear` modules (the layers LoRA can adapt here)."""
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def matches(name: str, target: str) -> bool:
    """peft's rule for a list of target names: the module's name, or its last dotted parts."""
    return name == target or name.endswith("." + target)


def check_target_modules(
    targets: Iterable[str], linear: list[str], *, model_name: str, tied_output: str | None = None
) -> None:
    """One ConfigError line unless every target matches a linear layer in `linear`. `tied_output`: the
    output layer's name when it shares the input embedding's weight, which an adapter would untie (an
    engine that loads tied weights would then sample without it)."""
    targets = list(targets)
    missing = [t for t in targets if not any(matches(n, t) for n in linear)]
    if missing:
        leaves = sorted({n.rpartition(".")[2] for n in linear})
        raise ConfigError(
            f"model.lora.target_modules={targets}: {model_name} has no linear layer named "
            f"{', '.join(missing)}; name some of its linear layers: {', '.join(leaves)}"
        )
    if tied_output is not None and any(matches(tied_output, t) for t in targets):
        raise ConfigError(
            f"model.lora.target_modules={targets} adapts {tied_output}, which {model_name} ties to its input "
            "embedding: leave it out of model.lora.target_modules"
        )


def check_targets_in(model: torch.nn.Module, targets: Iterable[str]) -> None:
    """`check_target_modules` against `model`'s own linear layers and tied output layer."""
    check_target_modules(
        targets, linear_names(model), model_name=type(model).__name__, tied_output=tied_output_name(model)
    )


def tied_output_name(model: torch.nn.Module) -> str | None:
    """The output layer's module name when its weight is the input embedding's, else None."""
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or emb is None or out.weight is not emb.weight:
        return None
    return next(name for name, module in model.named_modules() if module is out)


def skeleton(model: ModelSettings) -> torch.nn.Module | None:
    """The policy's module tree on the meta device (no weights, no memory) from its config alone; None
    where the config cannot be read without fetching or building anything (a GGUF model before its
    conversion, a hub model outside the local cache): `apply_lora` checks the loaded model then."""
    from transformers import AutoModelForCausalLM

    from loorl.models.sources import model_config

    config = model_config(model)
    if config is None:
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_lora(model: ModelSettings) -> None:
    """peft is installed and `model.lora.target_modules` name linear layers of the model, checked before
    any weights load; one ConfigError line otherwise."""
    if model.lora is None:
        return
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError('model.lora needs the peft package: pip install -e ".[lora]" (or model.lora=null)')
    if (tree := skeleton(model)) is not None:
        check_targets_in(tree, model.lora.target_modules)


# ---- building ----------------------------------------------------------------------------------
def apply_lora(model, lora: LoraSettings, *, seed: int, under_autocast: bool = False):
    """`model` (a transformers causal LM, its own weights frozen by peft) with LoRA adapters on the
    target layers: a `PeftModel`. The adapters' initial values are a function of `seed` alone.

    `under_autocast`: every pass runs under a lower-precision autocast (`model.dtype` below float32).
    peft then casts each adapted layer's input to the adapters' float32 and autocast casts it back for
    the matmul: a lossless round trip (bf16 -> float32 -> bf16) that keeps a copy of the input per
    adapted layer alive for the backward, seven per decoder layer. Without the cast the adapters read
    the input the base layer saved already: the same values and gradients, bit for bit, and 11% fewer
    bytes kept for the tiny model's backward (tested). SmolLM2's LoRA run (10 steps, bf16) peaked at
    12.3 GB resident either way: its peak is elsewhere (docs/how-to/lora.md)."""
    from peft import LoraConfig, get_peft_model

    check_targets_in(model, lora.target_modules)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    if under_autocast:
        # peft's per-layer switch, the one peft.helpers.disable_input_dtype_casting flips for a block
        for module in peft_model.modules():
            if hasattr(module, "cast_input_dtype_enabled"):
                module.cast_input_dtype_enabled = False
    return peft_model


def adapter_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapters' (name, parameter) pairs: the parameters that train."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_" in n]


def frozen_names(model) -> set[str]:
    """The state-dict names of the frozen parameters (tied ones under each of their names)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


@contextmanager
def adapters_disabled(model):
    """The block runs the base model: peft's `disable_adapter()`, under no_grad."""
    with torch.no_grad(), model.disable_adapter():
        yield


class AdapterFreeReference(FrozenReference):
    """The reference policy for free: the policy's own base weights, scored with the adapters switched
    off (`adapters_disabled`) by the same function as a `FrozenReference`. No second model exists.

    The KL then compares two passes of the trainer's own scoring (`kl_from_policy_pass`), which differ
    only by the adapters: exactly 0 while B is 0, and free of the sampler's rounding noise (an HF
    sampler's decode-step log-probs differ from a full-sequence pass by ~1e-7 per token)."""

    kl_from_policy_pass = True

    def __init__(self, policy) -> None:
        super().__init__(policy, offload=False)

    def completion_logprobs(self, batch, *, device: torch.device, **score) -> torch.Tensor:
        with adapters_disabled(self.model):
            return super().completion_logprobs(batch, device=device, **score)  # [N, C]


# ---- merged weights ----------------------------------------------------------------------------
def lora_scalings(model) -> dict[str, float]:
    """Each adapted layer's base-model name -> its scale (alpha / r), as peft holds it."""
    from peft.tuners.lora import LoraLayer

    return {
        name.removeprefix(PEFT_PREFIX): module.scaling[ADAPTER]
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


def _lora_part(name: str) -> tuple[str | None, str | None]:
    """(adapted layer, part) of a peft state-dict name without its prefix: part is `weight` or `bias`
    of the base layer, or `A` or `B`; (None, None) for an entry outside any adapted layer."""
    if ".base_layer." in name:
        layer, _, part = name.rpartition(".base_layer.")
        return layer, part
    for part in ("A", "B"):
        suffix = f".lora_{part}.{ADAPTER}.weight"
        if name.endswith(suffix):
            return name.removesuffix(suffix), part
    if ".lora_" in name:
        raise ValueError(f"{name}: a LoRA entry loorl does not merge (only linear layers' A and B)")
    return None, None


def merged_weights(
    tensors: Iterable[tuple[str, torch.Tensor]], *, scalings: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's state dict with the adapters merged, from the peft model's (name, tensor) stream.

    Names lose the `base_model.model.` prefix and `.base_layer`; an adapted layer's weight is yielded
    once its W, A and B have all arrived (peft registers them in that order, so at most one layer is
    held), as W + (B @ A) * scale in at least float32 (a bf16 W would round the update away); no
    `lora_` entry is yielded. New tensors only: the live model is not modified."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        name = name.removeprefix(PEFT_PREFIX)
        layer, part = _lora_part(name)
        if layer is None:
            yield name, tensor
            continue
        if part == "bias":
            yield f"{layer}.bias", tensor
            continue
        parts = pending.setdefault(layer, {})
        parts[part] = tensor
        if len(parts) == 3:
            del pending[layer]
            w, a, b = parts["weight"], parts["A"], parts["B"]  # [out, in], [r, in], [out, r]
            dtype = torch.promote_types(w.dtype, torch.float32)
            merged = torch.addmm(w.to(dtype), b.to(dtype), a.to(dtype), alpha=scalings[layer])  # [out, in]
            yield f"{layer}.weight", merged
    if pending:
        raise ValueError(f"LoRA layers without all of W, A and B in the weight stream: {sorted(pending)[:3]}")


def save_lora(model, *, merged_dir, adapter_dir, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write a LoRA policy twice: the adapters in peft's format to `adapter_dir`
    (`PeftModel.from_pretrained(base, adapter_dir)`), and the merged model to `merged_dir`, a plain
    Hugging Face folder that `from_pretrained` loads and that scores as the adapted policy. `state`: the
    peft model's full state dict (gathered under FSDP; its own `state_dict()` when None). A merged layer is
    float32 whatever the base's dtype (`merged_weights`); a low-precision base is then written float32."""
    import copy

    from loorl.parallel.fsdp import inner_model

    state = model.state_dict() if state is None else state
    model.save_pretrained(adapter_dir, state_dict={k: v for k, v in state.items() if ".lora_" in k})
    merged = dict(merged_weights(state.items(), scalings=lora_scalings(model)))
    base = inner_model(model)
    if any(t.is_floating_point() and t.dtype != torch.float32 for t in merged.values()):
        merged = {k: t.float() if t.is_floating_point() else t for k, t in merged.items()}
        base.save_pretrained(merged_dir, state_dict=merged)
        config = copy.deepcopy(base.config)
        config.dtype = torch.float32
        config.save_pretrained(merged_dir)
    else:
        base.save_pretrained(merged_dir, state_dict=merged)
