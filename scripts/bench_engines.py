"""Time the HF and vLLM rollout engines on the same prompts; write tokens/s to a markdown table.

    python scripts/bench_engines.py                  # tiny + ~50M model, writes outputs/bench/engines.md
    python scripts/bench_engines.py --models tiny --prompts 32 --samples 8

Both engines sample K completions per prompt from the same weights with the same settings
(temperature 1, top-k off, `--max-new-tokens`). The tiny model is the default run's warm-started
model; the ~50M one is a randomly initialised model of the same family (Qwen2, head_dim 64, the
character tokenizer), which rarely emits EOS, so it measures long decodes. Timings are the median
over `--repeats` calls after one warm-up call; engine start-up is reported separately.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from loorl.config import CONF_DIR  # noqa: E402
from loorl.models.load import load_causal_lm, load_tokenizer  # noqa: E402
from loorl.models.tiny import build_char_tokenizer, ensure_tiny_model  # noqa: E402
from loorl.rollout.hf_engine import HFEngine  # noqa: E402
from loorl.types import SamplingConfig  # noqa: E402

MEDIUM = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def tiny_model_path() -> str:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=unused"])
    return str(ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task)))


def medium_model_path(root: Path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, **MEDIUM)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


def time_engine(engine, prompts, *, samples: int, repeats: int) -> tuple[float, int]:
    engine.generate(prompts, n=samples)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        groups = engine.generate(prompts, n=samples)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        rates.append(tokens / seconds)
    return statistics.median(rates), tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny", "medium"], choices=["tiny", "medium"])
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8, help="K completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="outputs/bench/engines.md")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            path = tiny_model_path() if model_name == "tiny" else medium_model_path(Path(tmp) / "medium")
            tok = load_tokenizer(path)
            policy = load_causal_lm(path, dtype="float32")
            params = sum(p.numel() for p in policy.parameters())
            rng = np.random.default_rng(0)
            prompts = [
                tok(f"{a}+{b}=", add_special_tokens=False).input_ids
                for a, b in rng.integers(0, 30, (args.prompts, 2))
            ]
            sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
            ids = {"eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
            for engine_name in args.engines:
                t0 = time.perf_counter()
                if engine_name == "hf":
                    engine = HFEngine(sampling, **ids)
                else:
                    from loorl.rollout.vllm_engine import VLLMEngine

                    engine = VLLMEngine(sampling, model_path=path, dtype="float32", kv_cache_memory_gb=1.0,
                                        max_model_len=64, **ids)  # fmt: skip
                engine.sync(policy)
                startup = time.perf_counter() - t0
                rate, tokens = time_engine(engine, prompts, samples=args.samples, repeats=args.repeats)
                rows.append((model_name, f"{params / 1e6:.1f}M", engine_name, args.prompts * args.samples,
                             tokens, rate, startup))  # fmt: skip
                print(
                    f"{model_name} {engine_name}: {rate:,.0f} tokens/s ({tokens} tokens per call)", flush=True
                )
                del engine

    device = "CPU" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    lines = [
        f"Rollout engines on {device} ({os.cpu_count()} cores), torch {torch.__version__}; "
        f"{args.prompts} prompts x {args.samples} samples, at most {args.max_new_tokens} new tokens, "
        f"median of {args.repeats} calls after a warm-up.",
        "",
        "| model | params | engine | sequences | tokens per call | tokens/s | start-up s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {m} | {p} | {e} | {s} | {t} | {r:,.0f} | {u:.1f} |" for m, p, e, s, t, r, u in rows]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
