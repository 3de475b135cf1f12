"""Helpers importable from tests (pytest puts tests/ on sys.path)."""

from __future__ import annotations

from conftest import QUICK, compose_cfg


def quick_cfg_at(model_cache, *extra: str, output_dir: str = "/tmp/loorl-test-unused"):
    return compose_cfg([*QUICK, f"model.cache_dir={model_cache}", f"output_dir={output_dir}", *extra])
