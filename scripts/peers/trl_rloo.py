"""TRL's `RLOOTrainer` on a loorl configuration's work: the peer run of `scripts/bench/bench_vs_trl.py`.

    <trl venv>/bin/python scripts/peers/trl_rloo.py --out DIR [loorl overrides ...]

Runs in the venv that `bench_vs_trl.py` creates (TRL and accelerate over this environment's torch and
transformers; accelerate is kept out of loorl's own environment). The loorl config composed from the
same overrides supplies everything: the model files, the task's prompts (each step's B prompts drawn
by loorl's own `prompts_for_step`, fed in order with shuffling off, so both systems train on the same
prompts), the reward (the task's verifier), K, the learning rate and AdamW settings, the new-token
limit, the sampler, gradient clipping, the KL coefficient, bf16 and the step count. TRL then runs as
it would for a user: its own generation (`generate`, no vLLM), loss and loop, on CPU.

Writes DIR/trl_metrics.json (per step: seconds, generation seconds and tokens, trained tokens) and
the final policy to DIR/policy for the shared scorer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from loorl.config import CONF_DIR, load_settings  # noqa: E402
from loorl.models.load import load_tokenizer  # noqa: E402
from loorl.models.sources import resolve_model_path  # noqa: E402
from loorl.training.lr_schedule import wsd_arguments  # noqa: E402
from loorl.util.onednn import cap_onednn_primitive_cache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cap_onednn_primitive_cache()  # before this process's first bf16 product (loorl.util.onednn)
    args.out.mkdir(parents=True, exist_ok=True)

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*args.overrides, f"output_dir={args.out}"])
    s = load_settings(cfg)
    task = instantiate(cfg.task)
    model_path = resolve_model_path(cfg.model, cfg.task, task)
    tokenizer = load_tokenizer(model_path)
    task.prepare(tokenizer, max_prompt_length=s.rollout.max_prompt_length)

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    by_text = {}  # prompt text -> loorl Prompt (its answer and metadata, for the verifier)
    rows = []
    for step in range(s.rl.steps):
        for p in task.prompts_for_step(step, s.rl.prompts_per_step, seed=s.run.seed):
            by_text[p.text] = p
            rows.append({"prompt": p.text})

    def reward(prompts, completions, **_):
        return [task.reward(by_text[p], c) for p, c in zip(prompts, completions)]

    reward.__name__ = "task"
    k, sampling = s.rl.samples_per_prompt, s.rollout.sampling
    if s.rl.prompts_per_minibatch != s.rl.prompts_per_step or s.rl.epochs_per_rollout != 1:
        raise SystemExit("the TRL peer runs one optimizer step per rollout, as loorl's benchmark settings do")
    schedule = wsd_arguments(s.lr_schedule, total_steps=s.rl.steps)
    config = RLOOConfig(
        output_dir=str(args.out / "trl"),
        use_cpu=not torch.cuda.is_available(),
        bf16=s.model.dtype == "bfloat16",
        per_device_train_batch_size=s.rl.prompts_per_step * k,  # B*K completions: one rollout, one update
        gradient_accumulation_steps=1,
        num_generations=k,
        max_steps=s.rl.steps,
        max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        learning_rate=float(cfg.optimizer.lr),
        weight_decay=float(cfg.optimizer.weight_decay),
        adam_beta1=float(cfg.optimizer.betas[0]),
        adam_beta2=float(cfg.optimizer.betas[1]),
        # loorl's lr schedule, the same warmup-stable-decay arguments (one optimizer step per RL step)
        lr_scheduler_type="warmup_stable_decay",
        warmup_steps=schedule["num_warmup_steps"],
        lr_scheduler_kwargs={key: schedule[key] for key in ("num_decay_steps", "decay_type", "min_lr_ratio")},
        max_grad_norm=s.loss.max_grad_norm or 0.0,
        beta=s.kl.coef,
        num_iterations=1,
        shuffle_dataset=False,  # the steps' prompts in loorl's order
        seed=s.run.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    timing = {"step": [], "gen": [], "gen_tokens": [], "train_tokens": []}

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()
            timing["gen"].append(0.0), timing["gen_tokens"].append(0), timing["train_tokens"].append(0)

        def on_step_end(self, *a, **kw):
            timing["step"].append(time.perf_counter() - self.t0)

    started = time.perf_counter()
    trainer = RLOOTrainer(
        model=model_path,
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    generate = trainer._generate_single_turn

    def timed_generate(prompt_ids, *a, **kw):  # TRL's sampling call: its time and tokens
        t0 = time.perf_counter()
        completion_ids = generate(prompt_ids, *a, **kw)
        if timing["gen"]:
            timing["gen"][-1] += time.perf_counter() - t0
            timing["gen_tokens"][-1] += sum(len(c) for c in completion_ids)
            timing["train_tokens"][-1] += sum(len(p) for p in prompt_ids) + sum(
                len(c) for c in completion_ids
            )
        return completion_ids

    trainer._generate_single_turn = timed_generate
    trainer.train()
    train_seconds = time.perf_counter() - started
    trainer.save_model(str(args.out / "policy"))
    tokenizer.save_pretrained(str(args.out / "policy"))
    first = tokenizer(rows[0]["prompt"]).input_ids
    same = first == tokenizer(rows[0]["prompt"], add_special_tokens=False).input_ids
    (args.out / "trl_metrics.json").write_text(
        json.dumps(
            {
                "timing": timing,
                "train_seconds": train_seconds,
                "prompt_tokens_as_loorl": same,  # TRL adds special tokens; equal when there are none
                "log_history": trainer.state.log_history,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
