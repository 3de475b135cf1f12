"""The interface every rollout engine implements (`hf`: transformers' generate; `vllm`: a colocated LLM)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    """The sampler's whole distribution: engines sample from exactly this, and nothing from the
    model's own generation_config.json; the trainer scores with the same temperature and truncation."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    @property
    def truncation(self) -> dict:
        """The arguments of `logprobs.token_logprobs` that make it score this distribution."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


@dataclass
class Completion:
    token_ids: list[int]  # cut after the first end-of-sequence id (included when present)
    logprobs: list[float]  # the sampler's log-probability of each token
    finished: bool  # True if it ended with EOS, False if cut by the length limit

    @property
    def text_ids(self) -> list[int]:
        """The tokens whose text the reward sees: without the end-of-sequence id (which need not
        be a special token that decoding would skip, e.g. a model's second EOS)."""
        return self.token_ids[:-1] if self.finished else self.token_ids


class RolloutEngine(ABC):
    """Samples K completions per prompt from the current policy."""

    name: str = "engine"

    def __init__(
        self, sampling: SamplingConfig, *, eos_token_ids: int | list[int], pad_token_id: int
    ) -> None:
        self.sampling = sampling
        # every id that ends a completion (Qwen: <|im_end|> and <|endoftext|>; Llama 3.1: three)
        self.eos_token_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError("a rollout engine needs at least one end-of-sequence token id")
        self.pad_token_id = pad_token_id

    @abstractmethod
    def sync(self, policy, version: int | None = None, *, force: bool = False) -> None:
        """Make the engine sample from `policy`'s current weights.

        `version` (the optimizer step count) lets an engine skip a copy it already holds; `force`
        copies anyway (a checkpoint may have replaced the weights under the same step count).
        """

    def sleep(self) -> None:
        """Release memory the engine does not need while the policy trains (default: nothing)."""
        return None

    @abstractmethod
    def generate(
        self, prompt_ids: list[list[int]], *, n: int, greedy: bool = False, seed: int | None = None
    ) -> list[list[Completion]]:
        """`n` completions for each prompt, as `result[prompt][sample]`. `seed`: the sampler's random
        stream for this call (the same seed and weights give the same samples); None: the engine's
        own running stream."""

    def cut_at_eos(self, tokens: list[int], logprobs: list[float]) -> Completion:
        """The completion up to and including its first end-of-sequence id (any of them)."""
        stops = set(self.eos_token_ids)
        for i, t in enumerate(tokens):
            if t in stops:
                return Completion(tokens[: i + 1], logprobs[: i + 1], True)
        return Completion(tokens, logprobs, False)


def eos_token_ids(model_path: str, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's config and
    generation-config `eos_token_id` (an int or a list), in that order, without repeats."""
    from transformers import AutoConfig, GenerationConfig

    found: list[int] = []

    def add(value) -> None:
        for v in [value] if isinstance(value, int) else list(value or []):
            if v is not None and int(v) not in found:
                found.append(int(v))

    add(tokenizer.eos_token_id)
    add(getattr(AutoConfig.from_pretrained(model_path), "eos_token_id", None))
    try:
        add(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    return found
