"""A vLLM server for a loorl run, on this node or another: `rollout=vllm_server` then points at it.

    python scripts/cluster/serve.py --port 8000 model=smollm2_135m rollout=vllm_server  # serve it here
    python scripts/cluster/serve.py --print model=smollm2_135m rollout=vllm_server      # the command only
    python src/train.py model=smollm2_135m rollout=vllm_server 'rollout.server.urls=[http://node7:8000]'

The overrides are the training run's: the script composes the same config, builds or finds the same
model folder (the tiny model is built and cached; a GGUF model converted), and starts vLLM's
OpenAI-compatible server on it (`loorl.rollout.engines.server_launch.server_command`: the module
`vllm serve` wraps, since that command fails with the CPU wheel), with the RL endpoints on
(VLLM_SERVER_DEV_MODE=1), token-in/token-out generation, processed log-probs, loorl's weight-transfer
backend, and with `model.lora` the adapters sized from `rollout.max_staleness`. The server's node needs
loorl installed beside vLLM (its `loorl_files` backend is a vLLM plugin) and, for that backend, a folder
it shares with the trainer (`rollout.server.transfer_folder`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=8000, help="the server's port (default 8000)")
    parser.add_argument("--host", default="0.0.0.0", help="the address it listens on (default: every one)")
    parser.add_argument("--print", action="store_true", help="print the command and exit")
    parser.add_argument("overrides", nargs="*", help="the training run's config overrides (key=value)")
    args = parser.parse_args(argv)

    from hydra.utils import instantiate

    from loorl.config import compose_config, load_settings
    from loorl.errors import ConfigError
    from loorl.models.sources import resolve_model_path
    from loorl.rollout.engines.server_launch import SERVER_ENVIRONMENT
    from loorl.rollout.engines.vllm_engine import context_length
    from loorl.rollout.engines.vllm_server import launch_command, server_settings
    from loorl.util.hardware import cuda_available

    overrides = [o for o in args.overrides if not o.startswith("output_dir=")]
    out = next((o for o in args.overrides if o.startswith("output_dir=")), "output_dir=/tmp/loorl-serve")
    try:
        s = load_settings(compose_config(out, *overrides))
        server = server_settings(s.rollout)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    path = resolve_model_path(s.model, s.task, instantiate(s.task))
    command = launch_command(
        server, model_path=path, port=args.port, host=args.host, dtype=server.dtype or s.model.dtype,
        max_model_len=server.max_model_len or context_length(s.rollout, path, s.completion_tokens),
        cuda=cuda_available(), lora_rank=s.model.lora.r if s.model.lora else None,
        max_staleness=s.rollout.max_staleness,
    )  # fmt: skip
    environment = " ".join(f"{k}={v}" for k, v in SERVER_ENVIRONMENT.items())
    print(f"{environment} {shlex.join(command)}", flush=True)
    if args.print:
        return 0
    os.execvpe(command[0], command, os.environ | SERVER_ENVIRONMENT)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
