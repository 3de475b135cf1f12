"""What a run leaves behind: the run summary (`RunSummary`; its markdown table and plot are
`loorl.training.run_report`'s), the memory by phase, the validation samples and the HF export. (The
engine's weight sync is `loorl.rollout.engines.sync`; the graceful stop on SIGTERM is
`loorl.training.graceful_stop`.)"""

from __future__ import annotations

import csv
import gc
import json
import logging
import math
import time
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.utilities import rank_zero_only

from loorl.models.lora import is_lora, save_lora
from loorl.parallel.fsdp import full_state_dict, is_sharded, unwrapped_class
from loorl.training.run_report import MEMORY_PHASES, finite_mean, plot_learning_curve, summary_markdown
from loorl.util.allocator import give_back_freed_memory
from loorl.util.peak_memory import peak_memory_gib, pop_phase_peaks_gib
from loorl.util.profiling import PHASES

log = logging.getLogger("loorl")


def rl_steps_done(trainer) -> int:
    """The RL step a validation measures: RL steps done so far (0 before training)."""
    return trainer.current_epoch + 1 if trainer.state.fn == "fit" else trainer.global_step


class PhaseMemory(L.Callback):
    """Logs each step's memory by phase in GiB (`perf/<phase>_peak_host_gib` and
    `perf/<phase>_rise_host_gib`, `..._cuda_gib` where CUDA is in use;
    `loorl.util.peak_memory.phase_peak`): the step's rollout (gen, grade) and
    its update. What validation's phases reached goes into the run's overall peak only."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        pop_phase_peaks_gib()  # the step's rollout is generated after this hook, as the loop fetches it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        peaks = pop_phase_peaks_gib()  # this rank's (rank 0's are logged)
        if peaks:
            pl_module.log_dict(peaks, on_step=False, on_epoch=True, reduce_fx="max", batch_size=1)


class TrimFreedMemory(L.Callback):
    """Every `every` RL steps, hands the heap's free pages back to the OS (`give_back_freed_memory`),
    where `keep_freed_memory` keeps them: kept, they fragment as the step's tensors change size,
    and a long run's peak climbs (docs/performance/memory.md)."""

    def __init__(self, every: int):
        self.every = every

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trims_after(trainer.current_epoch, self.every):
            give_back_freed_memory()


def trims_after(step: int, every: int) -> bool:
    """Whether `TrimFreedMemory` trims after RL step `step` (0-based): after every `every`-th step."""
    return every > 0 and (step + 1) % every == 0


def logged_this_epoch(trainer) -> dict:
    """The metrics logged in the epoch that is ending (its training or validation loop), as
    `trainer.callback_metrics` names them. `callback_metrics` itself also keeps every earlier epoch's
    keys: a metric a step does not log (`rollout/completion_len_correct` when no sample was correct, a
    curriculum's level, the tools' counts) would read as the last step's value again. From the logger
    connector's results of the epoch (Lightning 2.x, not public API; `EpochRow` reads them too)."""
    return trainer._logger_connector.metrics["callback"]


def resumed_machine(before: str | None, now: str | None) -> str:
    """The `machine` fact of a run resumed from a checkpoint: the one it started on, and the one it
    resumed on where that is another ("A, then B": a run from before runs kept their machine is
    "not recorded, then B")."""
    before = before or "not recorded"
    if now is None or now == before or before.endswith(f", then {now}"):
        return before
    return f"{before}, then {now}"


class RunSummary(L.Callback):
    """Collects per-step metrics and, at the end of `fit`, writes `summary.md`, `metrics.json` and
    `learning_curve.png` into `output_dir` and prints the summary.

    Step 0 is the policy before any update (the pre-training validation); the rollout of RL step s
    is sampled from the policy after s updates, the validation after epoch s from the one after s+1.
    """

    def __init__(
        self, output_dir: str, title: str = "loorl run", pass_k: int = 0, facts: dict[str, str] | None = None
    ) -> None:
        self.output_dir = Path(output_dir)
        self.title = title
        self.pass_k = pass_k
        self.facts = dict(facts or {})  # name -> one line the summary states as is (the task's run_facts)
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.started = time.perf_counter()
        self.summary_text = ""
        self.written: dict[str, float] | None = None  # the summary on_fit_end wrote

    # in every checkpoint: a resumed run's summary, plot and wall time cover the whole run
    # the machine too: a run resumed elsewhere says so (its numbers and wall time are both machines')
    def state_dict(self) -> dict:
        state = {"history": self.history, "elapsed": time.perf_counter() - self.started}
        return state | ({"machine": self.facts["machine"]} if "machine" in self.facts else {})

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: [tuple(p) for p in v] for k, v in state["history"].items()}
        self.started = time.perf_counter() - state["elapsed"]
        if "machine" in state or "machine" in self.facts:
            self.facts["machine"] = resumed_machine(state.get("machine"), self.facts.get("machine"))

    def _record(self, key: str, step: int, value) -> None:
        self.history.setdefault(key, []).append((step, float(value)))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        logged = logged_this_epoch(trainer)
        if trainer.sanity_checking or "val/accuracy" not in logged:
            return
        step = rl_steps_done(trainer)
        for key, value in logged.items():
            if key.startswith("val/"):
                self._record(key, step, value)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        epoch_values = {}  # a metric logged on step and epoch appears as `x`, `x_step` and `x_epoch`
        recorded = (
            "rollout/",
            "perf/",
            "train/",
            "dynamic/",
            "tools/",
            "curriculum/",
            "staleness/",
            "pools/",
        )
        for key, value in logged_this_epoch(trainer).items():
            if key.startswith(recorded) and not key.endswith("_step"):
                epoch_values[key.removesuffix("_epoch")] = value
        for key, value in epoch_values.items():
            self._record(key, trainer.current_epoch, value)

    def staleness(self) -> dict[str, float]:
        """rollout.max_staleness > 0: the run's version-lag histogram (samples trained at each lag), the
        largest lag, the samples dropped for being too old and those whose tokens span two versions."""
        prefix = "staleness/samples_lag_"
        lags = sorted(int(k.removeprefix(prefix)) for k in self.history if k.startswith(prefix))
        out = {f"staleness_samples_lag_{lag}": sum(self.series(f"{prefix}{lag}")) for lag in lags}
        if lags:
            out["staleness_lag_max"] = float(max(lags))
            out["staleness_dropped_samples"] = sum(self.series("staleness/dropped_samples"))
            out["staleness_spanning_samples"] = sum(self.series("staleness/spanning_samples"))
        return out

    def series(self, key: str) -> list[float]:
        return [v for _, v in self.history.get(key, [])]

    def summary(self, trainer) -> dict[str, float]:
        acc = self.series("val/accuracy")
        reward = self.series("rollout/reward")
        window = max(1, min(10, len(reward) // 5))
        out = {
            "rl_steps": trainer.current_epoch,
            "optimizer_steps": trainer.global_step,
            "val_accuracy_start": acc[0] if acc else float("nan"),
            "val_accuracy_end": acc[-1] if acc else float("nan"),
            "val_accuracy_best": max(acc) if acc else float("nan"),  # the end should be close to it
            "reward_first": finite_mean(reward[:window]),
            "reward_last": finite_mean(reward[-window:]),
            "kl_last": (self.series("rollout/kl") or [float("nan")])[-1],
            "wall_seconds": time.perf_counter() - self.started,
            "gen_tokens_per_s": finite_mean(self.series("perf/gen_tokens_per_s")),
            "train_tokens_per_s": finite_mean(self.series("perf/train_tokens_per_s")),
        }
        out["val_accuracy_gain"] = out["val_accuracy_end"] - out["val_accuracy_start"]
        pass_k = self.series("val/pass_at_k")
        out["val_pass_at_k_start"] = pass_k[0] if pass_k else float("nan")
        out["val_pass_at_k_end"] = pass_k[-1] if pass_k else float("nan")
        maj_k = self.series("val/maj_at_k")
        out["val_maj_at_k_start"] = maj_k[0] if maj_k else float("nan")
        out["val_maj_at_k_end"] = maj_k[-1] if maj_k else float("nan")
        out["gen_tokens"] = sum(self.series("rollout/gen_tokens"))
        for key in ("rounds", "groups_with_signal", "filler_groups"):  # rl.dynamic_sampling: per-step means
            out[f"dynamic_{key}_mean"] = finite_mean(self.series(f"dynamic/{key}"))
        for key in ("calls_per_sample", "used_frac", "errors", "timeouts", "turns_per_sample",
                    "inserted_tokens"):  # fmt: skip  # multi-turn rollouts with tools: per-step means
            out[f"tools_{key}_mean"] = finite_mean(self.series(f"tools/{key}"))
        out["tools_seconds_mean"] = finite_mean(self.series("perf/tool_seconds"))
        out |= self.staleness()
        out |= peak_memory_gib()  # this rank's (rank 0 writes the summary)
        for phase in ("step", *PHASES):  # medians: the first steps pay one-off costs (allocation, caches)
            values = self.series(f"perf/{phase}_seconds")
            out[f"{phase}_seconds"] = float(np.median(values)) if values else float("nan")
        for phase in MEMORY_PHASES:  # the largest over steps: memory must fit the worst step
            for key in ("peak_host", "rise_host", "peak_cuda", "rise_cuda"):
                values = self.series(f"perf/{phase}_{key}_gib")
                out[f"{phase}_{key}_gib"] = max(values) if values else float("nan")
        return out

    def markdown(self, s: dict[str, float]) -> str:
        """summary.md's text (`loorl.training.run_report.summary_markdown`)."""
        return summary_markdown(
            s, title=self.title, pass_k=self.pass_k, history=self.history, facts=self.facts
        )

    @rank_zero_only
    def on_fit_end(self, trainer, pl_module) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        s = self.written = self.summary(trainer)  # what train() returns: the figures summary.md shows
        self.summary_text = self.markdown(s)
        (self.output_dir / "summary.md").write_text(self.summary_text)
        (self.output_dir / "metrics.json").write_text(
            json.dumps({"summary": s, "history": self.history, "facts": self.facts}, indent=1, default=float)
        )
        plot_learning_curve(self.history, self.output_dir / "learning_curve.png", title=self.title)
        print("\n" + self.summary_text + f"\nwritten to {self.output_dir}/ (summary.md, learning_curve.png)")


class SampleLog(L.Callback):
    """Readable samples: at every validation, the greedy completions of the first `rows` held-out
    prompts (all of them with `rows=-1`) go to `path` (CSV: step, prompt, completion, reward,
    correct) and, when a wandb logger is attached, to its `samples` table (the rows so far).

    Rows of a step are replaced when it is validated again (a resumed run re-validates the steps
    after its checkpoint), so the file holds each step once. Rank 0's prompts (its shard under DDP).
    """

    COLUMNS = ("step", "prompt", "completion", "reward", "correct")

    def __init__(self, path: str, rows: int = 8) -> None:
        self.path, self.rows = Path(path), rows
        self.pending: list[dict] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking or (0 <= self.rows <= len(self.pending)):
            return
        step = rl_steps_done(trainer)
        room = len(batch["prompts"]) if self.rows < 0 else self.rows - len(self.pending)
        for i in range(min(room, len(batch["prompts"]))):
            reward = float(batch["reward"][i])
            self.pending.append(
                {
                    "step": step,
                    "prompt": batch["prompts"][i],
                    "completion": batch["completions"][i],
                    "reward": None if math.isnan(reward) else reward,
                    "correct": None if math.isnan(float(batch["correct"][i])) else int(batch["correct"][i]),
                }
            )

    @staticmethod
    def _typed(row: dict[str, str]) -> dict:
        """A row read back from the CSV, with the types it was written with (an empty reward: None)."""
        reward, correct = row["reward"], row["correct"]
        return {**row, "step": int(row["step"]), "reward": float(reward) if reward else None,
                "correct": int(correct) if correct else None}  # fmt: skip

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        rows, self.pending = self.pending, []
        if trainer.sanity_checking or not rows or not trainer.is_global_zero:
            return
        kept = []
        if self.path.is_file():
            with self.path.open(newline="") as f:
                kept = [self._typed(r) for r in csv.DictReader(f) if int(r["step"]) != rows[0]["step"]]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.COLUMNS)
            writer.writeheader()
            writer.writerows(kept + rows)
        table = [[r[c] for c in self.COLUMNS] for r in kept + rows]
        for logger in trainer.loggers:
            if type(logger).__name__ == "WandbLogger":
                logger.log_table(key="samples", columns=list(self.COLUMNS), data=table)


def drop_optimizer_state(trainer) -> None:
    """The optimizers' state emptied once training is over (its checkpoints are written by then): the
    export's copies then reuse that memory instead of adding to it. AdamW keeps two float32 moments per
    weight: 1.08 GB for SmolLM2, next to its 0.54 GB of weights (a 3-step SmolLM2 run's resident set
    peaked in `save_pretrained`)."""
    for optimizer in trainer.optimizers:
        optimizer.state.clear()
    gc.collect()


def save_policy(policy, tokenizer, output_dir: Path, *, adapter_dir: Path, state: dict | None = None) -> None:
    """The policy and its tokenizer as a Hugging Face folder, with `save_pretrained`: a run's export
    (`HFExport`) and a checkpoint's for lm-eval (`loorl.cli.lm_harness.export_checkpoint`) write the
    same. A LoRA policy is written as the merged model (`output_dir`, loaded like any other) and as its
    adapters in peft's format (`adapter_dir`), `loorl.models.lora.save_lora`. `state`: the full state
    dict gathered from a sharded policy, else None (its own)."""
    if is_lora(policy):
        save_lora(policy, merged_dir=output_dir, adapter_dir=adapter_dir, state=state)
    else:
        policy.save_pretrained(output_dir, state_dict=state)
        if is_sharded(policy):  # save_pretrained names the class it sees: FSDP's subclass
            policy.config.architectures = [unwrapped_class(policy).__name__]
            policy.config.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


class HFExport(L.Callback):
    """Saves the trained policy and its tokenizer at the end of `fit` (`save_policy`): one full model,
    written by rank 0 (under FSDP every rank takes part in gathering it first); a LoRA policy's adapters
    go to `adapter_dir` (default: `adapter` beside `output_dir`)."""

    def __init__(self, output_dir: str, tokenizer, *, adapter_dir: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.adapter_dir = Path(adapter_dir) if adapter_dir else self.output_dir.with_name("adapter")
        self.tokenizer = tokenizer

    def on_fit_end(self, trainer, pl_module) -> None:
        drop_optimizer_state(trainer)
        policy = pl_module.policy
        state = full_state_dict(policy) if is_sharded(policy) else None  # collective under FSDP
        if trainer.is_global_zero:
            save_policy(policy, self.tokenizer, self.output_dir, adapter_dir=self.adapter_dir, state=state)
