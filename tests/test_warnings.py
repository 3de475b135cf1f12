"""No deprecated call of loorl's warns (transformers, Lightning, torch, Hydra): the recorder that tells
loorl's calls from the libraries' own (tests/warning_origins.py), and the transformers calls whose
spelling changed inside pyproject.toml's range (`loorl.util.hf_compat`). The default run is checked
whole in tests/test_default_run.py."""

from __future__ import annotations

import sys

import pytest
import torch

from fixtures import tiny_parts
from loorl.algo.logprobs import can_share_prompt, completion_scores
from loorl.rollout.batch import assemble
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.types import SamplingConfig
from loorl.util import hf_compat
from warning_origins import SRC, loorl_deprecations

LIBRARY = """
import warnings

def old_api():
    warnings.warn("old_api is deprecated", FutureWarning, stacklevel=2)

def forwards_to_old_api():
    old_api()
"""


def _module(name: str, filename: str, source: str):
    """A module whose frames carry `filename` (a library's site-packages file, or a file under src/)."""
    module = type(sys)(name)
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def test_the_recorder_names_the_caller_not_the_library(tmp_path):
    """A deprecated call from a file under src/ is recorded with that file as its caller; the same call
    made inside the library, or from a file outside src/, is not loorl's."""
    lib = _module("fakelib", str(tmp_path / "site-packages" / "fakelib" / "__init__.py"), LIBRARY)
    ours = _module("ours", str(SRC / "loorl" / "_caller.py"), "def call(lib):\n    lib.old_api()\n")
    with loorl_deprecations() as seen:
        ours.call(lib)  # loorl's call
        lib.forwards_to_old_api()  # the library's own call, reached from a test file
        lib.old_api()  # a test file's call
    assert [(d.category, d.message) for d in seen] == [("FutureWarning", "old_api is deprecated")]
    assert seen[0].caller == f"{SRC / 'loorl' / '_caller.py'}:2"


@pytest.fixture(scope="module")
def rollout(quick_config):
    """The tiny model, and a batch of 3 prompts x 4 samples it drew with the HF engine."""
    _, task, _, tok, model = tiny_parts(quick_config())
    ids = [tok(p.text, add_special_tokens=False).input_ids for p in task.eval_prompts()[:3]]
    engine = HFEngine(SamplingConfig(max_new_tokens=5), eos_token_ids=[tok.eos_token_id],
                      pad_token_id=tok.pad_token_id)  # fmt: skip
    engine.sync(model)
    torch.manual_seed(0)
    groups = engine.generate(ids, n=4)
    rewards = torch.zeros(3, 4)
    return model, engine, ids, assemble(ids, groups, pad_token_id=tok.pad_token_id, rewards=rewards,
                                        advantages=rewards)  # fmt: skip


def _cached_calls(model, engine, ids, batch) -> None:
    """Every loorl call that hands transformers a key/value cache or asks about checkpointing: sampling
    (a shared prefill, then the decode steps) and the shared-prompt forward with its backward."""
    engine.generate(ids, n=4)
    assert can_share_prompt(model, batch)
    logp, _ = completion_scores(model, batch, sampling=engine.sampling, share_prompt=True)
    logp.sum().backward()


def test_sampling_and_scoring_with_a_cache_raise_no_deprecation(rollout):
    with loorl_deprecations() as seen:
        _cached_calls(*rollout)
    assert seen == [], seen


def test_the_old_cache_keyword_is_seen_where_transformers_deprecates_it(rollout, monkeypatch):
    """The check above can fail: spelled as before transformers 5.24 (`past_key_values=`), the same calls
    are recorded as loorl's deprecations, at loorl's lines."""
    if hf_compat.cache_keyword() == "past_key_values":
        pytest.skip("this transformers (< 5.24) still takes past_key_values without a warning")
    monkeypatch.setattr(hf_compat, "cache_keyword", lambda: "past_key_values")
    with loorl_deprecations() as seen:
        _cached_calls(*rollout)
    assert seen and all("past_key_values" in d.message for d in seen), seen
    assert all(d.caller.startswith(str(SRC / "loorl")) for d in seen)
