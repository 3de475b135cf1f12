"""The held-out metrics a validation logs: the DataModule's per-prompt results [n] become the
`val/<name>` metrics, averaged (`VALIDATION_METRICS`) or summed (`COUNTED_METRICS`) over the held-out
prompts and ranks, and `val/accuracy/<source>` per source of a mixed task."""

from __future__ import annotations

import lightning as L
import torch
from torchmetrics import MeanMetric

# the DataModule's per-prompt validation results -> the logged `val/<name>` metrics
VALIDATION_METRICS = {  # tool_used: greedy answers that called a tool (tools.max_turns > 0)
    "correct": "accuracy", "reward": "reward", "pass_k": "pass_at_k", "maj_k": "maj_at_k",
    "tool_used": "tool_used_frac",
}  # fmt: skip
# summed over held-out prompts (and ranks), not averaged; env_failures: samples (greedy and sampled) whose
# environment instance failed (environment._target_: a reset, get_reward or worker lost)
COUNTED_METRICS = {"unscorable": "unscorable", "env_failures": "env_failures"}


def overall_rows(results: dict) -> dict[str, torch.Tensor | None]:
    """The per-prompt metrics of `results` (VALIDATION_METRICS, COUNTED_METRICS) over the prompts the
    overall `val/<metric>` covers (`in_overall`; None: all): task=reasoning_gym's `eval_levels` sets are
    logged only as `val/accuracy/<name>@L<level>`, so `val/accuracy` keeps meaning the starting levels'."""
    keep = results.get("in_overall")  # [n] bool
    out = {key: results.get(key) for key in (*VALIDATION_METRICS, *COUNTED_METRICS)}
    if keep is None or bool(keep.all()):
        return out
    return {key: None if v is None else v[keep.to(v.device)] for key, v in out.items()}


def log_heldout_metrics(module: L.LightningModule, results: dict) -> None:
    """Update and log a validation batch's `val/<name>` metrics on `module` (its `val_metrics`,
    `val_counts` and `val_source_accuracy`, `PolicyGradientModule.validation_step`).

    `results`: the DataModule's per-prompt metrics [n] (`RolloutDataModule.heldout_results`);
    pass@k and maj@k are None when not measured. Each is averaged over all held-out prompts (and
    ranks), NaN entries (unscorable samples, prompts a metric does not apply to) left out;
    `unscorable` is summed; prompts whose `in_overall` is False (task.eval_levels' sets) count only
    in their source's `val/accuracy/<source>` (`overall_rows`)."""
    overall = overall_rows(results)
    n = len(overall["correct"])  # 0: a batch of eval_levels' prompts only (logged, not updated)
    for key, name in VALIDATION_METRICS.items():
        if overall.get(key) is None:
            continue
        metric = module.val_metrics[name]
        if n:
            metric.update(overall[key].float())
        module.log(f"val/{name}", metric, on_step=False, on_epoch=True, batch_size=n,
                 prog_bar=name == "accuracy")  # fmt: skip
    for key, name in COUNTED_METRICS.items():
        if overall.get(key) is not None:
            module.val_counts[name].update(overall[key].float().sum())
            module.log(f"val/{name}", module.val_counts[name], on_step=False, on_epoch=True, batch_size=n,
                     metric_attribute=f"val_counts.{name}")  # fmt: skip
    for source in results.get("source_names") or []:  # task=mix: accuracy per source as well
        if source not in module.val_source_accuracy:  # every source on every rank: synced alike
            module.val_source_accuracy[source] = MeanMetric(nan_strategy="ignore").to(module.device)
        rows = torch.tensor([s == source for s in results["sources"]])  # [n]
        if rows.any():
            metric = module.val_source_accuracy[source]
            metric.update(results["correct"][rows.to(results["correct"].device)].float())
            module.log(f"val/accuracy/{source}", metric, on_step=False, on_epoch=True,
                     batch_size=int(rows.sum()),
                     metric_attribute=f"val_source_accuracy.{source}")  # fmt: skip
