"""`rollout.hf_decode`: the HF engine's key/value cache (dynamic, static) and its compiled one-token
step. Checked on the real tiny Qwen2 model: every loop draws the same samples for a seed, and asking
"has every row ended?" less often changes nothing. The speed of the compiled step on a GPU (the
reason it exists) needs CUDA: `tests/test_gpu.py`."""

from __future__ import annotations

import warnings

import pytest
import torch

from fixtures import tiny_model_and_prompts
from loorl.errors import ConfigError
from loorl.rollout.engines.base import EngineContext
from loorl.rollout.engines.decoding import EAGER, Step, decode, one_token_logits, static_cache_length
from loorl.rollout.engines.hf_engine import HFEngine, choose_hf_decode, hf_decode
from loorl.types import SamplingConfig
from loorl.util.padding import pad


@pytest.fixture(scope="module")
def tiny(quick_config):
    return tiny_model_and_prompts(quick_config())


def _samples(tiny, decoding: str, *, greedy: bool = False, n: int = 4, **sampling):
    tok, model, ids = tiny
    engine = HFEngine(
        SamplingConfig(**{"max_new_tokens": 5, **sampling}),
        decoding=decoding,
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    )
    engine.sync(model)
    return engine.generate(ids, n=1 if greedy else n, greedy=greedy, seed=None if greedy else 11)


def _same(a, b, *, atol: float = 1e-5) -> None:
    for group_a, group_b in zip(a, b, strict=True):
        for x, y in zip(group_a, group_b, strict=True):
            assert x.token_ids == y.token_ids and x.finished == y.finished
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 5}])
def test_a_static_cache_draws_the_samples_of_a_dynamic_one(tiny, sampling):
    _same(_samples(tiny, "dynamic", greedy=True), _samples(tiny, "static", greedy=True))
    _same(_samples(tiny, "dynamic", **sampling), _samples(tiny, "static", **sampling))


def test_the_compiled_step_draws_the_samples_of_the_eager_loop(tiny):
    """torch.compile on CPU (inductor; CUDA graphs are skipped there): the same tokens and log-probs,
    and no warning from dynamo while it compiles (the cache keyword's lru_cache once put one in every
    compiled run's log: seen on an H200)."""
    torch._dynamo.reset()  # traced anew here, whatever this process compiled before
    torch._dynamo.utils.warn_once_cache.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _same(_samples(tiny, "dynamic", greedy=True), _samples(tiny, "compiled", greedy=True))
    _same(_samples(tiny, "dynamic", temperature=0.7), _samples(tiny, "compiled", temperature=0.7), atol=1e-4)
    assert not [str(w.message) for w in seen if "_dynamo" in w.filename], [str(w.message) for w in seen]


def test_one_compiled_graph_and_one_cache_serve_every_rollout_of_a_shape(tiny):
    """The compiled step is compiled once and reads the same cache tensors in every rollout of the
    same shape (what lets a CUDA graph replay), and each rollout still draws the eager loop's samples
    (the reused cache zeroed, the shared prefill written into it in place). Before: the cache's layer
    class was made anew per cache, so every rollout compiled again (an H200 SmolLM2 step: 6 s)."""
    from torch._dynamo.utils import counters

    tok, model, ids = tiny

    def engine(decoding: str) -> HFEngine:
        e = HFEngine(SamplingConfig(max_new_tokens=5, temperature=0.7), decoding=decoding, share_prompt=True,
                     eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)  # fmt: skip
        e.sync(model)
        return e

    eager, compiled = engine("dynamic"), engine("compiled")
    graphs, addresses = [], []
    for seed in (1, 2, 3):
        _same(eager.generate(ids, n=4, seed=seed), compiled.generate(ids, n=4, seed=seed), atol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
        (cache,) = compiled._caches.caches.values()
        addresses.append([layer.keys.data_ptr() for layer in cache.layers])
    assert graphs[0] == graphs[1] == graphs[2]
    assert addresses[0] == addresses[1] == addresses[2]


def test_a_static_cache_is_rounded_up_for_a_compiled_step_only(tiny):
    """The loop is told whether its step is compiled (`Step.compiled`) rather than guessing from the
    function: a compiled step's static cache is rounded up to `CACHE_BUCKET` tokens (its graph then
    serves prompts of similar length), an eager one's has the call's own length, whatever function
    the step is (here one that wraps `one_token_logits`)."""
    tok, model, ids = tiny
    rows, mask = pad(ids, value=tok.pad_token_id, side="left")  # [b, P]

    def cache_length(step: Step) -> int:
        *_, cache_mask = decode(model.eval(), rows, mask, sampling=None, max_new_tokens=5, prefill_group=1,
                                eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                                cache="static", step=step, keep=True)  # fmt: skip
        return cache_mask.shape[1]

    def wrapped(*args):
        return one_token_logits(*args)

    exact, rounded = rows.shape[1] + 5, static_cache_length(rows.shape[1], 5)
    assert exact < rounded
    assert cache_length(EAGER) == cache_length(Step(wrapped)) == exact
    assert cache_length(Step(wrapped, compiled=True)) == rounded


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_checking_for_the_end_less_often_changes_no_sample(tiny, cache):
    """On CUDA the loop asks whether every row ended every few tokens (a host sync each): rows that
    ended decode padding meanwhile, and the samples (cut at EOS) are the same."""
    tok, model, ids = tiny
    rows, mask = pad([i for i in ids for _ in range(3)], value=tok.pad_token_id, side="left")  # [b, P]
    runs = []
    for check_every in (1, 8):
        generator = torch.Generator().manual_seed(3)
        runs.append(
            decode(
                model.eval(),
                rows,
                mask,
                sampling=SamplingConfig(max_new_tokens=12),
                max_new_tokens=12,
                prefill_group=3 if cache == "dynamic" else 1,
                eos_token_ids=[tok.eos_token_id],
                pad_token_id=tok.pad_token_id,
                generator=generator,
                cache=cache,
                check_every=check_every,
            )
        )
    (tokens_1, logp_1), (tokens_8, logp_8) = runs  # [b, C1], [b, C8] with C8 >= C1
    width = tokens_1.shape[1]
    assert tokens_8.shape[1] >= width
    assert torch.equal(tokens_8[:, :width], tokens_1)
    assert (tokens_8[:, width:] == tok.pad_token_id).all()  # every row had ended: padding only
    assert torch.equal(logp_8[:, :width], logp_1)


def test_auto_compiles_on_cuda_only_and_bad_choices_are_one_line(quick_cfg):
    assert hf_decode("auto", cuda=True) == "compiled" and hf_decode("auto", cuda=False) == "dynamic"
    assert hf_decode("static", cuda=True) == "static"
    assert "leave the batch" in choose_hf_decode("auto", cuda=False)[1]
    assert "H200" in choose_hf_decode("auto", cuda=True)[1]
    assert choose_hf_decode("static", cuda=False) == ("static", "rollout.hf_decode=static")
    assert static_cache_length(20, 5) == 64 and static_cache_length(60, 5) == 128
    from loorl.config import load_settings

    s = load_settings(quick_cfg("rollout=hf", "rollout.hf_decode=graphs"))
    with pytest.raises(ConfigError) as err:
        HFEngine.check(EngineContext(rollout=s.rollout))
    assert "\n" not in str(err.value) and "rollout.hf_decode='graphs'" in str(err.value)
    assert "compiled" in str(err.value)
    assert load_settings(quick_cfg("rollout=hf")).rollout.hf_decode == "auto"


CHILD = """
import json, sys
from loorl.models.load import load_causal_lm, load_tokenizer
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.types import SamplingConfig

path, prompts = sys.argv[1], json.loads(sys.argv[2])
tok, model = load_tokenizer(path), load_causal_lm(path, dtype="float32")
def greedy(decoding):
    engine = HFEngine(SamplingConfig(max_new_tokens=5), decoding=decoding, eos_token_ids=[tok.eos_token_id],
                      pad_token_id=tok.pad_token_id)
    engine.sync(model)
    return [g[0].token_ids for g in engine.generate(prompts, n=1, greedy=True)]
print(json.dumps({"compiled": greedy("compiled"), "eager": greedy("dynamic")}))
"""


@pytest.mark.slow
def test_a_compiled_step_cached_at_one_cpu_capability_is_not_loaded_at_another(quick_config, tmp_path):
    """Two processes, the machine's own ATen kernels then avx2, with the same temporary directory (so
    the same default inductor cache): each compiled loop draws its eager loop's tokens, from a cache
    of its capability's own. Sharing one cache, the second drew [29, 0, 0, 0, 0] against [29, 27, 1]
    (`loorl.util.hardware.inductor_cache_for_this_cpu`)."""
    import json
    import subprocess
    import sys

    from fixtures import child_env, tiny_parts

    _, task, path, tok, _ = tiny_parts(quick_config())
    prompts = [tok(p.text, add_special_tokens=False).input_ids for p in task.eval_prompts()[:6]]
    for capability in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        env = child_env(TMPDIR=str(tmp_path), **capability)
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        done = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(prompts)], env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        tokens = json.loads(done.stdout.strip().splitlines()[-1])
        assert tokens["compiled"] == tokens["eager"], capability
    assert len(list(tmp_path.glob("torchinductor_*_*"))) == 2  # one cache per capability


@pytest.mark.parametrize("greedy", [True, False])
def test_rows_that_ended_leave_the_batch_and_every_row_draws_the_same_samples(tiny, greedy):
    """`drop_ended` (the dynamic cache's default): a row that ended leaves the batch and its cache
    instead of decoding padding. Each row draws the same tokens as when every row stays (its uniform
    is still drawn for the whole batch), log-probs within float rounding of a smaller batch's matrix
    products. The batch is seen to shrink: rows end at different tokens (at EOS, or at a stop token
    chosen from a first run's own tokens, one some rows draw early and others do not: the tiny model's
    greedy answers may all end together, as its warm start on an AVX2 build's arithmetic does)."""
    tok, model, ids = tiny
    rows, mask = pad([i for i in ids for _ in range(4)], value=tok.pad_token_id, side="left")  # [b, P]
    sampling = None if greedy else SamplingConfig(max_new_tokens=16, temperature=1.3)

    def run(stop: list[list[int]], drop_ended: bool):
        return decode(model.eval(), rows, mask, sampling=sampling, max_new_tokens=16, prefill_group=4,
                      eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, stop_sequences=stop,
                      generator=torch.Generator().manual_seed(5), drop_ended=drop_ended)  # fmt: skip

    first, _ = run([], False)  # [b, C]: a row's tokens do not depend on where other rows stop
    early = [set(row[:3].tolist()) for row in first]
    stop = min({t for s in early for t in s} - {tok.eos_token_id, tok.pad_token_id},
               key=lambda t: abs(sum(t in s for s in early) - len(early) / 2))  # fmt: skip
    assert 0 < sum(stop in s for s in early) < len(early)  # some rows end at it within 3 tokens, some do not
    runs, widths = [], []
    for drop_ended in (False, True):
        batch_sizes: list[int] = []
        hook = model.register_forward_pre_hook(
            lambda m, a, kw, seen=batch_sizes: seen.append(kw["input_ids"].shape[0]), with_kwargs=True
        )
        try:
            runs.append(run([[stop]], drop_ended))
        finally:
            hook.remove()
        widths.append(batch_sizes)
    (tokens, logp), (tokens_dropped, logp_dropped) = runs  # [b, C] each
    assert set(widths[0][1:]) == {rows.shape[0]}  # the plain loop decodes every row to the end
    assert min(widths[1][1:]) < rows.shape[0]  # rows left the batch
    assert torch.equal(tokens_dropped, tokens)
    last = (tokens == tok.eos_token_id) | (tokens == stop)  # [b, C] a row's last token
    ended = torch.cumsum(last, dim=1) - last.long() > 0  # [b, C] after it
    assert torch.allclose(logp_dropped[~ended], logp[~ended], atol=1e-5)
    assert (logp_dropped[ended] == 0).all()


def test_an_engine_that_keeps_its_cache_decodes_every_row(tiny):
    """A cache kept for the next turn (tools) needs every row, so `keep` decodes without dropping."""
    tok, model, ids = tiny
    rows, mask = pad(ids, value=tok.pad_token_id, side="left")  # [b, P]
    tokens, _, kv, kept_mask = decode(model.eval(), rows, mask, sampling=None, max_new_tokens=8,
                                      prefill_group=1, eos_token_ids=[tok.eos_token_id],
                                      pad_token_id=tok.pad_token_id, keep=True)  # fmt: skip
    assert kv.layers[0].keys.shape[0] == rows.shape[0] == kept_mask.shape[0]
    assert kept_mask.shape[1] == rows.shape[1] + tokens.shape[1] - 1


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_bf16_autocast_cache_is_stored_in_bf16_and_attends_to_the_same_values(tiny, attention):
    """Under bf16 autocast the growing cache stores bf16 (keys came out float32 from the rotary
    embedding, and a plain layer promoted its values to float32 too, so every step cast the whole
    cache back), and the logits of a prefill and three decoding steps are bit-identical to a plain
    `DynamicCache`'s: autocast rounds the attention's inputs to bf16 either way."""
    from transformers import DynamicCache

    from loorl.rollout.engines.hf_engine import _attention
    from loorl.rollout.engines.kv_cache import growing_cache
    from loorl.util.hf_compat import with_cache

    tok, model, ids = tiny
    rows, mask = pad(ids, value=tok.pad_token_id, side="left")  # [b, P]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P]
    runs, bf16 = [], torch.autocast("cpu", dtype=torch.bfloat16)
    for cache in (DynamicCache(config=model.config), growing_cache(model.config)):
        logits, step_ids, step_mask, step_positions = [], rows, mask, positions
        with torch.no_grad(), _attention(model.eval(), attention), bf16:
            for _ in range(4):
                out = model(input_ids=step_ids, attention_mask=step_mask, position_ids=step_positions,
                            **with_cache(cache), use_cache=True).logits[:, -1]  # fmt: skip  # [b, V]
                logits.append(out)
                step_ids = out.argmax(-1, keepdim=True)  # [b, 1]
                step_mask = torch.cat([step_mask, step_mask.new_ones(len(rows), 1)], dim=1)
                step_positions = step_positions[:, -1:] + 1  # [b, 1]
        runs.append((torch.stack(logits), cache.layers[0].keys.dtype, cache.layers[0].values.dtype))
    (plain, *plain_dtypes), (grown, *grown_dtypes) = runs
    assert plain_dtypes == [torch.float32, torch.float32] and grown_dtypes == [torch.bfloat16, torch.bfloat16]
    assert torch.equal(grown, plain)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_cache_written_into_buffers_attends_as_a_concatenated_one(tiny, attention):
    """`growing_cache(capacity=...)` (the loop with rows leaving) writes each token into buffers
    preallocated once, repeats a shared prefill into them and moves the rows that stay to the front
    in place. Its logits are bit-identical to the concatenating cache's through a shared prefill,
    decoding steps and two leavings, and every step reads views of the same buffers (no new
    allocation of the cache: the heap is not fragmented by a new size at every token)."""
    from loorl.rollout.engines.decoding import shared_prefill
    from loorl.rollout.engines.hf_engine import _attention
    from loorl.util.hf_compat import with_cache

    tok, model, ids = tiny
    rows, mask = pad([i for i in ids for _ in range(2)], value=tok.pad_token_id, side="left")  # [b, P]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P]
    runs, buffers = [], []
    for capacity in (None, 64):
        with torch.no_grad(), _attention(model.eval(), attention):
            cache = shared_prefill(model, rows[::2], mask[::2], 2, capacity=capacity)
            step_ids, step_mask, step_positions = rows[:, -1:], mask, positions[:, -1:]
            logits, seen = [], []  # each step's keys, held so that no address is freed and reused
            for i in range(6):
                out = model(input_ids=step_ids, attention_mask=step_mask, position_ids=step_positions,
                            **with_cache(cache), use_cache=True).logits[:, -1]  # fmt: skip  # [r, V]
                logits.append(out)
                seen.append(cache.layers[0].keys)
                step_ids = out.argmax(-1, keepdim=True)  # [r, 1]
                step_mask = torch.cat([step_mask, step_mask.new_ones(len(step_ids), 1)], dim=1)
                step_positions = step_positions + 1
                if i in (1, 3):  # rows 0 and 2 of those left leave
                    stay = torch.tensor([r for r in range(len(step_ids)) if r not in (0, 2)])
                    cache.batch_select_indices(stay)
                    step_ids, step_mask = step_ids[stay], step_mask[stay]
                    step_positions = step_positions[stay]
        runs.append(torch.cat(logits))
        buffers.append(len({keys.untyped_storage().data_ptr() for keys in seen}))
    assert torch.equal(runs[1], runs[0])
    assert buffers == [6, 1]  # a new cache tensor at every token, against one buffer
