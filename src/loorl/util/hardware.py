"""What the machine can do, measured rather than assumed: the CPU's kernel capability and whether
bf16 matrix products are fast on it.

The same recipe meets CPUs with and without bf16 units. With them (AVX512-BF16, AMX) a bf16 matrix
product runs at several times the float32 rate; without them oneDNN emulates bf16 and runs at a
small fraction of it (measured on a 2-core AVX-512 EPYC, 512x512 products: 2.5x float32 with its
bf16 units, 0.015x with `ONEDNN_MAX_CPU_ISA=AVX2`, which hides them). Instruction-set flags do not tell
which kernels torch and oneDNN will pick, so `fast_compute_dtype` times both.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loorl.util.onednn import cap_onednn_primitive_cache

log = logging.getLogger("loorl")

BF16_SPEEDUP_NEEDED = 1.5  # bf16 must beat float32 by this factor to be chosen (it also rounds)


def cpu_capability() -> str:
    """The vector extension torch's CPU kernels run with (`ATEN_CPU_CAPABILITY` lowers it)."""
    return str(torch.backends.cpu.get_cpu_capability())


def _cpuinfo() -> str:
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.is_file() else ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name as /proc/cpuinfo gives it, without trademark marks (`platform.machine()`
    where there is no such file)."""
    cpuinfo = _cpuinfo() if cpuinfo is None else cpuinfo
    name = next((x.split(":", 1)[1].strip() for x in cpuinfo.splitlines() if x.startswith("model name")), "")
    words = name.replace("(R)", "").replace("(TM)", "").split()
    return " ".join(w for w in words if w != "Processor") or platform.machine()


def has_bf16_units(cpuinfo: str | None = None) -> bool:
    """Whether the CPU lists bf16 units (AVX512-BF16 or AMX): with them a bf16 matrix product beats
    float32; without them oneDNN emulates it (`fast_compute_dtype` times both)."""
    cpuinfo = _cpuinfo() if cpuinfo is None else cpuinfo
    flags = set(next((x.split(":", 1)[1].split() for x in cpuinfo.splitlines() if x.startswith("flags")), []))
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def machine_line(*, on_cuda: bool = False) -> str:
    """What a run was computed on, in one line: the CPU's model, the cores this process may use, the
    vector extension torch's kernels run with and whether there are bf16 units (what decides a run's
    numbers and speed on the CPU: the same seed follows other float sums on AVX2 and AVX-512 kernels),
    torch's version, and with `on_cuda` (a run that computes on CUDA: `uses_cuda`) the visible GPUs.
    Without it CUDA is not touched: naming a GPU initialises CUDA, and a CPU run on a GPU node must
    stay a CPU run (`cuda_in_use`). Kept in every run's summary (`machine`), so a study page names the
    machines its runs were made on, not the one that wrote the page."""
    from loorl.parallel.launch import cpu_set

    cpuinfo = _cpuinfo()
    parts = [cpu_model(cpuinfo), f"{len(cpu_set())} cores", f"{cpu_capability()} kernels",
             "bf16 units" if has_bf16_units(cpuinfo) else "no bf16 units"]  # fmt: skip
    if on_cuda:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        parts += [f"{name} x{names.count(name)}" for name in dict.fromkeys(names)]
    return ", ".join([*parts, f"torch {torch.__version__}"])


def fastest_interleaved(
    products: dict[str, Callable[[], object]], *, reps: int, min_seconds: float = 0.0
) -> dict[str, float]:
    """Each product's fastest timed call, after one warm-up call each. The products take turns (a, b,
    a, b, ...) for at least `reps` rounds and until `min_seconds` have passed. A stall of the machine
    (another tenant, a page-in) then moves the ratio of two minima only if it covers the whole
    probe, both products' calls, where timing one product's calls and then the other's lets a
    stall of a few milliseconds land on one side only (a recipe's probe read bf16 at 0.17x float32
    once on the bf16 EPYC, which reads 1.96-2.42x in 212 other probes, and that run trained in
    float32)."""
    for product in products.values():
        product()
    best = dict.fromkeys(products, float("inf"))
    began, rounds = time.perf_counter(), 0
    while rounds < reps or time.perf_counter() - began < min_seconds:
        for name, product in products.items():
            start = time.perf_counter()
            product()
            best[name] = min(best[name], time.perf_counter() - start)
        rounds += 1
    return {name: max(seconds, 1e-9) for name, seconds in best.items()}


def square_product(dtype: torch.dtype, size: int) -> Callable[[], torch.Tensor]:
    """A product of two random [size, size] CPU tensors in `dtype`, to time. The bf16 probe's may be
    the process's first bf16 product (resolving `model.dtype`): oneDNN's cache is capped before it."""
    cap_onednn_primitive_cache()
    return functools.partial(
        torch.matmul, torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    )


def matmul_seconds(dtype: torch.dtype, *, size: int = 512, reps: int = 5) -> float:
    """The fastest of `reps` timed products of two [size, size] CPU tensors in `dtype`, after one
    warm-up product. The minimum, not the mean: other work on the machine only ever adds time."""
    return fastest_interleaved({"product": square_product(dtype, size)}, reps=reps)["product"]


def matmul_flops_per_s(dtype: torch.dtype, *, size: int = 2048, reps: int = 5) -> float:
    """The CPU's matrix-product peak in `dtype`: FLOP/s of the fastest of `reps` [size, size] products
    (the peak that scripts/bench/profile_step.py and scripts/bench/bench_engines.py measure against)."""
    return 2 * size**3 / matmul_seconds(dtype, size=size, reps=reps)


@functools.cache
def bf16_speedup(*, size: int = 512, reps: int = 5, min_seconds: float = 0.05) -> float:
    """How many times faster a bf16 matrix product runs than a float32 one on this CPU (measured once
    a process, the two taking turns: 50 ms with bf16 units, about a second without them)."""
    products = {"float32": square_product(torch.float32, size), "bf16": square_product(torch.bfloat16, size)}
    seconds = fastest_interleaved(products, reps=reps, min_seconds=min_seconds)
    return seconds["float32"] / seconds["bf16"]


def dtype_for_speedup(speedup: float) -> str:
    return "bfloat16" if speedup >= BF16_SPEEDUP_NEEDED else "float32"


@functools.cache
def fast_compute_dtype(accelerator: str = "auto") -> str:
    """'bfloat16' where bf16 compute is fast on the device the run trains on (`trainer.accelerator`: a
    CUDA GPU that supports it, or a CPU whose bf16 matrix product beats float32 by
    `BF16_SPEEDUP_NEEDED`), else 'float32'."""
    if uses_cuda(accelerator):
        choice = "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
        log.info("compute dtype %s: CUDA device %s", choice, torch.cuda.get_device_name())
        return choice
    speedup = bf16_speedup()
    choice = dtype_for_speedup(speedup)
    log.info("compute dtype %s: a bf16 matrix product runs at %.2fx float32 on this CPU (%s kernels)",
             choice, speedup, cpu_capability())  # fmt: skip
    return choice


TF32_HINTS = (  # what torch's compiler and Lightning say while float32 products run at "highest"
    "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled",
    "To properly utilize them, you should set `torch.set_float32_matmul_precision",
)


class _DropTF32Hints(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(hint in record.getMessage() for hint in TF32_HINTS)


def set_float32_matmul_precision(precision: str) -> None:
    """`torch.set_float32_matmul_precision(precision)` (the `float32_matmul_precision` setting), and,
    the choice being made in the config, the hints to change it that torch's inductor (a warning when
    it compiles float32 work, seen in the CUDA test set's log on an H200) and Lightning (an info line
    per run) print on GPUs with TF32 cores are dropped from the log."""
    torch.set_float32_matmul_precision(precision)
    import warnings

    warnings.filterwarnings("ignore", message=TF32_HINTS[0])
    for name in ("lightning.fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTF32Hints) for f in logger.filters):
            logger.addFilter(_DropTF32Hints())


def inductor_cache_for_this_cpu() -> str:
    """Point torch's inductor at a compile cache of this CPU capability's own (unless the user chose
    one: `TORCHINDUCTOR_CACHE_DIR`), and return it.

    Inductor's cache key does not hold `ATEN_CPU_CAPABILITY`: a compiled decoding step cached by a
    process at one capability and loaded by one at another drew wrong tokens here (the tiny model's
    greedy [29, 0, 0, 0, 0] against the eager loop's [29, 27, 1]: torch 2.13, the machine's own
    kernels then avx2; each on a fresh cache of its own is right). A capability is fixed for a
    process, so one directory per capability keeps every process on its own kernels."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # unset, torch's default (torch writes it there once it compiled), or a parent process's choice
    # of this rule, inherited by a child that may run at another capability: this process's own
    chosen = chosen and os.path.abspath(chosen)
    if not chosen or chosen == default or chosen.startswith(default + "_"):
        chosen = f"{default}_{cpu_capability().lower()}"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen
    return chosen


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_in_use() -> bool:
    """Whether this process has started CUDA (then kernels may be queued when a phase starts or ends,
    and the allocator keeps a peak). A flag read, no driver call: False on CPU builds, on machines
    without a GPU, and in runs that never touch CUDA."""
    return torch.cuda.is_initialized()


def uses_cuda(accelerator: str = "auto", *, available: bool | None = None) -> bool:
    """Whether a run with `trainer.accelerator=accelerator` computes on CUDA: never for cpu, always for
    gpu/cuda, and for auto where a CUDA device is available. Every choice made for the device (engine,
    attention, decoding loop, compute dtype, freed-memory policy, a reward model's device) asks this,
    not `cuda_available()`: a run pinned to the CPU on a GPU node is a CPU run. `available`: whether
    CUDA is (None: ask torch)."""
    if accelerator == "cpu":
        return False
    if accelerator in ("gpu", "cuda"):
        return True
    return cuda_available() if available is None else available
