"""One RL step of the real learner on a fixed global rollout batch, under `strategy` with W processes.

Run by tests/test_distributed.py, with `torchrun --standalone --nproc_per_node=W` for W > 1 (Lightning
sees torchrun's environment and launches nothing itself) or plain `python` for the 1-process
reference. Every process builds the same global batch (B groups, seeded); rank r trains on its block
of B/W whole groups, exactly as the DataModule hands it over. Rank 0 writes the updated full
parameters, the per-rank group ids and the step's logged metrics to `--out`.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from loorl.build import build_datamodule, build_module, instantiate_unwrapped
from loorl.cli.console import quiet_library_output
from loorl.config import check_config, compose_config
from loorl.models.load import load_causal_lm, load_tokenizer
from loorl.models.lora import is_lora
from loorl.models.sources import resolve_model_path
from loorl.parallel.distributed import rank_and_world, rank_block, shutdown
from loorl.parallel.fsdp import full_state_dict, is_sharded
from loorl.rewards import Graded
from loorl.rollout.batch import RewardParts, assemble
from loorl.rollout.step_stats import gather_graded, rollout_stats
from loorl.types import Completion, Rollout

GROUPS, K = 8, 4


def global_rollout(vocab: int, pad: int, eos: int) -> Rollout:
    """B groups of K completions of random lengths (some cut short), rewarded 0/1 (one NaN) plus 0.1 x a
    second function's reward in [-1, 0], each kept apart (GDPO's parts), and a greedy reward per group
    (ReMax's baseline): every rank's are gathered for the estimator whether it reads them or not."""
    gen = torch.Generator().manual_seed(1234)
    lengths = torch.randint(3, 7, (GROUPS,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    groups = []
    for _ in range(GROUPS):
        group = []
        for _ in range(K):
            n = int(torch.randint(1, 9, (1,), generator=gen))
            tokens = torch.randint(3, vocab, (n,), generator=gen).tolist()
            finished = bool(torch.rand(1, generator=gen) < 0.7)
            tokens = tokens + [eos] if finished else tokens
            logprobs = (-torch.rand(len(tokens), generator=gen) * 3).tolist()
            group.append(Completion(token_ids=tokens, logprobs=logprobs, finished=finished))
        groups.append(group)
    correct = (torch.rand(GROUPS, K, generator=gen) < 0.5).float()  # [B, K]
    correct[2, 1] = float("nan")  # one unscorable sample
    brevity = -torch.rand(GROUPS, K, generator=gen)  # [B, K] a second reward function's rewards
    weights = (1.0, 0.1)
    rewards = correct + weights[1] * brevity  # [B, K] their weighted sum (NaN stays NaN)
    parts = RewardParts(torch.stack([correct, brevity], dim=-1), ("correct", "brevity"), weights)  # [B, K, 2]
    greedy = torch.rand(GROUPS, generator=gen).round()  # [B] a greedy completion's reward (ReMax)
    batch = assemble(prompts, groups, pad_token_id=pad, rewards=rewards, baselines=greedy, parts=parts)
    return Rollout(step=0, batch=batch, stats={})


class FixedRollout(L.LightningDataModule):
    def __init__(self, rollout: Rollout) -> None:
        super().__init__()
        self.rollout = rollout

    def train_dataloader(self):
        rank, world = rank_and_world()
        mine = list(rank_block(self.rollout.batch.num_groups, rank, world))
        own = Rollout(step=0, batch=self.rollout.batch.select_groups(mine), stats={})
        self.groups = mine
        return DataLoader([own], batch_size=None, collate_fn=lambda x: x)


def environment_stats(rollout: Rollout, mine: list[int]) -> dict[str, float]:
    """The DataModule's statistics of the step, from this rank's groups of the global rollout."""
    rewards = rollout.batch.rewards.view(GROUPS, K)[mine]  # [b, K]
    correct = rollout.batch.reward_parts[:, 0].view(GROUPS, K)[mine]  # [b, K] the 0/1 function's
    mask = rollout.batch.completion_mask.view(GROUPS, K, -1)[mine]  # [b, K, C]
    lengths, finished = mask.sum(-1), mask[..., -1] == 0  # [b, K], [b, K]
    parts = {"exact": rewards, "format": torch.where(rewards.isnan(), rewards, 0.5 + rewards / 4)}
    graded = Graded(rewards, (correct == 1).float(), int(rewards.isnan().sum()), parts)
    return rollout_stats(*gather_graded(graded, lengths, finished), gen_seconds=1.0)


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...]"""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-cache", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    quiet_library_output()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = compose_config(
        "debug=quick",
        f"output_dir={os.path.dirname(args.out)}/run",
        f"model.cache_dir={args.model_cache}",
        f"strategy={args.strategy}",
        f"trainer.devices={world}",
        f"rl.prompts_per_step={GROUPS}",
        f"rl.prompts_per_minibatch={GROUPS}",
        f"rl.samples_per_prompt={K}",
        "rl.prompts_per_microbatch=1",  # several micro-batches per rank: accumulation is exercised
        *args.overrides,
    )
    s = check_config(cfg)
    L.seed_everything(0, verbose=False)
    task = instantiate_unwrapped(cfg.task)
    model_path = resolve_model_path(cfg.model, cfg.task, task)
    tok = load_tokenizer(model_path)
    module = build_module(s, model_path)
    rollout = global_rollout(len(tok), tok.pad_token_id, tok.eos_token_id)
    data = FixedRollout(rollout)
    metrics = {}

    initial = {}

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            if is_lora(pl_module.policy):  # the adapters' initial values too (a collective under FSDP)
                initial.update({k: v.clone() for k, v in full_state_dict(pl_module.policy).items()})

        def on_train_epoch_end(self, trainer, pl_module):
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})

    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=instantiate_unwrapped(cfg.trainer.strategy) if args.strategy != "auto" else "auto",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
    )
    trainer.fit(module, datamodule=data)
    if not initial:  # full weights: as loaded
        initial = load_causal_lm(model_path, dtype="float32").state_dict()
    state = full_state_dict(module.policy)  # a collective under FSDP: every rank
    # the real DataModule: its prompts for a step on this rank, and the statistics of a rollout it
    # collects with the trained policy (each rank samples its own groups)
    environment = build_datamodule(s, task, tok, model_path)
    prompts = [p.text for p in environment.sampler.prompts_for_step(3)]
    environment.setup("fit")
    environment.engine.sync(module.policy)  # under FSDP: unsharded until the rollout's sleep
    collected = {k: v for k, v in environment.rollout_for_step(3).stats.items() if not k.startswith("perf/")}
    groups, prompts, collected = (
        gather_objects(data.groups),
        gather_objects(prompts),
        gather_objects(collected),
    )
    stats = environment_stats(rollout, data.groups)
    if trainer.is_global_zero:
        out = {"state": {k: v.float() for k, v in state.items()}, "initial": initial, "groups": groups}
        out |= {"metrics": metrics, "prompts": prompts, "sharded": is_sharded(module.policy)}
        out["kl_coef"] = module.kl_controller.value
        out["rollout_stats"], out["collected_stats"] = stats, collected
        torch.save(out, args.out)
    world = rank_and_world()[1]
    shutdown()
    if world > 1:
        # gloo's threads still abort the interpreter's exit now and then after the process group is gone
        # ("terminate called without an active exception", exit -6; 1 CI run in about 7): everything
        # is written, so leave at once, as tests/dist_clip.py does
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
