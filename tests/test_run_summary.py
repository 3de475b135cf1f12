"""The run's own record of its metrics (`RunSummary.history`, metrics.json): a metric is recorded at the
steps that logged it, never as an earlier step's value again."""

from __future__ import annotations

import json

import lightning as L
import torch

from loorl.training.callbacks import RunSummary, resumed_machine


class EveryOtherEpoch(L.LightningModule):
    """Logs `rollout/always` every epoch, `rollout/even` and `val/even` only at even epochs (as loorl logs
    `rollout/completion_len_correct` only at steps with a correct sample), `val/accuracy` always."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        epoch = self.current_epoch
        self.log("rollout/always", float(epoch), on_step=False, on_epoch=True, batch_size=1)
        if epoch % 2 == 0:
            self.log("rollout/even", float(epoch), on_step=False, on_epoch=True, batch_size=1)
        return (self.weight * batch).sum()

    def validation_step(self, batch, batch_idx):
        epoch = self.current_epoch
        self.log("val/accuracy", float(epoch), on_step=False, on_epoch=True, batch_size=1)
        if epoch % 2 == 0:
            self.log("val/even", float(epoch), on_step=False, on_epoch=True, batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_metric_is_recorded_only_at_the_steps_that_logged_it(tmp_path):
    summary = RunSummary(str(tmp_path))
    data = torch.utils.data.DataLoader(torch.ones(1, 1), batch_size=1)
    trainer = L.Trainer(max_epochs=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[summary])  # fmt: skip
    trainer.fit(EveryOtherEpoch(), data, data)
    steps = {key: [step for step, _ in points] for key, points in summary.history.items()}
    assert steps["rollout/always"] == [0, 1, 2, 3]
    assert summary.history["rollout/even"] == [(0, 0.0), (2, 2.0)]  # not (1, 0.0), (3, 2.0) again
    assert len(steps["val/accuracy"]) == 4 and len(steps["val/even"]) == 2


def test_a_held_out_only_set_gets_its_accuracy_alone_in_the_summary(tmp_path):
    """task.eval_levels' sets (`<name>@L<level>`) are validated but never drawn for a rollout: their row
    shows the held-out accuracy alone, not a reward of n/a (and a dataset's row is unchanged)."""
    from types import SimpleNamespace

    summary = RunSummary(str(tmp_path))
    summary.history = {
        "val/accuracy": [(0, 0.1), (2, 0.5)],
        "val/accuracy/chain_sum": [(0, 0.1), (2, 0.5)],
        "val/accuracy/chain_sum@L1": [(0, 0.02), (2, 0.16)],
        "rollout/reward": [(0, 0.25), (1, 0.5)],
        "rollout/reward/chain_sum": [(0, 0.25), (1, 0.5)],
        "curriculum/level/chain_sum": [(0, 0.0), (1, 1.0)],
    }
    text = summary.markdown(summary.summary(SimpleNamespace(current_epoch=2, global_step=2)))
    assert "| chain_sum@L1: held-out accuracy (held out only) | 2.0% -> 16.0% |" in text
    row = "| chain_sum: held-out accuracy; reward (first -> last steps); level | 10.0% -> 50.0%; 0.250"
    assert row in text


def test_every_memory_figure_of_the_summary_is_in_gib(tmp_path, monkeypatch):
    """One unit: the peak row, the memory-by-phase table and the memory plan's row all say GiB (2^30
    bytes, the plan's and the devices' unit); a peak of 7.14e9 bytes reads 6.65 GiB, not 7.14 GB."""
    from types import SimpleNamespace

    from loorl.util import peak_memory

    monkeypatch.setattr(peak_memory, "host_peak_bytes", lambda: 7.14e9)
    monkeypatch.setattr(peak_memory, "cuda_peak_bytes", lambda: 2.0 * 2**30)
    monkeypatch.setattr(peak_memory, "cuda_in_use", lambda: True)
    summary = RunSummary(str(tmp_path), facts={"memory plan": "fits: peak 4.72 GiB of 139.8 GiB (cuda)"})
    summary.history = {
        "rollout/reward": [(0, 0.25)],
        "perf/gen_peak_host_gib": [(0, 5.5)],
        "perf/gen_rise_host_gib": [(0, 1.25)],
        "perf/gen_peak_cuda_gib": [(0, 1.5)],
        "perf/gen_rise_cuda_gib": [(0, 0.5)],
    }
    s = summary.summary(SimpleNamespace(current_epoch=1, global_step=1))
    assert s["peak_host_gib"] == 7.14e9 / 2**30 and s["gen_peak_cuda_gib"] == 1.5
    text = summary.markdown(s)
    assert "| peak memory | 6.65 GiB resident on the host; 2.00 GiB allocated on CUDA |" in text
    assert "| gen | 5.500 | 1.250 | 1.500 | 0.500 |" in text
    memory_lines = [line for line in text.splitlines() if "memory" in line.lower() or "peak" in line]
    assert len(memory_lines) == 4, memory_lines  # the peak row, the plan's row, the table's title and header
    for line in memory_lines:
        assert " GB" not in line and (" GiB" in line or line.startswith("| phase |")), line


def test_the_machine_is_in_metrics_json_and_a_run_resumed_elsewhere_names_both(tmp_path):
    """metrics.json keeps the run's facts (a study's records read `machine` from them); a checkpoint
    keeps the machine, and a run resumed on another one says "A, then B"."""
    summary = RunSummary(str(tmp_path), facts={"machine": "AMD EPYC, 2 cores, AVX2 kernels"})
    data = torch.utils.data.DataLoader(torch.ones(1, 1), batch_size=1)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[summary])  # fmt: skip
    trainer.fit(EveryOtherEpoch(), data, data)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["facts"]["machine"] == "AMD EPYC, 2 cores, AVX2 kernels"
    assert "| machine | AMD EPYC, 2 cores, AVX2 kernels |" in (tmp_path / "summary.md").read_text()
    elsewhere = RunSummary(str(tmp_path / "b"), facts={"machine": "Intel Xeon, 2 cores, AVX512 kernels"})
    elsewhere.load_state_dict(summary.state_dict())
    both = "AMD EPYC, 2 cores, AVX2 kernels, then Intel Xeon, 2 cores, AVX512 kernels"
    assert elsewhere.facts["machine"] == both
    again = RunSummary(str(tmp_path / "c"), facts={"machine": "Intel Xeon, 2 cores, AVX512 kernels"})
    again.load_state_dict(elsewhere.state_dict())  # resumed twice on the second machine: named once
    assert again.facts["machine"] == elsewhere.facts["machine"]
    assert resumed_machine("A", "A") == "A" and resumed_machine(None, "B") == "not recorded, then B"
    assert resumed_machine("A", None) == "A"
    plain = RunSummary(str(tmp_path / "d"))  # no machine on either side: none is made up
    plain.load_state_dict(RunSummary(str(tmp_path / "e")).state_dict())
    assert "machine" not in plain.facts
