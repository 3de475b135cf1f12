"""The memory plan at the start of a run: `plan=true` prints it and stops; otherwise a run predicted not
to fit stops with one line and the fix (`memory_check=false` runs it anyway), and one that fits logs
its verdict (`loorl.planning.memory` has the arithmetic)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig

from loorl.errors import ConfigError
from loorl.models.sources import model_config, tokenizer_at_hand
from loorl.parallel.launch import lightning_launched_processes, processes_on_this_node
from loorl.planning.fixes import cheapest_fix, verdict
from loorl.planning.inputs import (
    architecture_of,
    longest_prompt,
    parse_plan_device,
    with_vllm,
    workload_of,
)
from loorl.planning.memory import Plan, make_plan, table

log = logging.getLogger(__name__)


def memory_plan(cfg: DictConfig, s, task=None) -> tuple[Plan, Plan | None] | None:
    """(the run's plan, the cheapest change's plan where it does not fit); None where the model's config
    is not at hand without a download. `task`: the built task, whose longest prompt sets the sequences'
    length (None: `rollout.max_prompt_length`)."""
    config = model_config(s.model)
    if config is None:
        return None
    arch, lora_fix = architecture_of(config, s.model.lora)
    per_node = lightning_launched_processes(cfg)
    world = per_node * int(cfg.trainer.get("num_nodes", 1) or 1)  # the processes FSDP shards over
    on_host, _ = processes_on_this_node(os.environ, lightning_devices=per_node)  # they share its memory
    offload = bool(s.strategy == "fsdp" and (cfg.trainer.get("strategy") or {}).get("offload_params"))
    prompt = None
    tokenizer = tokenizer_at_hand(s.model) if task is not None else None
    if tokenizer is not None:
        prompt = longest_prompt(task, tokenizer, prompts_per_step=s.rl.prompts_per_step, seed=s.run.seed,
                                max_prompt_length=s.rollout.max_prompt_length)  # fmt: skip
    if s.run.plan_device:  # another machine's device
        on_cuda, device_bytes, devices_on_node = parse_plan_device(s.run.plan_device)
    else:
        on_cuda, device_bytes, devices_on_node = s.on_cuda, None, cuda_device_count() if s.on_cuda else 1
    work = workload_of(
        s,
        world=world,
        processes_on_host=on_host,
        offload=offload,
        on_cuda=on_cuda,
        device_bytes=device_bytes,
        prompt_tokens=prompt,
    )
    work = with_vllm(work, arch, s.rollout.vllm, s.model.dtype)
    plan = make_plan(arch, work)
    if plan.fits:
        return plan, None
    return plan, cheapest_fix(arch, work, devices_on_node=devices_on_node, lora_parameters=lora_fix)


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def check_memory(cfg: DictConfig, s, task=None) -> tuple[Plan, Plan | None] | None:
    """Make the plan and act on it: `plan=true` prints it (the caller stops); a plan that does not fit
    stops the run with one line unless `memory_check=false`; otherwise its verdict is logged."""
    made = memory_plan(cfg, s, task)
    if made is None:
        line = "memory plan: none (the model's config.json is not on this machine)"
        print(line) if s.run.plan else log.info(line)
        return None
    plan, fix = made
    line = verdict_line(made)
    if s.run.plan:
        print(
            f"{table(plan)}\n\n{line}\n(GiB, one process; docs/how-to/memory-plan.md says what each term is)"
        )
    elif not plan.fits and s.run.memory_check:
        raise ConfigError(f"{line}; or memory_check=false to run anyway (plan=true prints the plan)")
    elif not plan.fits:  # memory_check=false (a run that fits says so among its facts)
        log.warning("%s", line)
    return made


def verdict_line(made: tuple[Plan, Plan | None]) -> str:
    return "memory plan: " + verdict(*made)


def write_plan(made: tuple[Plan, Plan | None] | None, output_dir: Path) -> None:
    """`memory_plan.md` (the table and the verdict) and `memory_plan.json` (every term, bytes) in the run
    folder, beside the peak summary.md measures."""
    if made is None:
        return
    plan, fix = made
    (output_dir / "memory_plan.md").write_text(f"{table(plan)}\n\n{verdict_line(made)}\n")
    record = {
        "device": plan.device,
        "device_bytes": plan.device_bytes,
        "training_bytes": plan.training,
        "generating_bytes": plan.generating,
        "peak_bytes": plan.peak,
        "fits": plan.fits,
        "terms": [asdict(t) for t in plan.terms],
        "fix": None if fix is None else {"overrides": list(fix.overrides), "peak_bytes": fix.peak},
    }
    (output_dir / "memory_plan.json").write_text(json.dumps(record, indent=2))
