"""A LoRA policy's weights into vLLM, two ways, timed: merged weights streamed at each sync (what loorl
does) against vLLM's own LoRA support (the adapter saved in peft's format, a new `LoRARequest` per sync).

    python scripts/bench/bench_lora_sync.py            # SmolLM2 r 16: experiment=smollm2_arithmetic_lora
    python scripts/bench/bench_lora_sync.py --syncs 3 model.lora.r=8     # plus any Hydra override

Both engines are real vLLM engines built from the run's own settings (`rollout=vllm`, the engine's
dtype and limits), in one process. The policy is the model with adapters whose B is drawn at random
(B = 0 would make both paths the base model). Each sync (`--syncs`, after one warm-up) draws new
adapters, then:
- merged: `VLLMEngine.sync` (loorl.models.lora.merged_weights -> `reload_weights`), then a sampled
  rollout (B prompts x K samples of the run's sampling settings);
- vLLM LoRA: the adapters saved with peft's `save_pretrained`, then the same rollout with a new
  `LoRARequest` (the first call loads the adapter: its cost is in that call), then once more with
  the same request (the per-token cost of the LoRA kernels alone).
Then both engines' greedy answers to the same prompts are compared with the HF adapted policy's.
Prints a markdown table (medians over the syncs) and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from loorl.build import build_datamodule, build_task  # noqa: E402
from loorl.config import compose_config, load_settings  # noqa: E402
from loorl.models.load import load_causal_lm, load_tokenizer  # noqa: E402
from loorl.models.lora import apply_lora  # noqa: E402
from loorl.models.sources import resolve_model_path  # noqa: E402
from loorl.rollout.engines.base import PolicyWeights  # noqa: E402
from loorl.rollout.engines.hf_engine import HFEngine  # noqa: E402
from loorl.util.onednn import cap_onednn_primitive_cache  # noqa: E402

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRAConfig accepts


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--syncs", type=int, default=3, help="timed syncs after one warm-up (default 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "lora_sync.md")
    args, overrides = parser.parse_known_args(argv)
    if args.syncs < 1:
        parser.error("--syncs must be at least 1")
    return args, ["experiment=smollm2_arithmetic_lora", "rollout=vllm", *overrides]


def randomize_adapters(policy, generator: torch.Generator) -> None:
    """New adapters, as after some training: B (0 at initialisation) drawn at the scale of A's entries."""
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)


def greedy(engine, prompts) -> list[list[int]]:
    return [g[0].token_ids for g in engine.generate(prompts, n=1, greedy=True)]


def main(argv: list[str]) -> None:
    args, overrides = parse_args(argv)
    cap_onednn_primitive_cache()  # before this process's first bf16 product (loorl.util.onednn)
    cfg = compose_config(f"output_dir={tempfile.mkdtemp(prefix='bench-lora-')}", *overrides)
    s = load_settings(cfg)
    task = build_task(s)
    model_path = resolve_model_path(s.model, s.task, task)
    tok = load_tokenizer(model_path)
    policy = apply_lora(load_causal_lm(model_path, dtype="float32"), s.model.lora, seed=s.run.seed).eval()

    merged = build_datamodule(s, task, tok, model_path).engine  # the run's vLLM engine
    lora_engine = build_datamodule(s, task, tok, model_path).engine
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    lora_engine.llm = LLM(
        **lora_engine.arguments(),
        enable_lora=True,
        max_lora_rank=next(v for v in VLLM_LORA_RANKS if v >= s.model.lora.r),
        max_loras=1,
    )
    vllm_generate = lora_engine.llm.generate

    prompts = [
        tok(p.text, add_special_tokens=False).input_ids for p in task.eval_prompts()[: s.rl.prompts_per_step]
    ]
    k, generator = s.rl.samples_per_prompt, torch.Generator().manual_seed(0)
    rows = {"merged": [], "lora_gen": [], "lora_again": [], "save": [], "merge_gen": []}
    tokens = {"merged": [], "lora": []}
    adapter_root = Path(tempfile.mkdtemp(prefix="bench-lora-adapters-"))
    for i in range(args.syncs + 1):
        randomize_adapters(policy, generator)
        start = time.perf_counter()
        merged.sync(PolicyWeights(policy), version=i)
        sync_s = time.perf_counter() - start
        start = time.perf_counter()
        groups = merged.generate(prompts, n=k)
        merged_gen_s = time.perf_counter() - start

        start = time.perf_counter()
        policy.save_pretrained(adapter_root / str(i))
        save_s = time.perf_counter() - start
        request = LoRARequest(f"sync{i}", i + 1, str(adapter_root / str(i)))
        lora_engine.llm.generate = partial(vllm_generate, lora_request=request)
        start = time.perf_counter()
        lora_groups = lora_engine.generate(prompts, n=k)
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        lora_engine.generate(prompts, n=k)
        again_s = time.perf_counter() - start
        if i == 0:
            continue  # warm-up
        rows["merged"].append(sync_s)
        rows["merge_gen"].append(merged_gen_s)
        rows["save"].append(save_s)
        rows["lora_gen"].append(first_s)
        rows["lora_again"].append(again_s)
        tokens["merged"].append(sum(len(c.token_ids) for g in groups for c in g))
        tokens["lora"].append(sum(len(c.token_ids) for g in lora_groups for c in g))

    hf = HFEngine(merged.sampling, eos_token_ids=merged.eos_token_ids, pad_token_id=tok.pad_token_id)
    hf.sync(PolicyWeights(policy))
    reference = greedy(hf, prompts)
    agree = {
        name: sum(a == b for a, b in zip(greedy(engine, prompts), reference)) / len(prompts)
        for name, engine in (("merged", merged), ("lora", lora_engine))
    }

    med = statistics.median
    tps_merged = med(tokens["merged"]) / med(rows["merge_gen"])
    tps_lora = med(tokens["lora"]) / med(rows["lora_again"])
    lines = [
        f"## LoRA weights into vLLM: {s.model.name}, r {s.model.lora.r}, engine dtype {merged.dtype}",
        "",
        f"{len(prompts)} prompts x {k} samples, up to {s.rollout.max_new_tokens} new tokens; medians over "
        f"{args.syncs} syncs after a warm-up; torch threads {torch.get_num_threads()}.",
        "",
        "| path | per sync: weights in (s) | rollout after the sync (s) | rollout, adapter loaded (s) "
        "| generated tokens/s | greedy answers equal to the HF adapted policy's |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| merged weights, `reload_weights` (loorl) | {med(rows['merged']):.2f} "
        f"| {med(rows['merge_gen']):.2f} "
        f"| {med(rows['merge_gen']):.2f} | {tps_merged:.0f} | {agree['merged']:.0%} |",
        f"| vLLM LoRA, `LoRARequest` per sync | {med(rows['save']):.2f} (peft save) "
        f"| {med(rows['lora_gen']):.2f} (adapter load included) | {med(rows['lora_again']):.2f} "
        f"| {tps_lora:.0f} | {agree['lora']:.0%} |",
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)


if __name__ == "__main__":
    main(sys.argv[1:])
