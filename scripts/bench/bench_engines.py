"""Generation against the machine's limit: every way loorl can generate, at each recipe's rollout shape.

    python scripts/bench/bench_engines.py                                 # tiny and SmolLM2, every path
    python scripts/bench/bench_engines.py --works tiny --paths hf:dynamic hf:static --profile

A work is a recipe: `tiny` (the default run) or `smollm2` (`experiment=smollm2_arithmetic`). Each
takes its recipe's rollout shape (rl.prompts_per_step x rl.samples_per_prompt rows,
rollout.max_new_tokens, the sampler's temperature and top-k/p), its compute dtype (bf16 autocast
over float32 weights where the recipe picks bf16, as the run samples) and the prompts of its RL step
0, and times each path: `hf:dynamic`, `hf:static`, `hf:compiled` (the HF engine's `rollout.hf_decode`
loops), `hf:padded` (the dynamic loop with rows that ended decoding padding to the end, as before
they left the batch) and `vllm` (where it is installed). Tokens/s is the median over `--repeats`
calls after one warm-up call (which pays compilation); start-up (engine creation, first sync) is its
own column.

Beside each rate, the machine's limits at that shape, from two measurements made here:
- compute: a 2048^3 matrix product in the compute dtype (FLOP/s), over the model's FLOPs per
  generated token (2 x the weights of its linear layers, the output layer included, plus attention
  over the cache at the rollout's mean context);
- memory: a 1 GB read (bytes/s), over the bytes one decoding step reads (every weight once, in the
  compute dtype, and every row's key/value cache at the mean context), times the rows it decodes.
The lower of the two is what the hardware allows; "of limit" is the rate over it. "slots used":
generated tokens over the row-steps decoded (a row that ended decodes padding until every row has).

`--profile`: one more call per path under the torch profiler, its wall split into matrix products,
attention, sampling (`loorl/sample` in the decoding loop), other operators, and what no operator
covers (Python and the loop between tokens). Writes outputs/bench/engines.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from loorl.rollout.engines.decoding import LEAVE_AT  # noqa: E402
from loorl.util.onednn import cap_onednn_primitive_cache  # noqa: E402

WORKS = {"tiny": [], "smollm2": ["experiment=smollm2_arithmetic"]}  # recipe overrides
PATHS = ("hf:padded", "hf:dynamic", "hf:static", "hf:compiled", "vllm")
DECODES_EVERY_ROW = ("hf:padded", "hf:static", "hf:compiled")  # rows that ended decode padding to the end
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn")
ATTENTION_OPS = ("scaled_dot_product", "aten::_softmax", "attention")


# ---- the limits (pure arithmetic) ------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What one rollout call decodes: rows, the mean context a decoding step attends over, and the
    model's sizes that set its cost."""

    rows: int
    context: float  # mean positions in the cache during decoding (prompt + half the completion)
    linear_weights: int  # parameters of the linear layers, the output layer included
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    bytes_per_value: int  # the compute dtype's


def flops_per_token(shape: Shape) -> float:
    """Forward FLOPs of one generated token: a multiply-add per linear weight, and per layer the
    query's scores against `context` keys and the weighted sum of as many values, for every head."""
    attention = 2 * 2 * shape.layers * shape.heads * shape.head_dim * shape.context
    return 2 * shape.linear_weights + attention


def bytes_per_step(shape: Shape) -> float:
    """Bytes one decoding step reads: every linear weight once, and each row's keys and values."""
    cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.context * shape.rows
    return (shape.linear_weights + cache) * shape.bytes_per_value


def limits(shape: Shape, *, flops_per_s: float, bytes_per_s: float) -> tuple[float, float]:
    """(compute-bound, memory-bound) generated tokens/s: a step makes `rows` tokens."""
    compute = flops_per_s / flops_per_token(shape)
    memory = shape.rows * bytes_per_s / bytes_per_step(shape)
    return compute, memory


def slots_used(lengths: list[int], *, leave_at: float | None = None) -> float:
    """Generated tokens over the row-steps a call decoded, from its rows' lengths. `leave_at` None:
    every row runs until the longest ends; otherwise rows that ended leave the batch once they are
    that share of it (`decoding.LEAVE_AT`, checked at every token as on the CPU)."""
    live, steps = sorted(lengths), 0
    for i in range(max(lengths, default=0)):
        steps += len(live)
        ended = sum(1 for n in live if n <= i + 1)
        if leave_at is not None and ended and ended >= leave_at * len(live):
            live = live[ended:]
    return sum(lengths) / max(1, steps)


# ---- measurements ----------------------------------------------------------------------------------
def read_bytes_per_s(gigabytes: float = 1.0, repeats: int = 5) -> float:
    """The fastest of `repeats` full reads (a sum) of a `gigabytes` float32 tensor."""
    x = torch.ones(int(gigabytes * 2**30) // 4)
    x.sum()
    best = min(_seconds(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_shape(model, *, rows: int, context: float, compute: torch.dtype) -> Shape:
    cfg = model.config
    heads = cfg.num_attention_heads
    return Shape(
        rows=rows,
        context=context,
        linear_weights=sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)),
        layers=cfg.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        bytes_per_value=torch.finfo(compute).bits // 8,
    )


def where_time_goes(call) -> dict[str, float]:
    """One call under the profiler: seconds in matrix products, attention, sampling, other operators
    and outside any operator (Python, the loop)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wall = _seconds(call)
    matmul = attention = sampling = top = 0.0
    for event in prof.events():
        seconds = event.self_cpu_time_total / 1e6
        if event.cpu_parent is None:
            top += event.cpu_time_total / 1e6
        if event.name == "loorl/sample":
            sampling += event.cpu_time_total / 1e6
        elif any(op in event.name for op in MATMUL_OPS):
            matmul += seconds
        elif any(op in event.name for op in ATTENTION_OPS):
            attention += seconds
    other = max(0.0, top - matmul - attention - sampling)
    return {
        "wall": wall,
        "matmul": matmul,
        "attention": attention,
        "sampling": sampling,
        "other ops": other,
        "outside ops": max(0.0, wall - top),
    }


def generate(engine, prompts, *, n: int, scope, seed: int):
    with scope():
        return engine.generate(prompts, n=n, seed=seed)


def time_path(call, *, repeats: int, profile: bool, leave_at: float | None = None) -> dict:
    """The median tokens/s of `repeats` seeded calls after a warm-up, their slots used, and (profile)
    where one more call's time goes."""
    call(seed=0)  # warm-up: compiles, allocates
    rates, lengths = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        groups = call(seed=r + 1)
        seconds = time.perf_counter() - t0
        lengths = [len(c.token_ids) for g in groups for c in g]
        rates.append(sum(lengths) / seconds)
    out = {
        "rate": statistics.median(rates),
        "tokens": sum(lengths),
        "slots": slots_used(lengths, leave_at=leave_at),
        "mean_length": statistics.fmean(lengths),
    }
    if profile:
        out["profile"] = where_time_goes(functools.partial(call, seed=repeats + 1))
    return out


# ---- one work --------------------------------------------------------------------------------------
def compose_work(work: str, path: str, extra: list[str]):
    from hydra import compose, initialize_config_dir

    from loorl.config import CONF_DIR, check_config

    decoding = "dynamic" if path == "hf:padded" else path.split(":")[-1]
    engine = ["rollout=vllm"] if path == "vllm" else ["rollout=hf", f"rollout.hf_decode={decoding}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "train", overrides=[*WORKS[work], "trainer.accelerator=cpu", *engine, *extra, "output_dir=unused"]
        )
    return check_config(cfg)


def bench_work(work: str, paths: list[str], *, repeats: int, profile: bool, extra: list[str]) -> list[dict]:
    from loorl.build import build_rollout_engine, build_task
    from loorl.models.load import load_causal_lm, load_tokenizer
    from loorl.models.sources import resolve_model_path
    from loorl.rollout.engines.vllm_engine import vllm_installed
    from loorl.util.hardware import matmul_flops_per_s

    rows, base = [], compose_work(work, "hf:dynamic", extra)
    task = build_task(base)
    path = resolve_model_path(base.model, base.task, task)
    tok = load_tokenizer(path)
    task.prepare(tok, max_prompt_length=base.rollout.max_prompt_length)  # the chat template, as a run does
    policy = load_causal_lm(path, dtype=base.model.master_dtype)
    compute = getattr(torch, base.model.dtype)
    autocast = compute != policy.dtype
    prompts = [
        tok(p.text, add_special_tokens=False).input_ids
        for p in task.prompts_for_step(0, base.rl.prompts_per_step, seed=base.run.seed)
    ]
    k = base.rl.samples_per_prompt
    peaks = {"flops": matmul_flops_per_s(compute), "bytes": read_bytes_per_s()}
    for name in paths:
        if name == "vllm" and not vllm_installed():
            print(f"{work} {name}: skipped (vllm is not installed)", flush=True)
            continue
        s = compose_work(work, name, extra)
        started = time.perf_counter()
        engine = build_rollout_engine(s, tok, path)  # s pins the CPU
        if name == "hf:padded":
            engine.drop_ended = False  # the dynamic loop as it was: ended rows decode padding
        engine.sync(policy)
        startup = time.perf_counter() - started
        scope = (
            functools.partial(torch.autocast, "cpu", dtype=compute) if autocast else contextlib.nullcontext
        )
        call = functools.partial(generate, engine, prompts, n=k, scope=scope)
        leave_at = None if name in DECODES_EVERY_ROW else LEAVE_AT
        row = time_path(call, repeats=repeats, profile=profile, leave_at=leave_at)
        shape = model_shape(
            policy,
            rows=len(prompts) * k,
            compute=compute,
            context=statistics.fmean(map(len, prompts)) + row.pop("mean_length") / 2,
        )
        compute_limit, memory_limit = limits(shape, flops_per_s=peaks["flops"], bytes_per_s=peaks["bytes"])
        row |= {
            "work": work,
            "path": name,
            "rows": shape.rows,
            "compute": compute_limit,
            "memory": memory_limit,
            "startup": startup,
            "dtype": base.model.dtype,
            "peaks": peaks,
        }
        share = 100 * row["rate"] / min(compute_limit, memory_limit)
        print(f"{work} {name}: {row['rate']:,.0f} tokens/s ({share:.0f}% of the limit)", flush=True)
        rows.append(row)
        engine.close()
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| work | path | rows | tokens/s | compute limit | memory limit | of limit | slots used | start-up s |",  # noqa: E501
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        limit = min(r["compute"], r["memory"])
        lines.append(
            f"| {r['work']} ({r['dtype']}) | {r['path']} | {r['rows']} | {r['rate']:,.0f} | "
            f"{r['compute']:,.0f} | {r['memory']:,.0f} | {100 * r['rate'] / limit:.0f}% | "
            f"{100 * r['slots']:.0f}% | {r['startup']:.1f} |"
        )
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        keys = ("matmul", "attention", "sampling", "other ops", "outside ops")
        lines += ["", "Where a call's time goes (one profiled call; seconds, share of its wall):", ""]
        lines += [
            "| work | path | wall s | " + " | ".join(keys) + " |",
            "| --- | --- | --- |" + " --- |" * len(keys),
        ]
        for r in profiled:
            p = r["profile"]
            cells = " | ".join(f"{p[k]:.2f} ({100 * p[k] / p['wall']:.0f}%)" for k in keys)
            lines.append(f"| {r['work']} | {r['path']} | {p['wall']:.2f} | {cells} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--works", nargs="+", default=list(WORKS), choices=list(WORKS))
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="one more call per path under the profiler")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/engines.md"))
    parser.add_argument("overrides", nargs="*", help="config overrides for every work (e.g. seed=1)")
    args = parser.parse_args()
    cap_onednn_primitive_cache()  # before this process's first bf16 product (loorl.util.onednn)

    from loorl.parallel.launch import configure_threads

    configure_threads(lightning_devices=1)  # the threads a one-process run computes with
    rows = []
    for work in args.works:
        rows += bench_work(work, args.paths, repeats=args.repeats, profile=args.profile, extra=args.overrides)
    works = {r["work"]: r for r in rows}.values()
    peaks = "; ".join(
        f"{r['work']} ({r['dtype']}): {r['peaks']['flops'] / 1e9:,.0f} GFLOP/s, "
        f"{r['peaks']['bytes'] / 1e9:.1f} GB/s read"
        for r in works
    )
    lines = [
        f"Generation on the CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()} kernels), torch {torch.__version__}, at each recipe's "
        f"rollout shape; median of {args.repeats} calls after a warm-up. Measured peaks: {peaks}.",
        "",
        *table(rows),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines) + f"\n\nwritten to {args.out}")


if __name__ == "__main__":
    main()
