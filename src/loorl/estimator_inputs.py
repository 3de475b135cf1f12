"""The settings an estimator's `needs` rule out (`loorl.algo.estimators.NEEDS`): ReMax's greedy baseline
is drawn only in the synchronous loop; GDPO normalises each reward function's reward apart, so it needs
two or more of them and cannot see what is added to or done to their sum. Checked before any model loads.
"""

from __future__ import annotations

from loorl.algo import estimators
from loorl.errors import ConfigError


def check_estimator_inputs(s) -> None:  # s: loorl.config.Settings (which imports this module)
    """A one-line ConfigError for a setting that leaves the estimator without what it reads."""
    needs = estimators.needs(s.estimator.function)
    label = s.estimator.label
    if "baselines" in needs and s.rollout.max_staleness:
        raise ConfigError(
            f"estimator={label} subtracts the reward of a greedy completion of each prompt, which only the "
            f"synchronous loop draws (rollout.max_staleness={s.rollout.max_staleness} samples ahead "
            "without one): set rollout.max_staleness=0"
        )
    if "parts" not in needs:
        return
    if any(owns_reward(target) for target in environment_targets(s)):
        raise ConfigError(
            f"estimator={label} normalises each reward function's reward apart, and "
            f"{s.environment.described}'s get_reward() replaces them with one reward: use estimator=grpo"
        )
    parts = list(s.reward.functions) + (["overlong"] if s.reward.overlong.buffer else [])
    if len(parts) < 2:
        raise ConfigError(
            f"estimator={label} normalises each reward function's reward apart, and this run has one "
            f"({parts[0]}): add another to reward.functions (e.g. reward=custom) or use estimator=grpo"
        )
    if s.reward.clip is not None:
        raise ConfigError(
            f"reward.clip={list(s.reward.clip)} clips the weighted sum of the rewards, which "
            f"estimator={label} never uses (it normalises each function's reward apart): set reward.clip=null"
        )
    if s.kl.needs_reference and s.kl.in_reward:
        raise ConfigError(
            f"kl.in_reward=true subtracts the KL penalty from the weighted sum of the rewards, which "
            f"estimator={label} never uses: set kl.in_reward=false (with kl.estimator=k3), the KL as a loss "
            "term"
        )


def environment_targets(s) -> list[str]:
    """The run's environment classes (`environment._target_`, or each of `environment.routes`)."""
    chosen = s.environment.chosen
    return [] if chosen is None else [chosen] if isinstance(chosen, str) else list(chosen.values())


def owns_reward(target: str) -> bool:
    """Whether the environment class gives each sample's reward itself (`get_reward()`)."""
    from loorl.util.plugins import import_object

    return callable(getattr(import_object(target, "environment._target_"), "get_reward", None))
