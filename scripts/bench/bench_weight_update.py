"""One weight update into a vLLM server, timed and counted: full weights and LoRA, two transfer folders.

    python scripts/bench/bench_weight_update.py                           # the tiny default model
    python scripts/bench/bench_weight_update.py model=smollm2_135m        # SmolLM2-135M (bf16)
    python scripts/bench/bench_weight_update.py --updates 5 model.lora.r=8

The script starts a vLLM server for the run's config (as scripts/cluster/serve.py would, LoRA enabled), builds
the run's `rollout=vllm_server` engine against it and the policy, and times `ServerEngine.sync`
(pause, transfer through vLLM's weight-transfer API, finish, resume: the whole update) and counts its
bytes (`update_bytes`), after one warm-up update:
- full: the policy's weights through `loorl_files` with `transfer_folder` /dev/shm (shared memory) and
  a folder on disk (`--disk-folder`, default /tmp);
- LoRA (`model.lora`, default r 16): the first update (base weights + adapter) and the later ones
  (the adapter alone, loaded with /v1/load_lora_adapter under a new name).
Prints a markdown table (medians) and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--updates", type=int, default=3, help="timed updates per row, after a warm-up")
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--disk-folder", default="/tmp")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "weight_update.md")
    args, overrides = parser.parse_known_args(argv)

    import torch
    from hydra.utils import instantiate

    from loorl.build import build_rollout_engine
    from loorl.config import compose_config, load_settings
    from loorl.models.load import load_causal_lm, load_tokenizer
    from loorl.models.lora import apply_lora
    from loorl.models.sources import resolve_model_path
    from loorl.rollout.engines.base import PolicyWeights
    from loorl.rollout.engines.server_launch import LocalServer, server_command, wait_until_healthy
    from loorl.settings import LoraSettings

    out_dir = tempfile.mkdtemp(prefix="loorl-bench-update-")
    base = ["rollout=vllm_server", f"output_dir={out_dir}", *overrides]
    s = load_settings(compose_config(*base))
    path = resolve_model_path(s.model, s.task, instantiate(s.task))
    lora = s.model.lora or LoraSettings(r=16)
    command = server_command(model_path=path, port=args.port, dtype=s.model.dtype, max_model_len=512,
                             backend="loorl_files", kv_cache_memory_gib=0.5, max_loras=2,
                             max_lora_rank=lora.r)  # fmt: skip
    server = LocalServer(command, url=f"http://127.0.0.1:{args.port}", log_path=Path(out_dir) / "server.log")
    rows = []
    try:
        wait_until_healthy(server.url, timeout=900, server=server)
        tokenizer = load_tokenizer(path)
        policy = load_causal_lm(path, dtype="float32")
        urls = f"rollout.server.urls=[{server.url}]"

        def engine(*more: str):
            return build_rollout_engine(load_settings(compose_config(*base, urls, *more)), tokenizer, path)

        def timed(e, module, first_only: bool = False) -> tuple[float, float, float, float]:
            seconds, sizes = [], []
            for version in range(1 if first_only else args.updates + 1):
                with torch.no_grad():  # new weights each time: the update moves real bytes
                    for p in module.parameters():
                        if p.requires_grad:
                            p.add_(torch.randn_like(p) * 1e-4)
                e.sync(PolicyWeights(module), version=version, force=False)
                seconds.append(e.update_seconds)
                sizes.append(e.update_bytes)
            later = seconds[1:] or seconds
            return seconds[0], sizes[0], statistics.median(later), statistics.median(sizes[1:] or sizes)

        folders = (("full, /dev/shm", "/dev/shm"), (f"full, {args.disk_folder}", args.disk_folder))
        for label, folder in folders:
            e = engine(f"rollout.server.transfer_folder={folder}")
            _, _, sec, size = timed(e, policy)
            rows.append((label, sec, size))
            e.close()
        peft_policy = apply_lora(policy, lora, seed=0)
        with torch.no_grad():  # B = 0 would make the adapter the base model
            for n, p in peft_policy.named_parameters():
                if ".lora_B" in n:
                    p.normal_(0, 1e-3)
        e = engine(f"model.lora={{r: {lora.r}}}")
        first_s, first_b, sec, size = timed(e, peft_policy)
        rows += [(f"LoRA r {lora.r}, first update (base + adapter)", first_s, first_b),
                 (f"LoRA r {lora.r}, later updates (the adapter)", sec, size)]  # fmt: skip
        e.close()
    finally:
        server.stop()
    model = s.model.name if s.model.name_or_path is None else s.model.name_or_path
    given = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"`python scripts/bench/bench_weight_update.py {given}`".replace("  ", " "),
        f"({model}, {s.model.dtype}; {time.strftime('%Y-%m-%d')}; "
        f"medians of {args.updates} updates after one)",
        "",
        "| update | seconds | MB sent |",
        "| --- | --- | --- |",
        *(f"| {label} | {sec:.3f} | {size / 1e6:.2f} |" for label, sec, size in rows),
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
