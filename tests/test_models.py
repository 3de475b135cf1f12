"""The embedded tiny model: tokenizer round trip, deterministic cached build, reload."""

from __future__ import annotations

import torch
from hydra.utils import instantiate

from loorl.models.load import load_causal_lm, load_tokenizer
from loorl.models.tiny import build_char_tokenizer, ensure_tiny_model, tiny_model_dir


def test_char_tokenizer_round_trip(tmp_path):
    tok = build_char_tokenizer()
    text = "17+25=42 Janet's ducks: $3.50\n#### 18"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(str(tmp_path))
    assert again(text, add_special_tokens=False).input_ids == ids
    assert again.padding_side == "left" and again.decode([again.eos_token_id], skip_special_tokens=True) == ""


def test_the_tiny_models_folder_loads_its_own_tokenizer_spaces_included(tmp_path):
    """Beside the tiny model's config.json (a Qwen2 model), transformers 5.19's AutoTokenizer built a
    Qwen2Tokenizer from the character vocabulary, whose pre-tokenizer dropped every space: a prompt
    the warm start saw as "Spell this word" reached RL as "Spellthisword". The folder's own tokenizer
    is loaded instead, the same ids as the one the warm start used."""
    from transformers import Qwen2Config

    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tok), hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                intermediate_size=8).save_pretrained(tmp_path)  # fmt: skip
    text = "Spell this word backward (example: sun -> nus): cad"
    loaded = load_tokenizer(str(tmp_path))
    assert loaded(text, add_special_tokens=False).input_ids == tok(text, add_special_tokens=False).input_ids
    assert loaded.decode(loaded(text, add_special_tokens=False).input_ids) == text


def test_tiny_build_is_determined_by_its_config(quick_config, tmp_path):
    def at(cache, *overrides):
        return quick_config(f"model.cache_dir={cache}", *overrides)

    cfgs = [at(tmp_path / name, "model.tiny.warm_start.max_steps=3") for name in ("a", "b")]
    paths = []
    for i, cfg in enumerate(cfgs):
        torch.manual_seed(100 + i)  # a different global RNG state must not change the model
        paths.append(ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task)))
    a, b = (load_causal_lm(str(p), dtype="float32").state_dict() for p in paths)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert paths[0].name == paths[1].name == tiny_model_dir(cfgs[0].model, cfgs[0].task).name
    # a second call reuses the cache instead of rebuilding
    mtime = (paths[0] / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(cfgs[0].model, cfgs[0].task, None) == paths[0]
    assert (paths[0] / "model.safetensors").stat().st_mtime_ns == mtime
    # a different warm start is a different model
    other = at(tmp_path / "a", "model.tiny.warm_start.max_steps=4")
    assert tiny_model_dir(other.model, other.task) != paths[0]
    assert sum(p.numel() for p in a.values()) < 2_000_000
