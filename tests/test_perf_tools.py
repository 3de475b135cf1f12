"""The performance tooling: the phase clock and its FLOP attribution (scripts/bench/profile_step.py), the
allocator setting, and the benchmark's measurement helpers (scripts/bench/bench_vs_trl.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fixtures import child_env, load_script
from loorl.util.profiling import PhaseClock

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    return load_script(f"bench/{name}.py")


def test_phase_clock_sums_each_phase_and_resets():
    clock = PhaseClock()
    for _ in range(2):
        with clock.phase("forward"):
            torch.ones(10).sum()
    with clock.phase("backward"):
        pass
    times = clock.pop()
    assert set(times) == {"perf/forward_seconds", "perf/backward_seconds"}
    assert times["perf/forward_seconds"] > 0 and clock.pop() == {}


def test_profiler_flops_go_to_the_enclosing_phase():
    """A 64^3 matrix product inside `forward` and one of 32^3 outside any phase (`other`)."""
    profile_step = _script("profile_step")
    clock = PhaseClock()
    a, b = torch.randn(64, 64), torch.randn(32, 32)
    with torch.profiler.profile(with_flops=True) as prof:
        with clock.phase("forward"):
            a @ a
        b @ b
    flops = profile_step.phase_totals(prof, lambda e: e.flops)
    assert flops["forward"] == 2 * 64**3 and flops["other"] == 2 * 32**3 and flops["backward"] == 0


def test_gpu_busy_seconds_count_kernels_not_the_phases_own_ranges():
    """On CUDA a `record_function` range has a device-side span as long as the work under it; summed
    with the kernels it double-counted them (the first H200 profile put 60 ms of 'GPU busy' in a
    10 ms 'other' phase). A range counts 0, an operator its own kernels' microseconds."""
    from types import SimpleNamespace

    profile_step = _script("profile_step")
    phase_range = SimpleNamespace(is_user_annotation=True, self_device_time_total=24_000.0)
    operator = SimpleNamespace(is_user_annotation=False, self_device_time_total=2_000.0)
    assert profile_step.device_seconds(phase_range) == 0.0
    assert profile_step.device_seconds(operator) == pytest.approx(0.002)


def test_the_generation_limits_are_the_hand_computed_ones():
    """scripts/bench/bench_engines.py's limits on a shape worked by hand: 1,000 linear weights, 2 layers of
    2 query heads and 1 key/value head of width 8, 4 rows at a mean context of 10, 2-byte values."""
    bench = _script("bench_engines")
    shape = bench.Shape(rows=4, context=10, linear_weights=1000, layers=2, heads=2, kv_heads=1, head_dim=8,
                        bytes_per_value=2)  # fmt: skip
    assert bench.flops_per_token(shape) == 2 * 1000 + 2 * 2 * 2 * 2 * 8 * 10  # 3,280
    assert bench.bytes_per_step(shape) == (1000 + 2 * 2 * 1 * 8 * 10 * 4) * 2  # 4,560
    compute, memory = bench.limits(shape, flops_per_s=3280e3, bytes_per_s=4560e3)
    assert compute == pytest.approx(1000) and memory == pytest.approx(4000)  # 1,000 steps/s x 4 rows
    assert bench.slots_used([2, 4, 4, 2]) == 0.75  # 12 tokens in 4 rows x 4 steps
    # leaving at half the batch: 4 rows for 2 steps, the 2 long ones for 2 more: 12 tokens in 12 slots
    assert bench.slots_used([2, 4, 4, 2], leave_at=0.5) == 1.0
    # leaving at 3/4: the 2 rows that ended after step 2 are not enough, all 5 run to the end
    assert bench.slots_used([2, 4, 4, 2, 4], leave_at=0.75) == 16 / 20
    assert bench.slots_used([1, 2, 3, 4], leave_at=0.25) == 10 / (4 + 3 + 2 + 1)


def test_a_models_shape_counts_its_linear_weights_and_its_heads():
    """A Qwen2 of hidden 8 (2 query heads, 1 key/value head of width 4), intermediate 16, one layer,
    vocabulary 10, tied embeddings: q 64 + k 32 + v 32 + o 64 + gate, up, down 3 x 128 + head 80."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    bench = _script("bench_engines")
    config = Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    shape = bench.model_shape(Qwen2ForCausalLM(config), rows=3, context=5.0, compute=torch.bfloat16)
    assert shape.linear_weights == 64 + 32 + 32 + 64 + 3 * 128 + 80
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.bytes_per_value) == (
        1,
        2,
        1,
        4,
        2,
    )


@pytest.mark.slow
def test_the_generation_bench_times_a_path_and_splits_its_call(model_cache, tmp_path):
    """scripts/bench/bench_engines.py end to end on the quick tiny model: a row with a rate under the
    limit, and the profiled call's split."""
    out = tmp_path / "engines.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "bench_engines.py"), "--works", "tiny"]
    cmd += ["--paths", "hf:dynamic", "--repeats", "1", "--profile", "--out", str(out)]
    cmd += ["debug=quick", f"model.cache_dir={model_cache}"]
    done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| tiny")]
    assert len(rows) == 2  # the rate's row and the profile's
    rate, compute, share = (float(rows[0][i].replace(",", "").rstrip("%")) for i in (3, 4, 6))
    assert 0 < rate < compute and 0 < share <= 100


def test_keep_freed_memory_is_taken_by_glibc_and_the_process_runs_on():
    """In a fresh process (mallopt is process-wide): glibc accepts both settings, and allocation and
    freeing work after them. Whether a given freed block is reused without page faults varies from
    run to run here (the kernel reclaims idle pages too), so its effect is measured per training step
    instead (docs/performance/index.md: 11.6 -> 7.7 s per SmolLM2 step)."""
    code = textwrap.dedent(
        """
        import torch
        from loorl.util.allocator import keep_freed_memory
        assert keep_freed_memory()
        for _ in range(3):
            x = torch.ones(16 << 20)
            del x
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=child_env())  # fmt: skip
    assert out.stdout.split()[-1] == "ok"


ONEDNN_SHAPES = textwrap.dedent(
    """
    import os, re
    import torch
    import loorl
    print(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "unset"))  # a bare import sets nothing
    from loorl.util.hardware import bf16_speedup
    bf16_speedup()  # the config's bf16 probe: the first bf16 product of a library run
    print(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "unset"))
    def resident_mb():
        return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1e3
    w, x = torch.randn(128, 64, dtype=torch.bfloat16), torch.randn(300, 64, dtype=torch.bfloat16)
    for rows in (1, 2):
        x[:rows] @ w.T
    before = resident_mb()
    for rows in range(3, 300):  # 297 shapes: a primitive each where oneDNN runs bf16 products
        x[:rows] @ w.T
    print(resident_mb() - before)
    """
)


def test_the_bf16_probe_caps_onednns_primitive_cache_and_a_users_value_stays():
    """297 bf16 products of new shapes in a fresh process that ran loorl's bf16 probe: capped (no
    variable set) the resident set grows at least 40 MB less than with oneDNN's own 1,024, set by the
    user and kept (about 0.25 MB a primitive: 213 against 131 MB measured on the bf16 EPYC). Where bf16
    products do not go through oneDNN (an AVX2-only CPU) nothing grows and only the setting is
    checked. Importing loorl alone leaves the environment as it was."""

    def child(**extra: str) -> tuple[str, str, float]:
        env = {k: v for k, v in child_env().items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"} | extra
        out = subprocess.run([sys.executable, "-c", ONEDNN_SHAPES], capture_output=True, text=True,
                             check=True, env=env).stdout.split()  # fmt: skip
        return out[0], out[1], float(out[2])

    imported, capacity, capped = child()
    _, users, uncapped = child(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert (imported, capacity, users) == ("unset", "16", "1024")
    if uncapped > 60:  # oneDNN compiled a primitive per shape: the cap must show
        assert capped < uncapped - 40, (capped, uncapped)


def _tiny_model(path: Path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("entry", ["cli", "probe", "model_load"])
def test_each_entry_caps_onednns_primitive_cache_before_its_first_product(entry, tmp_path, monkeypatch):
    """The CLIs' body, the bf16 probe's product and the model load each set the cap (tests/conftest.py
    set it for the session: it is taken out here); a value already set stays."""
    from loorl.cli import console
    from loorl.models.load import load_causal_lm
    from loorl.util.hardware import square_product

    monkeypatch.setattr(console, "quiet_library_output", lambda: None)  # the session's loggers stay
    enter = {
        "cli": lambda: console.run_cli(lambda cfg: None, None),
        "probe": lambda: square_product(torch.bfloat16, 4),
        "model_load": lambda: load_causal_lm(_tiny_model(tmp_path / "model"), dtype="bfloat16"),
    }[entry]
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    enter()
    assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == "16"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    enter()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"


def test_peak_memory_follows_the_process_tree(tmp_path):
    """The sampled peak covers a child process's allocation, not only the parent's."""
    bench = _script("bench_vs_trl")
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', " \
           "'import time; x = bytearray(300 << 20); time.sleep(1.5)'], check=True)"  # fmt: skip
    seconds, peak = bench.timed([sys.executable, "-c", code], tmp_path / "log.txt")
    assert peak > 300 << 20 and seconds > 1.5


def test_benchmark_reads_both_systems_step_metrics_and_tables_them(tmp_path):
    bench = _script("bench_vs_trl")
    run = tmp_path / "loorl"
    (run / "csv").mkdir(parents=True)
    header = ("perf/step_seconds,perf/gen_seconds,perf/grade_seconds,perf/prepare_seconds,"
              "rollout/gen_tokens,perf/train_tokens")  # fmt: skip
    rows = ["", "2.0,1.0,0.0,0.0,100,400", "3.0,1.0,0.5,0.5,100,400", "4.0,1.0,0.0,0.0,100,400"]
    (run / "csv" / "metrics.csv").write_text(header + "\n" + "\n".join(["," * 5] + rows[1:]) + "\n")
    loorl = bench.loorl_step_metrics(run)
    assert loorl == {"step_s": 3.0, "gen_tok_s": 100.0, "train_tok_s": 1200 / (1 + 1 + 3)}
    trl_run = tmp_path / "trl"
    trl_run.mkdir()
    timing = {
        "step": [6.0, 8.0, 7.0],
        "gen": [2.0, 2.0, 2.0],
        "gen_tokens": [100] * 3,
        "train_tokens": [500] * 3,
    }
    (trl_run / "trl_metrics.json").write_text(json.dumps({"timing": timing}))
    trl = bench.trl_step_metrics(trl_run)
    assert trl == {"step_s": 7.0, "gen_tok_s": 50.0, "train_tok_s": 1500 / 15}
    common = {"work": "tiny", "run": 0, "process_s": 10.0, "peak_mib": 500.0, "accuracy": 0.5}
    text = bench.table([{"system": "loorl", **common, **loorl}, {"system": "trl", **common, **trl}],
                       {"tiny": 3}, repeats=1)  # fmt: skip
    assert "| tiny (3 steps) | loorl | 10.0 | 3.00 | 100 | 240 | 500 | 50.0% | 1.00x, 2.33x |" in text


def test_paired_seeds_table_both_systems_per_seed():
    bench = _script("bench_vs_trl")
    assert not bench.parse_args([]).paired_seeds and bench.parse_args(["--paired-seeds"]).paired_seeds
    rows = [
        {"system": s, "work": "recipe", "run": i, "seed": i, "process_s": p, "accuracy": a}
        for s, i, p, a in [("loorl", 0, 90.0, 0.7), ("trl", 0, 600.0, 0.745),
                           ("loorl", 1, 80.0, 0.725), ("trl", 1, 640.0, 0.70)]
    ]  # fmt: skip
    text = bench.paired_table(rows)
    assert "| recipe | 0 | 70.0% | 74.5% | -4.5 | 0.15 |" in text
    assert "| recipe | 1 | 72.5% | 70.0% | +2.5 | 0.12 |" in text
    assert "Mean difference over 2 seed(s): -1.0 points." in text  # (-4.5 + 2.5) / 2


def test_a_finished_runs_row_is_kept_and_a_run_cut_short_starts_again(tmp_path):
    """A later invocation takes a finished run's row (nothing runs); other overrides, or no row, run."""
    bench = _script("bench_vs_trl")
    missing = tmp_path / "no-such-python"  # starting a TRL run with it would raise
    overrides = [*bench.WORK["recipe"]["overrides"], "rl.steps=60", "seed=1"]
    row = {"system": "trl", "work": "recipe", "run": 1, "seed": 1, "accuracy": 0.8, "overrides": overrides}
    (tmp_path / "recipe-trl-1.row.json").write_text(json.dumps(row))
    again = bench.run_once("trl", "recipe", 60, 1, tmp_path, missing, paired_seeds=True)
    assert again == row
    partial = tmp_path / "recipe-trl-1"
    (partial / "csv").mkdir(parents=True)  # a run of 15 steps cut short
    with pytest.raises(FileNotFoundError, match="no-such-python"):  # 15 steps: the 60-step row is not it
        bench.run_once("trl", "recipe", 15, 1, tmp_path, missing, paired_seeds=True)
    assert not partial.exists()


# ---- the TRL interpreter: a venv made on first use, or --trl-python (offline) ------------------------
def _fake_trl_packages(root: Path) -> Path:
    """Empty `trl`, `accelerate` and `datasets` packages: what --trl-python's check imports."""
    for name in ("trl", "accelerate", "datasets"):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
    return root


def test_trl_python_option_is_parsed():
    bench = _script("bench_vs_trl")
    assert bench.parse_args([]).trl_python is None  # the venv, as before
    args = bench.parse_args(["--trl-python", "/opt/trl/bin/python", "--work", "tiny"])
    assert args.trl_python == "/opt/trl/bin/python" and args.work == ["tiny"]


def test_with_trl_python_no_venv_is_made(tmp_path, monkeypatch):
    bench = _script("bench_vs_trl")
    monkeypatch.setenv("PYTHONPATH", str(_fake_trl_packages(tmp_path / "site")))
    monkeypatch.setattr(bench, "ensure_trl_venv", lambda venv: pytest.fail("a venv was made"))
    venv = tmp_path / "venv"
    python = bench.trl_interpreter(trl_python=sys.executable, venv=venv, systems=["loorl", "trl"])
    assert python == Path(sys.executable) and not venv.exists()
    name = Path(sys.executable).name  # a command on PATH is taken too
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert bench.trl_interpreter(trl_python=name, venv=venv, systems=["trl"]).name == name


def test_without_trl_python_the_venv_is_made_as_before(tmp_path, monkeypatch):
    bench = _script("bench_vs_trl")
    made = []
    monkeypatch.setattr(bench, "ensure_trl_venv", lambda venv: made.append(venv) or venv / "bin" / "python")
    venv = tmp_path / "venv"
    python = bench.trl_interpreter(trl_python=None, venv=venv, systems=["loorl", "trl"])
    assert python == venv / "bin" / "python"
    assert bench.trl_interpreter(trl_python=None, venv=venv, systems=["loorl"]) == Path(sys.executable)
    assert made == [venv]  # only when TRL runs


def test_a_trl_python_without_trl_is_refused(tmp_path):
    bench = _script("bench_vs_trl")
    bare = tmp_path / "python"  # an interpreter without site-packages: no trl, whatever is installed here
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    with pytest.raises(ValueError, match=r"--trl-python=.*cannot import trl, accelerate, datasets \(.*trl"):
        bench.checked_trl_python(str(bare))
    with pytest.raises(ValueError, match=r"--trl-python=.*nope.* is not an executable file: point it at"):
        bench.checked_trl_python(str(tmp_path / "nope" / "python"))
    with pytest.raises(ValueError, match="is not an executable file"):
        bench.checked_trl_python(str(tmp_path))  # a folder


def test_the_script_refuses_a_missing_trl_python_in_one_line_before_anything_runs(tmp_path):
    script = ROOT / "scripts" / "bench" / "bench_vs_trl.py"
    cmd = [sys.executable, str(script), "--trl-python", str(tmp_path / "nope"), 
           "--venv", str(tmp_path / "venv"), "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"error: --trl-python={tmp_path}")
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_trl_peer_runs_one_step_on_the_tiny_model(tmp_path):
    """TRL's RLOOTrainer on loorl's default work (its own venv; created from the package index)."""
    bench = _script("bench_vs_trl")
    python = bench.ensure_trl_venv(tmp_path / "venv")
    script = ROOT / "scripts" / "peers" / "trl_rloo.py"
    subprocess.run([str(python), str(script), "--out", str(tmp_path / "run"),
                    "rl.steps=2"], check=True, cwd=ROOT)  # fmt: skip
    metrics = json.loads((tmp_path / "run" / "trl_metrics.json").read_text())
    assert len(metrics["timing"]["step"]) == 2 and metrics["prompt_tokens_as_loorl"]
    assert (tmp_path / "run" / "policy" / "config.json").exists()


# ---- LoRA weights into vLLM: merged stream against vLLM's own LoRA (scripts/bench/bench_lora_sync.py) ----
def test_lora_sync_bench_arguments():
    bench = _script("bench_lora_sync")
    args, overrides = bench.parse_args(["--syncs", "2", "model.lora.r=8"])
    assert args.syncs == 2 and overrides == [
        "experiment=smollm2_arithmetic_lora",
        "rollout=vllm",
        "model.lora.r=8",
    ]
    with pytest.raises(SystemExit):
        bench.parse_args(["--syncs", "0"])


@pytest.mark.slow
@pytest.mark.vllm
def test_lora_sync_bench_runs_both_paths_on_the_tiny_model(tmp_path, model_cache):
    """Both real vLLM engines (merged weights; vLLM LoRA) on the tiny model; their greedy answers are the
    HF adapted policy's on most prompts (float rounding differs between the two ways of applying B @ A)."""
    pytest.importorskip("vllm")
    out = tmp_path / "lora_sync.md"
    script = ROOT / "scripts" / "bench" / "bench_lora_sync.py"
    cmd = [sys.executable, str(script), "--syncs", "1", "--out", str(out),
           "model=tiny", "task=arithmetic", "model.lora={r: 4}", f"model.cache_dir={model_cache}",
           "model.dtype=float32"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [
        line
        for line in out.read_text().splitlines()
        if line.startswith("| merged") or line.startswith("| vLLM")
    ]
    assert len(rows) == 2
    for row in rows:
        agree = float(row.rstrip(" |").rsplit("|", 1)[1].strip().rstrip("%"))
        assert agree >= 80, row


# ---- scripts/bench/bench_memory_slope.py --------------------------------------------------------------
def test_memory_slope_takes_each_steps_largest_phase_peak_and_fits_by_hand():
    slope = _script("bench_memory_slope")
    history = {
        "perf/gen_peak_host_gib": [[0, 1.0], [1, 2.0], [2, 2.5]],
        "perf/backward_peak_host_gib": [[0, 1.5], [1, 1.0], [2, 3.0]],
        "perf/backward_rise_host_gib": [[0, 9.0], [1, 9.0], [2, 9.0]],  # a rise, not a peak: ignored
        "train/loss": [[0, 7.0]],
    }
    assert slope.step_peaks(history) == {0: 1.5, 1: 2.0, 2: 3.0}
    # y = 2 + 0.01 x over steps 10..14: 1 GiB per 100 steps; an alternation ending high: sxy 2 over sxx 42
    assert slope.slope_per_100([10, 11, 12, 13, 14], [2.10, 2.11, 2.12, 2.13, 2.14]) == pytest.approx(1.0)
    assert slope.slope_per_100(list(range(8)), [1, 2, 1, 2, 1, 2, 1, 2]) == pytest.approx(100 * 2 / 42)
    assert slope.slope_per_100([3], [1.0]) == 0.0
    assert slope.window_maxima([1, 5, 2, 2, 7, 1, 3], 3) == [5, 7, 3]  # slices 0:2, 2:5, 5:7 (7/3 rounded)
    assert slope.window_maxima([4.0], 3) == [4.0]


def test_memory_slope_leaves_the_warm_up_out_and_refuses_too_few_steps():
    slope = _script("bench_memory_slope")
    peaks = {0: 9.0, 1: 8.0, 2: 3.0, 3: 3.0, 4: 3.0, 5: 3.0}  # a warm-up at 8-9 GiB, then level
    result = slope.summarise(peaks, warmup=2, windows=2)
    assert result["slope_gib_per_100"] == 0.0 and result["window_max_gib"] == [3.0, 3.0]
    assert (result["first_step"], result["last_step"], result["steps"]) == (2, 5, 4)
    assert result["peak_gib"] == 3.0 and result["warmup_peak_gib"] == 9.0
    with pytest.raises(SystemExit, match="--warmup 5: only 1 steps after it"):
        slope.summarise(peaks, warmup=5, windows=2)
    with pytest.raises(SystemExit):  # argparse's one-line error, before any run
        slope.main(["--steps", "10", "--warmup", "9"])


@pytest.mark.slow
def test_the_tiny_defaults_memory_stays_flat_over_a_long_run(tmp_path, model_cache):
    """A real 150-step run of the default job (a fresh process): the slope after warm-up is within the
    script's limit and its report says so."""
    slope = _script("bench_memory_slope")
    code = slope.main(["--steps", "150", "--out", str(tmp_path), "--", f"model.cache_dir={model_cache}"])
    result = json.loads((tmp_path / "memory_slope.json").read_text())
    assert code == 0 and abs(result["slope_gib_per_100"]) <= 0.05 and result["steps"] == 130
    assert (tmp_path / "memory_slope.md").read_text().startswith("# Memory over a long run: flat")
    assert (tmp_path / "memory_slope_run" / "summary.md").exists()
