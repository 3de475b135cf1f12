"""The changes that make a plan fit, cheapest first (`cheapest_fix`), and the one-line verdict that
names the first that does (`loorl.planning.memory` has the plan's arithmetic)."""

from __future__ import annotations

from dataclasses import replace

from loorl.planning.memory import Architecture, GiB, Plan, Workload, make_plan


def candidate_fixes(
    a: Architecture, w: Workload, *, devices_on_node: int
) -> list[tuple[tuple[str, ...], Workload]]:
    """The changes that lower the peak, cheapest first (speed and the method kept before memory):
    vLLM's share, activation checkpointing, smaller micro-batches, the reference in host memory, FSDP
    over the node's GPUs, LoRA, and the training state offloaded to the CPU."""
    out: list[tuple[tuple[str, ...], Workload]] = []
    if w.engine == "vllm" and w.device == "cuda":
        for share in (0.3, 0.2):
            if w.vllm_bytes > share * w.device_bytes:
                out.append(
                    (
                        (f"rollout.vllm.gpu_memory_utilization={share}",),
                        replace(w, vllm_bytes=int(share * w.device_bytes)),
                    )
                )
    if not w.checkpointing:
        out.append((("model.gradient_checkpointing=true",), replace(w, checkpointing=True)))
    out.extend(smaller_microbatches(w))
    if w.ref_bytes and w.ref_on_device and not w.lora and w.device == "cuda":
        out.append((("model.ref_offload=true",), replace(w, ref_on_device=False)))
    if w.device == "cuda":
        shards = 2
        while shards <= devices_on_node:
            if shards > w.shards:
                out.append(((f"strategy=fsdp trainer.devices={shards}",), replace(w, shards=shards)))
            shards *= 2
    if not w.lora:
        lora = replace(w, lora=True, frozen_bytes=w.compute_bytes)
        out.append(
            (
                (f"'model.lora={{r: 16, base_dtype: {'bfloat16' if w.compute_bytes == 2 else 'float32'}}}'",),
                lora,
            )
        )
    if w.device == "cuda" and not w.lora and not w.offload:
        out.append((("strategy=fsdp trainer.strategy.offload_params=true",), replace(w, offload=True)))
    return out


def smaller_microbatches(w: Workload) -> list[tuple[tuple[str, ...], Workload]]:
    """Micro-batches halved down to one group (padded) or one longest sequence (packed)."""
    out = []
    if w.packed:
        cap = w.microbatch_tokens
        while cap // 2 >= w.sequence_tokens:
            cap //= 2
            out.append(((f"rl.microbatch_tokens={cap}",), replace(w, microbatch_tokens=cap)))
        return out
    group = w.samples_per_prompt * w.sequence_tokens
    prompts = w.microbatch_tokens // group
    while prompts > 1:
        prompts //= 2
        out.append(((f"rl.prompts_per_microbatch={prompts}",), replace(w, microbatch_tokens=prompts * group)))
    return out


def cheapest_fix(
    a: Architecture, w: Workload, *, devices_on_node: int = 1, lora_parameters: int = 0
) -> Plan | None:
    """The plan of the first single change that fits, else of the changes taken together in order
    until they fit; None when nothing listed fits. `lora_parameters`: the adapters LoRA would add
    (r 16 on the default targets)."""
    fixes = candidate_fixes(a, w, devices_on_node=devices_on_node)
    arch = {True: replace(a, lora_parameters=lora_parameters or a.lora_parameters), False: a}
    for overrides, changed in fixes:
        plan = make_plan(arch[changed.lora], changed, overrides)
        if plan.fits:
            return plan
    taken: tuple[str, ...] = ()
    current = w
    for overrides, changed in fixes:  # together: each change applied on top of the ones before
        merged = _merge(current, w, changed)
        taken += overrides
        current = merged
        plan = make_plan(arch[current.lora], current, taken)
        if plan.fits:
            return plan
    return None


def _merge(current: Workload, original: Workload, changed: Workload) -> Workload:
    """`current` with the fields `changed` altered from `original`."""
    diffs = {k: v for k, v in vars(changed).items() if getattr(original, k) != v}
    if "microbatch_tokens" in diffs:
        diffs["microbatch_tokens"] = min(diffs["microbatch_tokens"], current.microbatch_tokens)
    return replace(current, **diffs)


def verdict(plan: Plan, fix: Plan | None) -> str:
    """One line: whether the plan fits the device, and else the change that makes it fit."""
    where = f"{plan.device} ({plan.device_bytes / GiB:.1f} GiB)"
    if plan.fits:
        return f"fits {where}: peak {plan.peak / GiB:.2f} GiB"
    head = f"does not fit {where}: peak {plan.peak / GiB:.2f} GiB"
    if fix is None:
        return head + "; no listed change makes it fit (a larger device, or a smaller model)"
    return f"{head}; {' '.join(fix.overrides)} brings it to {fix.peak / GiB:.2f} GiB"
