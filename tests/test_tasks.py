"""GSM8K and MATH tasks on fixture data, reward models, custom rewards and hub-architecture models."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hydra.utils import instantiate

from fixtures import CHAT_TEMPLATE, tiny_reward_model, write_gsm8k, write_math
from loorl.build import instantiate_unwrapped
from loorl.cli.train import train
from loorl.config import CONF_DIR
from loorl.errors import ConfigError
from loorl.models.tiny import build_char_tokenizer, ensure_tiny_model

REPO = CONF_DIR.parent
# a quick RL run on the data-set tasks; completions stay short so the tests stay fast
DATA_QUICK = [
    "debug=quick",
    "rollout=hf",  # as tests/conftest.py's quick profile: not vLLM on a GPU node that has it
    "rollout.max_new_tokens=24",
    "val_pass_k=2",
    "model.tiny.warm_start.max_steps=60",
]


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    return write_gsm8k(tmp_path_factory.mktemp("gsm8k"))


@pytest.fixture(scope="module")
def math_dir(tmp_path_factory):
    return write_math(tmp_path_factory.mktemp("math"))


@pytest.fixture(scope="module")
def data_config(make_config):
    """`data_config(cache, out, *overrides)`: a quick data-set-task run with its own cache and output."""

    def make(cache, out, *overrides):
        return make_config(*DATA_QUICK, f"model.cache_dir={cache}", *overrides, output_dir=out)

    return make


def _history(out):
    return json.loads((out / "metrics.json").read_text())["history"]


@pytest.fixture(scope="module")
def gsm8k_model(data_config, gsm8k_dir, model_cache):
    """A tiny model warm-started on the GSM8K fixture, saved as an ordinary local HF directory. 15 steps:
    the tests that use it check the rewards' plumbing, not what the model learnt (60 steps took 80 s)."""
    cfg = data_config(model_cache, "/tmp/unused", "task=gsm8k", f"data.path={gsm8k_dir}",
                      "model.tiny.warm_start.max_steps=15")  # fmt: skip
    return ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task))


def test_gsm8k_task_prompts_rewards_and_epochs(data_config, gsm8k_dir, tmp_path):
    cfg = data_config(tmp_path, tmp_path, "task=gsm8k", f"data.path={gsm8k_dir}", "task.format_score=0.1")
    task = instantiate(cfg.task)
    task.prepare(build_char_tokenizer(), max_prompt_length=cfg.rollout.max_prompt_length)
    p = task.eval_prompts()[0]
    assert p.text.endswith('output the final answer after "####".') and p.meta["question"] in p.text
    assert task.reward(p, f"so {p.answer}\n#### {p.answer}") == 1.0
    assert task.reward(p, f"#### {int(p.answer) + 1}") == pytest.approx(0.1)  # well-formed, wrong
    assert task.reward(p, p.answer) == 0.0  # strict mode needs ####
    assert len(task.eval_prompts()) == 16
    # epochs over the 64 training prompts: each once per epoch, in a seeded order
    first = [q.text for s in range(8) for q in task.prompts_for_step(s, 8, seed=0)]
    assert sorted(first) == sorted(q.text for q in task.train)
    assert task.prompts_for_step(3, 8, seed=0) == task.prompts_for_step(3, 8, seed=0)
    assert task.prompts_for_step(8, 8, seed=0) != task.prompts_for_step(0, 8, seed=0)


def test_long_prompts_are_filtered_and_counted_or_refused(data_config, gsm8k_dir, tmp_path):
    cfg = data_config(tmp_path, tmp_path, "task=gsm8k", f"data.path={gsm8k_dir}")
    task = instantiate(cfg.task)
    lengths = sorted(len(q.text) for q in task.train)
    limit = lengths[len(lengths) // 2]  # the character tokenizer: one token per character
    task.prepare(build_char_tokenizer(), max_prompt_length=limit)
    assert 0 < task.dropped["train"] < 64 and len(task.train) == 64 - task.dropped["train"]
    assert all(len(q.text) <= limit for q in task.train)
    strict = instantiate(
        data_config(
            tmp_path, tmp_path, "task=gsm8k", f"data.path={gsm8k_dir}", "task.on_long_prompt=error"
        ).task
    )
    with pytest.raises(ConfigError, match="rollout.max_prompt_length"):
        strict.prepare(build_char_tokenizer(), max_prompt_length=limit)


def test_chat_template_renders_prompts(data_config, gsm8k_dir, tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    task = instantiate(
        data_config(
            tmp_path, tmp_path, "task=gsm8k", f"data.path={gsm8k_dir}", "task.system_prompt=Be brief."
        ).task
    )
    task.prepare(tok, max_prompt_length=1000)
    text = task.eval_prompts()[0].text
    assert text.startswith("<system>Be brief.\n<user>") and text.endswith("\n<assistant>")


def test_math_task_boxed_answers(data_config, math_dir, tmp_path):
    task = instantiate(data_config(tmp_path, tmp_path, "task=math", f"data.path={math_dir}").task)
    p = task.eval_prompts()[0]
    num, den = p.meta["question"].split()[2].split("/")  # "What is a/(a*b) as a fraction?"
    b = int(den) // int(num)
    assert task.reward(p, f"The answer is $\\boxed{{\\dfrac{{1}}{{{b}}}}}$") == 1.0
    assert task.reward(p, f"\\boxed{{1/{b}}}") == 1.0
    assert task.reward(p, f"\\boxed{{{1 / b}}}") == (1.0 if b in (1, 2, 4, 5, 8) else 0.0)
    assert task.reward(p, "\\boxed{7}") == 0.0 and task.reward(p, "1/2") == 0.0


def test_missing_data_path_fails_before_any_model(data_config, tmp_path):
    for extra in (["task=gsm8k"], ["task=math", f"data.path={tmp_path}/nope.jsonl"]):
        with pytest.raises(ConfigError) as err:
            train(data_config(tmp_path / "cache", tmp_path / "out", *extra))
        assert "data.path" in str(err.value) and "\n" not in str(err.value)
        assert not (tmp_path / "cache").exists()


@pytest.mark.slow  # the gsm8k path trains in-process below; the command line is tested by other CLI tests
def test_gsm8k_cli_end_to_end_with_the_real_verifier(gsm8k_dir, gsm8k_model, tmp_path):
    """`python src/train.py task=gsm8k model.name_or_path=<local tiny> data.path=<fixture>`."""
    out = tmp_path / "run"
    cmd = [sys.executable, "src/train.py", "task=gsm8k", f"model.name_or_path={gsm8k_model}",
           f"data.path={gsm8k_dir}", *DATA_QUICK, f"output_dir={out}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "rloo on gsm8k" in proc.stdout and "pass@2" in proc.stdout
    history = _history(out)
    rewards = [v for _, v in history["rollout/reward"]]
    assert len(rewards) == 4 and all(0.0 <= v <= 1.0 for v in rewards)
    assert [s for s, _ in history["val/pass_at_k"]] == [0, 2, 4]


def test_two_weighted_reward_functions_end_to_end(data_config, gsm8k_dir, gsm8k_model, tmp_path):
    summary = train(data_config(tmp_path / "c", tmp_path, "task=gsm8k", f"model.name_or_path={gsm8k_model}",
                         f"data.path={gsm8k_dir}", "reward=custom", "rl.steps=2"))  # fmt: skip
    history = _history(tmp_path)
    assert {"rollout/reward_correct", "rollout/reward_brevity"} <= set(history)
    totals = [v for _, v in history["rollout/reward"]]
    assert all(-1.0 <= v <= 1.0 for v in totals)  # reward.clip=[-1, 1]
    assert all(0.0 <= v <= 1.0 for _, v in history["rollout/reward_correct"])
    assert all(v <= 0.0 for _, v in history["rollout/reward_brevity"])  # a penalty
    assert summary["optimizer_steps"] == 2


def test_reward_model_scores_match_a_direct_forward_pass(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from loorl.rewards.model import RewardModel

    path = tiny_reward_model(tmp_path / "rm", chat_template=CHAT_TEMPLATE)
    rm = RewardModel(path=str(path), batch_size=2)
    completions = ["#### 4", "I think it is 5, so #### 5", "x"]
    scores = rm(prompts=["p1", "p2", "p3"], completions=completions, question=["2+2?", "2+3?", "?"])
    direct = AutoModelForSequenceClassification.from_pretrained(path).eval()
    for question, completion, score in zip(["2+2?", "2+3?", "?"], completions, scores):
        text = f"[user]{question}[assistant]{completion}"
        ids = rm.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            assert direct(**ids).logits[0, 0].item() == pytest.approx(score, abs=1e-5)
    assert len(set(scores)) == 3


def test_reward_model_run_end_to_end(data_config, gsm8k_dir, gsm8k_model, tmp_path):
    rm = tiny_reward_model(tmp_path / "rm", chat_template=CHAT_TEMPLATE)
    summary = train(data_config(tmp_path / "c", tmp_path / "out", "task=gsm8k",
                                f"model.name_or_path={gsm8k_model}", f"data.path={gsm8k_dir}", "reward=model",
                                f"reward.functions.rm.fn.path={rm}", "rl.steps=2"))  # fmt: skip
    rewards = [v for _, v in _history(tmp_path / "out")["rollout/reward"]]
    assert len(rewards) == 2 and all(math.isfinite(v) for v in rewards)
    assert not all(v in (0.0, 1.0) for v in rewards)  # real-valued scores, not the verifier's
    assert summary["optimizer_steps"] == 2


def test_reward_model_path_is_checked_before_loading(data_config, tmp_path):
    for extra, words in (
        (["reward=model"], "is not set"),
        (["reward=model", "reward.functions.rm.fn.path=/no/rm"], "/no/rm"),
    ):
        with pytest.raises(ConfigError, match=words):
            train(data_config(tmp_path / "cache", tmp_path / "out", *extra))
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("hub", ["qwen05b", "llama8b"])
def test_hub_model_config_runs_with_a_local_model_of_its_architecture(make_config, hub, tmp_path):
    """The hub configs' code path (bf16 policy and reference, gradient checkpointing, reference offload)
    on a locally built model of the same architecture; only the weights differ. The 7B recipes keep the
    reference on the GPU now (docs/performance/7b.md): llama8b's run offloads it explicitly."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = build_char_tokenizer()
    arch = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 1,
            "num_key_value_heads": 1, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
            "eos_token_id": tok.eos_token_id, "max_position_embeddings": 256}  # fmt: skip
    model = (
        LlamaForCausalLM(LlamaConfig(**arch)) if hub == "llama8b" else Qwen2ForCausalLM(Qwen2Config(**arch))
    )
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    offload = ["model.ref_offload=true"] if hub == "llama8b" else []
    cfg = make_config("debug=quick", "rollout=hf", f"model={hub}", f"model.name_or_path={tmp_path / 'm'}",
                      "rl.steps=2", "rl.prompts_per_microbatch=4", *offload,
                      output_dir=tmp_path / "out")  # fmt: skip
    assert cfg.model.dtype == "bfloat16" and cfg.model.gradient_checkpointing and cfg.kl.coef > 0
    summary = train(cfg)
    history = _history(tmp_path / "out")
    assert summary["optimizer_steps"] == 2 and "rollout/kl" in history
    assert all(math.isfinite(v) for _, v in history["train/loss"])


# ---- chat arithmetic (task=chat_arithmetic): sums asked in the policy's chat template ----------------
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHATML
    return tok


def test_chat_arithmetic_prompts_are_rendered_with_the_chat_template(make_config):
    cfg = make_config("task=chat_arithmetic", "task.system_prompt=Be brief.")
    task = instantiate(cfg.task)
    plain = task.eval_prompts()[0]
    a, b = plain.meta["a"], plain.meta["b"]
    assert plain.text == f"Be brief.\n\nWhat is {a} + {b}? Answer with just the number."  # no tokenizer yet
    tok = chat_tokenizer()
    task.prepare(tok, max_prompt_length=256)
    p = task.eval_prompts()[0]
    assert p.text == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is {a} + {b}? "
        "Answer with just the number.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert p.text == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": p.meta["question"]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert p.answer == str(a + b)
    rng = __import__("numpy").random.default_rng(0)
    assert all(q.text.startswith("<|im_start|>system") for q in task.train_prompts(5, rng=rng))


def test_chat_arithmetic_held_out_set_is_fixed_and_disjoint(make_config):
    cfg = make_config("task=chat_arithmetic")
    task = instantiate(cfg.task)
    held_out = {(p.meta["a"], p.meta["b"]) for p in task.eval_prompts()}
    assert len(held_out) == cfg.task.eval_size == 200
    assert held_out == {(p.meta["a"], p.meta["b"]) for p in instantiate(cfg.task).eval_prompts()}
    rng = __import__("numpy").random.default_rng(0)
    trained = {(p.meta["a"], p.meta["b"]) for p in task.train_prompts(5000, rng=rng)}
    assert not trained & held_out and len(trained) > 2000  # 2,300 pairs remain for training
    narrow = instantiate(
        make_config("task=chat_arithmetic", "task.min_operand=10", "task.max_operand=20").task
    )
    ops = [
        x
        for p in narrow.train_prompts(200, rng=rng) + narrow.eval_prompts()
        for x in (p.meta["a"], p.meta["b"])
    ]
    assert min(ops) >= 10 and max(ops) <= 20


@pytest.mark.parametrize(
    "mode,completion,reward",
    [
        ("strict", "42", 1.0),
        ("strict", "20 + 22 = 42.", 1.0),
        ("strict", "42 is the answer", 0.0),
        ("strict", "43", 0.0),
        ("flexible", "42 is the answer", 1.0),
        ("flexible", "20 + 22 = 41", 0.0),
        ("flexible", "no number", 0.0),
    ],
)
def test_chat_arithmetic_reward_reads_the_final_number(make_config, mode, completion, reward):
    from loorl.types import Prompt

    task = instantiate(make_config("task=chat_arithmetic", f"task.answer_mode={mode}").task)
    prompt = Prompt(text="What is 20 + 22?", answer="42", meta={"a": 20, "b": 22})
    assert task.reward(prompt, completion) == reward
    assert task.grade(prompt, completion) == (reward, reward > 0)


@pytest.mark.parametrize(
    "override,named",
    [
        ("task.answer_mode=lenient", "task.answer_mode"),
        ("task.question='What is {x}?'", "task.question"),
        ("task.question='What is {a}?'", "task.question"),
        ("rollout.max_prompt_length=20", "rollout.max_prompt_length=20"),
    ],
)
def test_chat_arithmetic_bad_settings_are_one_line_errors(make_config, override, named):
    cfg = make_config("task=chat_arithmetic", override)
    with pytest.raises(ConfigError) as caught:
        task = instantiate_unwrapped(cfg.task)
        task.prepare(chat_tokenizer(), max_prompt_length=cfg.rollout.max_prompt_length)
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_arithmetic_offset_shifts_every_reward_but_not_correctness(make_config):
    task = instantiate_unwrapped(make_config("task=arithmetic_offset").task)
    plain = instantiate_unwrapped(make_config().task)
    (prompt,) = task.eval_prompts()[:1]
    right, wrong = prompt.answer, str(int(prompt.answer) + 1)
    assert task.grade(prompt, right) == (2.0, True) and task.grade(prompt, wrong) == (1.0, False)
    assert plain.grade(prompt, right) == (1.0, True) and plain.grade(prompt, wrong) == (0.0, False)
    assert task.eval_prompts() == plain.eval_prompts()  # the same problems, only the reward moves
    assert task.extract_answer(prompt, f" {right} ") == right and task.extract_answer(prompt, "  ") is None


def test_extracted_answers_of_the_data_tasks(data_config, gsm8k_dir, math_dir, tmp_path):
    gsm8k = instantiate(data_config(tmp_path, tmp_path, "task=gsm8k", f"data.path={gsm8k_dir}").task)
    prompt = gsm8k.eval_prompts()[0]
    assert gsm8k.extract_answer(prompt, "so 3 + 4 = 7\n#### 7") == "7"
    assert gsm8k.extract_answer(prompt, "no marker here") is None
    math_task = instantiate(data_config(tmp_path, tmp_path, "task=math", f"data.path={math_dir}").task)
    prompt = math_task.eval_prompts()[0]
    assert math_task.extract_answer(prompt, r"thus \boxed{\frac{1}{2}}") == math_task.extract_answer(
        prompt, r"\boxed{\frac12}"
    )
    assert math_task.extract_answer(prompt, "no box") is None


def test_the_memory_plan_counts_a_prompt_as_the_engine_encodes_it(make_config):
    """The plan's longest prompt is the chat-template rendering the engine tokenizes, not the task's
    plain text before it is prepared (issue 79: 16 tokens counted where SmolLM2's engine encoded 46);
    the task handed in stays unprepared (the run prepares its own)."""
    from loorl.planning.inputs import longest_prompt

    task = instantiate(make_config("task=chat_arithmetic", "task.system_prompt=Be brief.").task)
    tok = chat_tokenizer()
    plain = max(len(tok(p.text, add_special_tokens=False).input_ids) for p in task.eval_prompts())
    counted = longest_prompt(task, tok, prompts_per_step=4, seed=0, max_prompt_length=256)
    assert task.eval_prompts()[0].text.startswith("Be brief.\n\nWhat is")  # still the plain text
    task.prepare(tok, max_prompt_length=256)
    rendered = max(len(tok(p.text, add_special_tokens=False).input_ids) for p in task.eval_prompts())
    assert counted >= rendered > plain
