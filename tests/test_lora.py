"""LoRA policies (`model.lora`, peft): only the adapters train, the reference is the base weights with the
adapters off (no second model; the KL starts at exactly 0), the HF engine samples the adapted policy, a
copying engine receives merged weights under the base model's names, checkpoints hold the adapters and
their optimizer state only, and the export is a merged HF model plus a peft adapter folder.

One real quick run (`train`, 2 RL steps, LoRA r 4, KL in the reward) is the fixture; its checkpoint is
loaded into a fresh module for the tests that need the trained policy in hand.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hydra.utils import instantiate

from fixtures import ON_CPU
from loorl.algo.logprobs import completion_logprobs
from loorl.build import build_datamodule, build_module
from loorl.cli.train import train
from loorl.models.load import load_causal_lm, load_tokenizer
from loorl.models.lora import AdapterFreeReference, adapter_parameters, apply_lora, is_lora
from loorl.models.tiny import ensure_tiny_model
from loorl.rollout.engines.base import PolicyWeights
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.settings import LORA_DEFAULT_TARGETS, LoraSettings

pytest.importorskip("peft")

LORA = ("model.lora={r: 4}", "kl.coef=0.05")  # KL folded into the reward: the reference is needed
RUN = ("rl.steps=2", "val_every=2", "checkpoint_every=1", *ON_CPU)


@dataclass
class Trained:
    module: Any
    tok: Any
    path: str
    batch: Any  # RolloutBatch
    prompts: list[list[int]]


@pytest.fixture(scope="module")
def lora_run(quick_config, tmp_path_factory):
    """`python src/train.py debug=quick model.lora='{r: 4}' kl.coef=0.05 rl.steps=2 ...`: the run folder."""
    run = tmp_path_factory.mktemp("lora") / "run"
    train(quick_config(*LORA, *RUN, output_dir=run))
    return run


@pytest.fixture(scope="module")
def trained(quick_config, lora_run):
    """A fresh module with the run's last checkpoint loaded (the adapters after 2 steps), its tokenizer
    and model path, a rollout batch sampled from it with the HF engine, and that step's prompts."""
    cfg = quick_config(*LORA, *RUN, output_dir=lora_run)
    task = instantiate(cfg.task)
    path = str(ensure_tiny_model(cfg.model, cfg.task, task))
    tok = load_tokenizer(path)
    module = build_module(cfg, path)
    module.configure_model()
    ckpt = torch.load(lora_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    module.load_state_dict(ckpt["state_dict"])  # strict: only the frozen base weights may be missing
    dm = build_datamodule(cfg, task, tok, path)
    dm.engine.sync(PolicyWeights(module.policy))
    batch = dm.rollout_for_step(step=0).batch
    prompts = [tok(p.text, add_special_tokens=False).input_ids for p in dm.sampler.prompts_for_step(0)]
    return Trained(module, tok, path, batch, prompts)


def _logprobs(model, batch, module) -> torch.Tensor:
    with torch.no_grad():
        return completion_logprobs(model, batch, sampling=module.sampling)  # [N, C]


def _history(run) -> dict:
    return json.loads((run / "metrics.json").read_text())["history"]


# ---- config ------------------------------------------------------------------------------------
def test_every_model_config_has_lora_off_by_default(make_config):
    from loorl.config import CONF_DIR, load_settings

    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        cfg = make_config(f"model={path.stem}")
        assert "lora" in cfg.model and cfg.model.lora is None, path.name
    lora = load_settings(make_config("model.lora={r: 8}")).model.lora
    assert lora == LoraSettings(r=8) and lora.lora_alpha == 16 and lora.target_modules == LORA_DEFAULT_TARGETS


def test_a_target_the_loaded_model_lacks_fails_in_one_line(quick_config):
    """The same check as before loading (tests/test_config_errors.py), on the model itself: where its
    config could not be read beforehand (a GGUF model before its conversion)."""
    from loorl.errors import ConfigError

    cfg = quick_config()
    path = ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task))
    model, lora = load_causal_lm(str(path), dtype="float32"), LoraSettings(target_modules=("q_proj", "qkv"))
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['q_proj', 'qkv'\]: .* qkv; ") as err:
        apply_lora(model, lora, seed=0)
    assert "\n" not in str(err.value)


def test_the_adapters_start_as_a_function_of_the_seed_alone(quick_config):
    cfg = quick_config()
    path = str(ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task)))

    def adapters(seed):
        model = apply_lora(load_causal_lm(path, dtype="float32"), LoraSettings(r=4), seed=seed)
        return {n: p.detach().clone() for n, p in adapter_parameters(model)}

    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    first = adapters(0)
    assert torch.equal(torch.rand(3), before)  # the global stream is left as it was
    torch.manual_seed(999)
    again, other = adapters(0), adapters(1)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert any(not torch.equal(first[n], other[n]) for n in first if ".lora_A." in n)
    assert all(not t.any() for n, t in first.items() if ".lora_B." in n)  # B = 0: the base model exactly


# ---- the optimizer, the reference, the KL --------------------------------------------------------
def test_the_kl_is_exactly_zero_at_the_first_step(lora_run):
    kl = [v for _, v in _history(lora_run)["rollout/kl"]]
    assert kl[0] == 0.0  # B = 0: the policy is its reference bit for bit, scored by the same function
    assert kl[1] != 0.0  # after one update the adapters move the policy


def test_the_optimizer_holds_only_the_adapters(lora_run, trained):
    module = trained.module
    ckpt = torch.load(lora_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    (opt,) = ckpt["optimizer_states"]
    adapters = adapter_parameters(module.policy)
    assert sum(len(g["params"]) for g in opt["param_groups"]) == len(adapters)
    moments = sum(s["exp_avg"].numel() for s in opt["state"].values())
    assert moments == sum(p.numel() for _, p in adapters)
    trainable = [p for p in module.policy.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == moments  # what configure_optimizers passes (requires_grad)
    assert moments < 0.1 * sum(p.numel() for p in module.policy.parameters())


def test_no_second_copy_of_the_base_weights_exists(trained):
    module = trained.module
    reference = module.reference
    assert isinstance(reference, AdapterFreeReference) and reference.model is module.policy
    own = {p.untyped_storage().data_ptr() for p in module.parameters()}
    every = own | {p.untyped_storage().data_ptr() for p in reference.parameters()}
    assert every == own  # the reference adds no storage
    base = sum(p.numel() for p in load_causal_lm(module.model_path, dtype="float32").parameters())
    adapters = sum(p.numel() for _, p in adapter_parameters(module.policy))
    assert sum(p.numel() for p in module.parameters()) == base + adapters  # one base, plus the adapters
    assert not [m for m in vars(module).values() if isinstance(m, torch.nn.Module) and m is not module.policy]


def test_reference_logprobs_are_a_separately_loaded_base_models(trained):
    module, path, batch = trained.module, trained.path, trained.batch
    mask = batch.completion_mask.bool()  # [N, C]
    ref = module.reference.completion_logprobs(batch, device=torch.device("cpu"), sampling=module.sampling)
    base = _logprobs(load_causal_lm(path, dtype="float32"), batch, module)  # [N, C]
    assert (ref[mask] - base[mask]).abs().max() < 1e-6
    policy = _logprobs(module.policy, batch, module)  # the adapters are back on after the reference pass
    assert (policy[mask] - base[mask]).abs().max() > 1e-3
    assert all(p.requires_grad for _, p in adapter_parameters(module.policy))


# ---- the samplers ------------------------------------------------------------------------------
def test_the_hf_engine_samples_the_adapted_policy(trained):
    module, tok, path, batch, prompts = vars(trained).values()
    mask = batch.completion_mask.bool()
    # the fixture's batch was sampled by the run's HF engine synced to the module's policy
    policy = _logprobs(module.policy, batch, module)
    assert (policy[mask] - batch.sampler_logprobs[mask]).abs().max() < 1e-4
    base = _logprobs(load_causal_lm(path, dtype="float32"), batch, module)
    assert (base[mask] - batch.sampler_logprobs[mask]).abs().max() > 1e-3
    # ... and a fresh engine on the base model draws other samples for the same seed
    engine = HFEngine(module.sampling, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    engine.sync(PolicyWeights(module.policy))
    adapted = engine.generate(prompts, n=4, seed=5)
    engine.sync(PolicyWeights(load_causal_lm(path, dtype="float32")))
    assert engine.generate(prompts, n=4, seed=5) != adapted


def test_merged_weights_are_pefts_merge_under_the_base_models_names(trained):
    module, path = trained.module, trained.path
    live = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    streamed = list(PolicyWeights(module.policy))
    merged = dict(streamed)
    assert len(merged) == len(streamed)  # each name once
    expected = copy.deepcopy(module.policy).merge_and_unload().state_dict()
    base = load_causal_lm(path, dtype="float32").state_dict()
    assert set(merged) == set(expected) == set(base)  # (an adapted weight comes after its bias)
    assert not [n for n in merged if "lora_" in n or ".base_layer" in n or n.startswith("base_model.")]
    for name, tensor in merged.items():
        assert tensor.shape == base[name].shape, name
        assert torch.allclose(tensor, expected[name], rtol=0, atol=1e-6), name
    assert any(not torch.equal(merged[n], base[n]) for n in base if "q_proj" in n)  # adapters in them
    # the live model is untouched: still unmerged adapters, the same values
    assert is_lora(module.policy) and all(
        torch.equal(p, live[n]) for n, p in module.policy.named_parameters()
    )
    assert not any(getattr(m, "merged", False) for m in module.policy.modules())


# ---- durability --------------------------------------------------------------------------------
def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(lora_run, trained):
    module = trained.module
    last = lora_run / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)["state_dict"]
    adapters = {f"policy.{n}" for n, _ in adapter_parameters(module.policy)}
    assert set(state) == adapters
    base_bytes = 4 * sum(p.numel() for p in load_causal_lm(module.model_path, dtype="float32").parameters())
    adapter_bytes = 4 * sum(p.numel() for _, p in adapter_parameters(module.policy))
    # weights + AdamW's two moments of the adapters, and the run's metadata; no base weight
    assert last.stat().st_size < 3 * adapter_bytes + 200_000 < base_bytes


def test_the_export_is_a_merged_model_and_a_peft_adapter(lora_run, trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    module, path, batch = trained.module, trained.path, trained.batch
    mask = batch.completion_mask.bool()
    policy = _logprobs(module.policy, batch, module)
    merged = AutoModelForCausalLM.from_pretrained(lora_run / "policy")
    assert not is_lora(merged)
    assert (_logprobs(merged, batch, module)[mask] - policy[mask]).abs().max() < 1e-5
    adapter = lora_run / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    reloaded = PeftModel.from_pretrained(load_causal_lm(path, dtype="float32"), adapter)
    assert (_logprobs(reloaded, batch, module)[mask] - policy[mask]).abs().max() < 1e-6


def test_a_checkpoint_is_resumed_or_evaluated_only_with_its_adapters(quick_config, lora_run, tmp_path):
    from loorl.cli.evaluate import evaluate
    from loorl.config import compose_config
    from loorl.errors import ConfigError

    last = lora_run / "checkpoints" / "last.ckpt"
    for i, other in enumerate(("model.lora=null", "model.lora={r: 8}")):
        cfg = quick_config(
            other, "kl.coef=0.05", f"resume_from={last}", *ON_CPU, output_dir=tmp_path / str(i)
        )
        with pytest.raises(ConfigError, match=r"was written with lora 'r=4 target_modules=q_proj,") as err:
            train(cfg)
        assert "\n" not in str(err.value)

    def eval_cfg(*overrides):
        cache = quick_config().model.cache_dir
        quick = ("debug=quick", "rollout=hf", f"model.cache_dir={cache}", "trainer.enable_progress_bar=false")
        return compose_config(f"output_dir={tmp_path / 'eval'}", *quick, f"policy={last}", "eval.samples=0",
                              *overrides, config_name="eval")  # fmt: skip

    with pytest.raises(
        ConfigError, match=r"holds weights for model.lora 'r=4 .* pass the model.lora setting"
    ):
        evaluate(eval_cfg())
    results = evaluate(eval_cfg(*LORA[:1]))  # the adapters over the base model, as trained
    assert results["metrics"]["pass@1_greedy"] == _history(lora_run)["val/accuracy"][-1][1]


# ---- memory options ----------------------------------------------------------------------------
def test_gradient_checkpointing_gives_the_adapters_their_gradients(trained):
    """Frozen embeddings feed the checkpointed layers an input that needs no gradient: the adapters
    inside them must still get theirs, the same as without checkpointing."""
    module, path, batch = trained.module, trained.path, trained.batch

    def adapter_grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = load_causal_lm(path, dtype="float32").train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model = apply_lora(model, LoraSettings(r=4), seed=0)
        with torch.no_grad():  # B != 0, so that A gets a gradient too
            for name, p in adapter_parameters(model):
                p.copy_(dict(adapter_parameters(module.policy))[name])
        logp = completion_logprobs(model, batch, sampling=module.sampling)  # [N, C]
        (logp * batch.completion_mask).sum().backward()
        return {n: p.grad for n, p in adapter_parameters(model)}

    plain, checkpointed = adapter_grads(False), adapter_grads(True)
    for name, g in plain.items():
        assert g is not None and g.abs().max() > 0, name
        assert checkpointed[name] is not None, name
        assert (checkpointed[name] - g).abs().max() <= 1e-5 * g.abs().max(), name


def test_under_autocast_the_adapters_read_the_bf16_input_the_base_saved(trained):
    """Without peft's float32 cast of each adapted layer's input (a lossless round trip under bf16
    autocast) the loss and every adapter gradient are the same bit for bit, and the backward keeps
    fewer bytes alive."""
    module, path, batch = trained.module, trained.path, trained.batch

    def run(under_autocast: bool):
        model = load_causal_lm(path, dtype="bfloat16").train()
        model = apply_lora(
            model, LoraSettings(r=4, base_dtype="bfloat16"), seed=0, under_autocast=under_autocast
        )
        with torch.no_grad():  # B != 0, so that A gets a gradient too
            for name, p in adapter_parameters(model):
                p.copy_(dict(adapter_parameters(module.policy))[name])
        saved: dict[int, int] = {}

        def keep(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with (
            torch.autocast("cpu", dtype=torch.bfloat16),
            torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
        ):
            logp = completion_logprobs(model, batch, sampling=module.sampling)  # [N, C]
            loss = (logp * batch.completion_mask).sum()
        loss.backward()
        return loss.item(), {n: p.grad for n, p in adapter_parameters(model)}, sum(saved.values())

    cast_loss, cast_grads, cast_bytes = run(False)
    loss, grads, saved_bytes = run(True)
    assert loss == cast_loss
    for name, g in cast_grads.items():
        assert torch.equal(grads[name], g), name
    print(f"bytes kept for the backward: {cast_bytes:,} with peft's cast, {saved_bytes:,} without")
    assert saved_bytes < 0.9 * cast_bytes
