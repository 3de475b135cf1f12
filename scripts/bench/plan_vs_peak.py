"""The memory plan against the measured peak: each case trains a few steps and compares the plan its run
wrote (`memory_plan.json`) with the peak the run measured (`metrics.json`), term by term where they part.

    python scripts/bench/plan_vs_peak.py                  # every case; a finished one is not run again
    python scripts/bench/plan_vs_peak.py --only tiny smollm2_lora_bf16
    python scripts/bench/plan_vs_peak.py --report         # the table from the runs there are
    python scripts/bench/plan_vs_peak.py --replan         # those runs against the plan today's terms make
    python scripts/bench/plan_vs_peak.py --gpu-plans      # what --plan says for qwen7b on GPUs (gpu_plans.md)

Writes docs/how-to/memory-plan/cases.md (the table docs/how-to/memory-plan.md includes) and
cases.json; with --gpu-plans, gpu_plans.md. On CUDA the measured peak is the allocator's (the plan's
2 GiB of context and slack are taken off before comparing); on the CPU the process's resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from loorl.util.hardware import machine_line  # the CPU's model, cores, kernels and bf16 units

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "environments"
GiB = 2**30
GB = 1e9  # the unit of the older summaries (`peak_host_gb`)

SMOLLM2 = ["experiment=smollm2_arithmetic", "rl.steps=2", "val_every=2"]
SMOLLM2_LORA = ["experiment=smollm2_arithmetic_lora", "rl.steps=2", "val_every=2"]
FLOAT32 = ["model.dtype=float32", "model.ref_dtype=float32"]
BF16 = ["model.dtype=bfloat16"]  # the recipes' fast_dtype is float32 on a CPU without bf16 units
# qwen05b with random weights at a CPU-sized step: 8 prompts x K 4, the HF engine, 50 held-out prompts
QWEN05B = ["model=qwen05b", "model.weights=random", "rollout=hf", "rl.steps=2", "val_every=2",
           "rl.prompts_per_step=8", "rl.prompts_per_minibatch=8", "rl.prompts_per_microbatch=4",
           "rl.samples_per_prompt=4", "task.eval_size=50", "val_pass_k=0", "optimizer.lr=1e-6"]  # fmt: skip
TWO_STEPS = ["rl.steps=2", "val_every=2"]
VLLM = ["rollout=vllm"]  # vLLM in process (on the CPU its weights and kv_cache_memory_gib)
PADDED = ["rl.microbatch_tokens=null"]  # SmolLM2's CPU recipe packs 256-token micro-batches
ALL_GROUPS = ["rl.skip_zero_advantage=false"]  # train every group, with or without reward spread
TRIMMED = ["keep_freed_memory=false"]  # freed memory goes back to the OS (the heap does not keep it)
# The cases the plan was tuned on (the first seven), then the grid it was not (issue 79): full and LoRA,
# bf16 and float32 bases, the HF and vLLM engines, packed and padded micro-batches, every shipped
# `experiment=` recipe at two steps, and the issue's own two commands.
CASES = {
    "tiny": ["rl.steps=3", "val_every=3"],
    "smollm2_full_bf16": [*SMOLLM2, *BF16],
    "smollm2_full_float32": [*SMOLLM2, *FLOAT32],
    "smollm2_lora_bf16": [*SMOLLM2_LORA, *BF16],
    "smollm2_lora_float32": [*SMOLLM2_LORA, *FLOAT32],
    "qwen05b_random_full": QWEN05B,
    "qwen05b_random_lora": [*QWEN05B, "model.lora={r: 16, base_dtype: bfloat16}", "optimizer.lr=1e-5"],
    # the issue's: LoRA over a float32 base (base_dtype's default), the model's recipe (512 rows a rollout)
    "qwen05b_random_lora_float32_base": [
        "model=qwen05b",
        "model.weights=random",
        "model.lora={r: 16}",
        *TWO_STEPS,
        "val_pass_k=0",
        "task.eval_size=16",
    ],  # fmt: skip
    "smollm2_reasoning_gym": ["experiment=smollm2_reasoning_gym", "seed=1", *TWO_STEPS],
    "smollm2_reasoning_gym_bf16": ["experiment=smollm2_reasoning_gym", "seed=1", *TWO_STEPS, *BF16],
    "tiny_bf16": ["rl.steps=3", "val_every=3", "model.dtype=bfloat16"],
    "tiny_lora": ["rl.steps=3", "val_every=3", "model.lora={r: 8}"],
    "tiny_vllm": ["rl.steps=3", "val_every=3", *VLLM],
    "smollm2_full_bf16_padded": [*SMOLLM2, *BF16, *PADDED],
    "smollm2_lora_bf16_padded": [*SMOLLM2_LORA, *BF16, *PADDED],
    "smollm2_lora_bf16_vllm": [*SMOLLM2_LORA, *BF16, *VLLM],
    # the padded cases with every group trained: the plan's micro-batch, which the runs above trained only
    # where a group's rewards had spread (`rl.skip_zero_advantage`; most groups had none)
    "smollm2_full_bf16_padded_all_groups": [*SMOLLM2, *BF16, *PADDED, *ALL_GROUPS],
    "smollm2_lora_bf16_padded_all_groups": [*SMOLLM2_LORA, *BF16, *PADDED, *ALL_GROUPS],
    # the heap's share: the same with freed memory handed back to the OS (`keep_freed_memory=false`)
    "smollm2_lora_padded_all_trimmed": [*SMOLLM2_LORA, *BF16, *PADDED, *ALL_GROUPS, *TRIMMED],
    "smollm2_full_bf16_vllm": [*SMOLLM2, *BF16, *VLLM],  # vLLM's share without LoRA's
    "qwen05b_random_full_float32": [*QWEN05B, *FLOAT32],
    "qwen05b_random_lora_float32_base_small": [*QWEN05B, "model.lora={r: 16}", "optimizer.lr=1e-5"],
    **{
        f"experiment_{name}": [f"experiment={name}", *TWO_STEPS]
        for name in (
            "arithmetic_grpo",
            "gspo",
            "smollm2_arithmetic",
            "smollm2_arithmetic_lora",
            "smollm2_calculator",
            "tiny_long_sums",
            "tiny_reasoning_gym",
            "tiny_sum_calculator",
            "study_tiny",
            "study_smollm2",
        )  # fmt: skip
    },
}


# What the plan says for the user's command on GPUs this machine does not have (plan=true, plan_device)
QWEN7B = ["model=qwen7b", "model.weights=random"]
LONG = ["rollout.max_new_tokens=1024", "rl.samples_per_prompt=5", "rl.prompts_per_microbatch=1"]  # 7b.md's
LORA = ["model.lora={r: 16, base_dtype: bfloat16}"]
GPU_PLANS = {
    "qwen7b full, 1 x 80 GiB": [*QWEN7B, "plan_device=cuda:80"],
    "qwen7b full, 1 x 141 GiB": [*QWEN7B, "plan_device=cuda:141"],
    "qwen7b full, node of 8 x 80 GiB": [*QWEN7B, "plan_device=cuda:80x8"],
    "qwen7b LoRA, 1 x 80 GiB": [*QWEN7B, *LORA, "plan_device=cuda:80"],
    "qwen7b LoRA, 1 x 141 GiB": [*QWEN7B, *LORA, "plan_device=cuda:141"],
    "qwen7b full, 1,024-token completions, 1 x 141 GiB": [*QWEN7B, *LONG, "plan_device=cuda:141"],
    "qwen7b LoRA, 1,024-token completions, 1 x 80 GiB": [*QWEN7B, *LORA, *LONG, "plan_device=cuda:80"],
}


def gpu_plans(target: Path) -> None:
    """The verdict of `plan=true` for each of GPU_PLANS (no model is built: the shipped architecture)
    into gpu_plans.md, and the first one's whole output into qwen7b_80.txt."""
    lines = ["| command (after `python src/train.py`) | the plan's verdict |", "| --- | --- |"]
    for i, (name, overrides) in enumerate(GPU_PLANS.items()):
        command = [sys.executable, str(ROOT / "src" / "train.py"), *overrides, "--plan"]
        done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
        verdict = next(x for x in done.stdout.splitlines() if x.startswith("memory plan:"))
        shown = " ".join(f"'{o}'" if " " in o else o for o in overrides)
        lines.append(f"| {name}: `{shown} --plan` | {verdict.removeprefix('memory plan: ')} |")
        print(lines[-1], flush=True)
        if i == 0:
            start = done.stdout.index("| term |")
            (target / "qwen7b_80.txt").write_text(done.stdout[start:])
    (target / "gpu_plans.md").write_text("\n".join(lines) + "\n")


EARLIER = "AMD EPYC, 2 cores, bf16 units (2026-11-29)"  # where the cases cases.json recorded first ran


def case_env() -> dict[str, str]:
    """The environment a case runs (and is planned) in: the recipes' own environments
    (experiment=tiny_sum_calculator's) importable, as their docs say."""
    path = os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def run_case(name: str, overrides: list[str], out: Path) -> None:
    run = out / name
    if (run / "metrics.json").is_file():
        print(f"[{name}] done already: {run}", flush=True)
        return
    command = [sys.executable, str(ROOT / "src" / "train.py"), *overrides, f"hydra.run.dir={run}",
               "trainer.enable_progress_bar=false", "checkpoint_every=0", "export_policy=false"]  # fmt: skip
    print(f"[{name}] {' '.join(command[1:])}", flush=True)
    start = time.time()
    run.mkdir(parents=True, exist_ok=True)
    (run / "machine.txt").write_text(f"{machine_line()} ({time.strftime('%Y-%m-%d')})\n")
    env = case_env()
    with open(run / "plan_vs_peak.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    # a case that fails is reported and left out of the table; the others still run
    outcome = (
        "s" if done.returncode == 0 else f"s, FAILED (exit {done.returncode}; see {run / 'plan_vs_peak.log'})"
    )
    print(f"[{name}] {time.time() - start:.0f} {outcome}", flush=True)


def summary_bytes(summary: dict, key: str) -> float:
    """A peak of the run's summary in bytes, under either name: `<key>_gib` (GiB) or the older `<key>_gb`
    (GB)."""
    if f"{key}_gib" in summary:
        return summary[f"{key}_gib"] * GiB
    return summary[f"{key}_gb"] * GB


def replan(overrides: list[str], run: Path) -> None:
    """The plan of today's terms for a case that ran before (`--replan`): `plan=true`'s table, parsed
    into `memory_plan_now.json` beside the run's own `memory_plan.json` (GiB to two decimals)."""
    command = [sys.executable, str(ROOT / "src" / "train.py"), *overrides, "--plan"]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT, env=case_env())
    terms = []
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("term", "---") and not cells[0].startswith("**"):
            terms.append(
                {"name": cells[0], "training": float(cells[1]) * GiB, "generating": float(cells[2]) * GiB}
            )
    verdict = next(x for x in done.stdout.splitlines() if x.startswith("memory plan:"))
    peak = float(verdict.rsplit("peak ", 1)[1].split()[0]) * GiB
    record = {"device": "cuda" if " cuda " in verdict else "cpu", "terms": terms, "peak_bytes": peak,
              "training_bytes": sum(t["training"] for t in terms),
              "generating_bytes": sum(t["generating"] for t in terms)}  # fmt: skip
    (run / "memory_plan_now.json").write_text(json.dumps(record, indent=2))


def compare(
    name: str, overrides: list[str], run: Path, *, now: bool = False, measured: float = 0.0, on: str = ""
) -> dict:
    """A case's plan against its measured peak: the run's own `metrics.json`, or `measured` (bytes)
    where the run is not here (a peak `cases.json` recorded, `--replan`)."""
    plan = json.loads((run / ("memory_plan_now.json" if now else "memory_plan.json")).read_text())
    cuda = plan["device"] == "cuda"
    if not measured:
        summary = json.loads((run / "metrics.json").read_text())["summary"]
        measured = summary_bytes(summary, "peak_cuda" if cuda else "peak_host")
    planned = plan["peak_bytes"] - (2 * GiB if cuda else 0)  # the allocator's peak has no context in it
    phase = "training" if plan["training_bytes"] >= plan["generating_bytes"] else "generating"
    largest = max(plan["terms"], key=lambda t: t[phase])
    return {
        "case": name,
        "measured_on": on
        or ((run / "machine.txt").read_text().strip() if (run / "machine.txt").is_file() else ""),
        "overrides": overrides,
        "planned_gib": planned / GiB,
        "measured_gib": measured / GiB,
        "error": planned / measured - 1,
        "planned_phase": phase,
        "largest_term": largest["name"],
        "largest_term_gib": largest[phase] / GiB,
        "base_gib": plan["terms"][-1]["training"] / GiB,
    }


def report(rows: list[dict]) -> str:
    lines = [
        "| case | planned (GiB) | measured peak (GiB) | plan - measured | the plan's peak phase "
        "| its largest term | measured on |",
        "| --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['planned_gib']:.2f} | {r['measured_gib']:.2f} | {100 * r['error']:+.0f}% | "
            f"{r['planned_phase']} | {r['largest_term']} ({r['largest_term_gib']:.2f}) | {r['measured_on']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=list(CASES), help="these cases only")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "plan_vs_peak"), help="where the runs go")
    parser.add_argument("--report-dir", default=str(ROOT / "docs" / "how-to" / "memory-plan"))
    parser.add_argument("--report", action="store_true", help="only the table, from the runs there are")
    parser.add_argument("--gpu-plans", action="store_true", help="only the GPU plans' table (gpu_plans.md)")
    parser.add_argument("--replan", action="store_true", help="the runs there are against today's plan")
    args = parser.parse_args()
    out, names = Path(args.out), args.only or list(CASES)
    target = Path(args.report_dir)
    target.mkdir(parents=True, exist_ok=True)
    if args.gpu_plans:
        gpu_plans(target)
        return
    ran = [n for n in CASES if (out / n / "metrics.json").is_file()]
    if args.replan:  # the runs here, and the cases whose peaks cases.json recorded, against today's plan
        recorded = {
            r["case"]: (r["measured_gib"] * GiB, r.get("measured_on") or EARLIER)
            for r in json.loads((target / "cases.json").read_text())
        }
        rows = []
        for name in [n for n in CASES if n in ran or n in recorded]:
            run = out / name if name in ran else out / "replanned" / name
            run.mkdir(parents=True, exist_ok=True)
            replan(CASES[name], run)
            measured, on = (0.0, "") if name in ran else recorded[name]
            rows.append(compare(name, CASES[name], run, now=True, measured=measured, on=on))
            print(report(rows[-1:]).splitlines()[-1], flush=True)
    else:
        if not args.report:
            for name in names:
                run_case(name, CASES[name], out)
            ran = [n for n in CASES if (out / n / "metrics.json").is_file()]
        rows = [compare(n, CASES[n], out / n) for n in ran]
    (target / "cases.md").write_text(report(rows))
    (target / "cases.json").write_text(json.dumps(rows, indent=2))
    print(report(rows))


if __name__ == "__main__":
    main()
