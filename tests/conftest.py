"""Shared fixtures: one way to build a config (lightning-hydra-template's pattern).

- `make_config(*overrides)` (package scope): `conf/train.yaml` with overrides, its output in a
  throwaway folder; `quick_config(*overrides)` the same on the quick profile (`debug=quick`, the
  one `python src/train.py debug=quick` runs), with the session's model cache.
- `default_cfg(*overrides)` and `quick_cfg(*overrides)` (per test): the same, writing under the test's
  own `tmp_path` (`<tmp_path>/run`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loorl.config import compose_config

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One cache for the session: the quick tiny model is built once and reused by every test."""
    return tmp_path_factory.mktemp("model_cache")


@pytest.fixture(scope="package")
def make_config(tmp_path_factory):
    """`make_config(*overrides, output_dir=...)`: the default config (output in a shared folder)."""
    unused = tmp_path_factory.mktemp("out")

    def make(*overrides: str, output_dir: str | Path = unused):
        return compose_config(f"output_dir={output_dir}", *overrides)

    return make


@pytest.fixture(scope="package")
def quick_config(make_config, model_cache):
    """`quick_config(*overrides, output_dir=...)`: the quick profile with the session's model cache."""

    def make(*overrides: str, **kwargs):
        return make_config("debug=quick", f"model.cache_dir={model_cache}", *overrides, **kwargs)

    return make


@pytest.fixture
def default_cfg(make_config, tmp_path):
    """`default_cfg(*overrides)`: the default config writing into `<tmp_path>/run`."""
    return lambda *overrides: make_config(*overrides, output_dir=tmp_path / "run")


@pytest.fixture
def quick_cfg(quick_config, tmp_path):
    """`quick_cfg(*overrides)`: the quick profile writing into `<tmp_path>/run`; overrides win."""
    return lambda *overrides: quick_config(*overrides, output_dir=tmp_path / "run")
