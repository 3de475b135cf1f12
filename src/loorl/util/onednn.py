"""oneDNN's primitive cache, capped at 16 compiled primitives instead of its 1,024.

On a CPU with bf16 units, bf16 matrix products go through oneDNN, which compiles a primitive per
shape and keeps up to 1,024 of them, about 0.25 MB each. Packed micro-batches and shrinking
decoding batches make new shapes every step, so the cache grows through a run: measured on the
bf16 EPYC, SmolLM2's recipe in bf16 (60 steps, trimmed every 5) peaked at 5.00 GB with 1,024,
4.80 GB with 128 and 4.59 GB with 16, with the same losses and the same s/step (4.18, 4.18,
4.13); with 0 (no cache) a step took twice as long. A decoding step's products (six shapes) and
a micro-batch's fit in 16. Where bf16 products do not use oneDNN (an AVX2-only CPU, float32)
it changes nothing.

oneDNN sizes the cache at its first use, so the cap must come before the process's first bf16
product; importing loorl does not set it (an import changes no environment). It is applied where
that product can come first: the CLIs (`loorl.cli.console.run_cli`), the scripts that build or run
models, the test suite (tests/conftest.py), and, for library use, the bf16 probe
(`loorl.util.hardware.square_product`, which resolving `model.dtype`'s `compute_dtype` runs) and
the model load (`loorl.models.load.load_causal_lm`).
"""

from __future__ import annotations

import os

ONEDNN_PRIMITIVE_CACHE = 16  # primitives oneDNN keeps compiled (its default: 1024)


def cap_onednn_primitive_cache(capacity: int = ONEDNN_PRIMITIVE_CACHE) -> None:
    """Keep at most `capacity` compiled oneDNN primitives (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`; a value
    the user set stays, and so does the first call's: calling it again changes nothing)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
