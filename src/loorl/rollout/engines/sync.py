"""The one place where the learner's weights reach the environment's sampler: a Lightning callback
that hands the engine the policy's weights (`PolicyWeights`) before each rollout and validation."""

from __future__ import annotations

import lightning as L

from loorl.rollout.engines.base import PolicyWeights


class EngineSync(L.Callback):
    """Points the rollout engine at the policy's current weights before each rollout and validation.

    The one place where the learner's weights reach the environment's sampler. The version (the
    optimizer step count) lets an engine that copies weights (vLLM) skip a copy it already holds;
    the first sync of a `fit` always copies, since a checkpoint may have just replaced the weights.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.force = True

    def on_fit_start(self, trainer, pl_module) -> None:
        self.force = True  # weights and step count are restored from a checkpoint after this hook

    def _sync(self, trainer, pl_module) -> None:
        self.engine.sync(PolicyWeights(pl_module.policy), version=trainer.global_step, force=self.force)
        self.force = False

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._sync(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._sync(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.engine.sleep()  # after all validation batches (a rollout sleeps when it is collected)
