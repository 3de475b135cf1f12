"""Peak memory of one rollout with a reference model, on a model with a 32k vocabulary.

Run as a script in a fresh process (`python tests/memory_probe.py CACHE_DIR GROUPS_PER_PASS`): it
prints the rise of the process's peak resident memory during `RolloutDataModule.rollout_for_step`, in MiB.
A separate process is the only clean way to read a peak on CPU (the process's high-water mark, kept
by `loorl.util.peak_memory` across the phase clock's restarts of it, is what earlier work left too).
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

VOCAB = 32_000


def build_model(path: Path) -> None:
    """A 1-layer Qwen2 model (head_dim 64) with a 32k vocabulary and a matching tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    chars = sorted(set(string.printable))
    names = ["<pad>", "<eos>", "<unk>", *chars]
    names += [f"<x{i}>" for i in range(VOCAB - len(names))]  # decodable, never produced by encoding
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(names)}, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def main(cache: str, groups_per_pass: int) -> None:
    import torch
    from hydra.utils import instantiate

    from loorl.build import build_datamodule, build_module
    from loorl.config import compose_config
    from loorl.models.load import load_tokenizer
    from loorl.util.peak_memory import host_peak_bytes

    torch.manual_seed(0)
    model_dir = Path(cache) / "vocab32k"
    if not (model_dir / "config.json").exists():
        build_model(model_dir)
    cfg = compose_config(
        "debug=quick",
        f"model.cache_dir={cache}",
        "output_dir=/tmp/loorl-memory-probe",
        f"model.name_or_path={model_dir}",
        "rollout=hf",
        "kl.coef=0.01",  # a reference model, scored over the whole rollout
        "rl.prompts_per_step=64",
        "rl.samples_per_prompt=4",
        "rl.prompts_per_minibatch=32",  # two optimizer steps per rollout: old log-probs too
        f"rl.prompts_per_microbatch={groups_per_pass}",
        "rollout.batch_size=16",
        "rollout.max_new_tokens=64",
    )
    task = instantiate(cfg.task)
    tok = load_tokenizer(str(model_dir))
    module = build_module(cfg, str(model_dir))
    module.configure_model()
    dm = build_datamodule(cfg, task, tok, str(model_dir))
    dm.setup("fit")
    before = host_peak_bytes() / 1024  # KiB
    dm.engine.sync(module.policy)
    rollout = dm.rollout_for_step(step=0)  # generation
    batch, _ = module.with_advantages(rollout.batch)  # reference and old log-probs
    after = host_peak_bytes() / 1024  # ru_maxrss would lose the peaks before the phases' restarts
    assert batch.ref_logprobs is not None and batch.old_logprobs is not None
    print(json.dumps({
        "peak_rise_mib": (after - before) / 1024,
        "sequences": int(batch.input_ids.shape[0]),
        "completion_positions": int(batch.completion_ids.shape[1]),
    }))  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1], int(sys.argv[2]))
