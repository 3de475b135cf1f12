"""The interface every rollout engine implements (HF `generate` now, vLLM next)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off


@dataclass
class Completion:
    token_ids: list[int]  # cut after the first EOS (EOS included when present)
    logprobs: list[float]  # the sampler's log-probability of each token
    finished: bool  # True if it ended with EOS, False if cut by the length limit


class RolloutEngine(ABC):
    """Samples K completions per prompt from the current policy."""

    name: str = "engine"

    def __init__(self, sampling: SamplingConfig, *, eos_token_id: int, pad_token_id: int) -> None:
        self.sampling = sampling
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    @abstractmethod
    def sync(self, policy, version: int | None = None) -> None:
        """Make the engine sample from `policy`'s current weights.

        `version` (the optimizer step count) lets an engine skip a copy it already holds.
        """

    def sleep(self) -> None:
        """Release memory the engine does not need while the policy trains (default: nothing)."""
        return None

    @abstractmethod
    def generate(
        self, prompt_ids: list[list[int]], *, n: int, greedy: bool = False
    ) -> list[list[Completion]]:
        """`n` completions for each prompt, as `result[prompt][sample]`."""

    def cut_at_eos(self, tokens: list[int], logprobs: list[float]) -> Completion:
        if self.eos_token_id in tokens:
            end = tokens.index(self.eos_token_id) + 1
            return Completion(tokens[:end], logprobs[:end], True)
        return Completion(tokens, logprobs, False)
