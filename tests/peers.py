"""The peers' own code as test oracles: verl 0.9.1's `verl/trainer/ppo/core_algos.py` and TRL 1.16's
`GRPOTrainer`, each from its wheel.

Each wheel is fetched into the session's wheel cache (as loorl fetches its own wheels; a skip where the
package index cannot be reached) and unpacked there, never installed and never copied into loorl.
`core_algos` imports Ray, tensordict, codetiming and orjson at the top (for its data protocol, timers
and trackers, which no estimator or loss here uses): while the oracle is loaded, an import of one that
is not installed gets an empty stand-in module, and afterwards every stand-in, every verl or TRL module
and their changes to the environment and the root logger are undone, so the tests after it see the
interpreter as it was.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import types
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fixtures import needs_wheel

VERL_WHEEL = ("verl", "0.9.1")
TRL_WHEEL = ("trl", "1.16.0")
# imported by verl at the top (its data protocol, timers and trackers), used by nothing compared; a stand-in
# only where the interpreter lacks the real one (orjson is there beside some of loorl's dependencies)
STAND_INS = ("ray", "tensordict", "codetiming", "orjson")


class _StandIn(types.ModuleType):
    """An empty module whose every attribute is a new empty class (verl subclasses and annotates with
    them at import time; nothing compared calls them)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(
            name,
            (),
            {"__init__": lambda self, *a, **k: None, "__class_getitem__": classmethod(lambda c, _: c)},
        )


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.standing_in: set[str] = set()  # the top-level names this finder answers for

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in STAND_INS:
            return None
        if top not in self.standing_in:
            if name != top or importlib.machinery.PathFinder.find_spec(top) is not None:
                return None  # the real module is installed: it is imported as usual
            self.standing_in.add(top)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _unpacked(wheel: Path, package: str) -> Path:
    """The wheel's files, unpacked once beside it (a wheel is a zip of the installed tree)."""
    target = wheel.with_suffix(".unpacked")
    if not (target / package / "__init__.py").exists():
        partial = wheel.with_suffix(f".unpacking-{os.getpid()}")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(partial)
        partial.rename(target)
    return target


@contextmanager
def _loaded_from(root: Path, package: str) -> Iterator[None]:
    """`package` importable from `root` (and the stand-ins from nothing) for the block; afterwards its
    modules, the stand-ins, and its changes to the environment and the root logger are gone."""
    environ, root_logger = dict(os.environ), logging.getLogger()
    level, handlers = root_logger.level, list(root_logger.handlers)
    finder = _StandInFinder()
    sys.meta_path.insert(0, finder)
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(root))
        stood_in = [name for name, module in sys.modules.items() if isinstance(module, _StandIn)]
        for name in [name for name in sys.modules if name.split(".")[0] == package] + stood_in:
            del sys.modules[name]
        os.environ.clear()
        os.environ.update(environ)
        root_logger.setLevel(level)
        root_logger.handlers[:] = handlers


@contextmanager
def verl_core_algos(wheels: Path) -> Iterator[types.SimpleNamespace]:
    """verl's `core_algos`, `ActorConfig` and `PolicyLossConfig`, loaded from the wheel in `wheels`."""
    root = _unpacked(needs_wheel(*VERL_WHEEL, directory=wheels), "verl")
    with _loaded_from(root, "verl"):
        core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
        config = importlib.import_module("verl.workers.config")
        yield types.SimpleNamespace(
            core_algos=core_algos, ActorConfig=config.ActorConfig, PolicyLossConfig=config.PolicyLossConfig
        )


@contextmanager
def trl_grpo_trainer(wheels: Path) -> Iterator[type]:
    """TRL's `GRPOTrainer` class (its static helpers are the oracles), loaded from the wheel in
    `wheels`; TRL's own dependencies (transformers, accelerate, datasets) are loorl's."""
    root = _unpacked(needs_wheel(*TRL_WHEEL, directory=wheels), "trl")
    with _loaded_from(root, "trl"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL 1.16 names the vLLM releases it was tested with
        yield importlib.import_module("trl.trainer.grpo_trainer").GRPOTrainer
