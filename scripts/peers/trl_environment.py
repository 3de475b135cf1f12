"""Run an environment file written for loorl, unchanged, in TRL's `GRPOTrainer(environment_factory=...)`.

Run with TRL's interpreter (`<LOORL_CACHE>/trl-venv/bin/python`, scripts/bench/bench_vs_trl.py makes it):

    ~/.cache/loorl/trl-venv/bin/python scripts/peers/trl_environment.py \
        examples/environments/sum_calculator.py SumCalculatorEnv --out /tmp/trl_env --steps 2

No hub: the policy is a small Qwen2 built here, with a character tokenizer that carries Qwen2.5's chat
template from TRL (`trl/chat_templates/qwen2_5.jinja`, tool calling included) and TRL's response
schema (`add_response_schema`). A random policy never writes a tool call, so it is first taught the
call's shape by a short supervised pass (`--sft-steps`): `<tool_call>{"name": "calculate",
"arguments": {"expression": ...}}</tool_call>`. Then GRPO runs `--steps` steps with the environment
with the environment's tools (and its `get_reward`, if it has one, beside `answer_reward`: the last
message ends with the row's answer), and the script writes `summary.json` under `--out`: TRL's
logged rows (`reward`, `tools/call_frequency`, `tools/failure_frequency`, ...).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import string
import sys
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def load_class(path: Path, name: str) -> type:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    chars = sorted(set(string.printable))
    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *chars])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL[1:])  # fmt: skip
    tok.chat_template = qwen2_5_chat_template
    return add_response_schema(tok)


def sums(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        terms = [rng.randint(100, 999) for _ in range(4)]
        expression = "+".join(map(str, terms))
        rows.append({"prompt": [{"role": "user", "content": f"{expression}="}], "answer": str(sum(terms)),
                     "expression": expression})  # fmt: skip
    return rows


def sft(model, tok, rows: list[dict], steps: int, tools: list) -> float:
    """Teach the call's shape: the chat prompt as TRL renders it (the tools' block in its system
    prompt), then the call and the end of turn (loss on those only)."""
    import torch

    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = torch.tensor(0.0)
    for step in range(steps):
        batch = rows[(step * 8) % len(rows) :][:8]
        ids, labels = [], []
        for row in batch:
            prompt = tok.apply_chat_template(row["prompt"], tools=tools, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
            target = ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "'
                      f'{row["expression"]}"}}}}\n</tool_call><|im_end|>')  # fmt: skip
            p, t = tok.encode(prompt), tok.encode(target)
            ids.append(p + t)
            labels.append([-100] * len(p) + t)
        width = max(map(len, ids))
        x = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
        y = torch.tensor([[-100] * (width - len(label)) + label for label in labels])
        loss = model(input_ids=x, attention_mask=(y != -100) | (x != tok.pad_token_id), labels=y).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    return float(loss)


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's last message ends with the row's answer (TRL's reward signature)."""
    out = []
    for completion, expected in zip(completions, answer):
        last = completion[-1].get("content") if isinstance(completion, list) else completion
        out.append(float(str(last or "").strip().endswith(str(expected))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("cls")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=150)
    args = parser.parse_args()

    import torch
    import trl
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    env_class = load_class(args.file, args.cls)
    tok = tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=2048, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    probe = env_class()  # its tools as TRL lists them: public methods, not reset or get_reward
    tools = [getattr(probe, n) for n in sorted(vars(env_class)) if callable(getattr(env_class, n))
             and not n.startswith("_") and n not in ("reset", "get_reward")]  # fmt: skip
    sft_loss = sft(model, tok, sums(256, seed=1), args.sft_steps, tools)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    data = Dataset.from_list(sums(16, seed=2))
    grpo = GRPOConfig(output_dir=str(args.out), max_steps=args.steps, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=128, use_cpu=True, report_to="none",
                      logging_steps=1, save_strategy="no", bf16=False, temperature=1.0,
                      max_tool_calling_iterations=2)  # fmt: skip
    trainer = GRPOTrainer(model=model, processing_class=tok, args=grpo, train_dataset=data,
                          reward_funcs=[answer_reward], environment_factory=env_class)  # fmt: skip
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r or "reward" in r]
    summary = {"trl": trl.__version__, "sft_loss": sft_loss, "rows": rows}  # rows: tools/call_frequency...
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
