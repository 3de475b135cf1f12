"""The interface every rollout engine implements, and what it is given.

An engine is a class: the built-in ones are named by `rollout.engine` (`hf`: loorl's decoding loop
on the live policy; `vllm`: a colocated vLLM `LLM`; `auto`: vLLM where CUDA and vllm are, HF
otherwise), any other by `rollout._target_: package.module.Class` (which wins over the name). A class
owns its settings (its block under `rollout`, or `rollout.options` for a plug-in), checks them in
`check` before any model loads, says in `logprobs_match_trainer` whether its log-probs are the
trainer's own and in `generates_in_trainer_precision` whether it generates under the trainer's
autocast, builds itself in `create`, and receives the policy's weights in `sync` as
`PolicyWeights`: (name, tensor) pairs streamed one at a time.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from loorl.errors import ConfigError
from loorl.models.lora import is_lora, lora_scalings, merged_weights
from loorl.parallel.fsdp import full_tensors
from loorl.types import Completion, SamplingConfig

if TYPE_CHECKING:
    from loorl.settings import ModelSettings, RolloutSettings


@dataclass(frozen=True)
class EngineContext:
    """What an engine class may read to check its settings (`check`: before any model is built, so
    `model_path` is then the pretrained path or None, and `tokenizer` None) and to build (`create`)."""

    rollout: RolloutSettings
    model_dtype: str = "float32"  # model.dtype: the compute dtype
    model: ModelSettings | None = None  # the whole model section (e.g. the tiny model's head size)
    model_path: str | None = None
    tokenizer: Any = None
    seed: int = 0
    share_prompt: bool = True
    parallel: str = "auto"  # the training strategy: auto (one process) | ddp | fsdp
    cuda: bool | None = None  # whether the run trains on CUDA (`Settings.on_cuda`); None: a device exists
    completion_tokens: int | None = None  # a sample's budget over all its turns (tools on); None: one turn
    settings: Any = None  # the engine's own settings as its `check` returned them (factory.EngineChoice)

    @property
    def on_cuda(self) -> bool:
        from loorl.util.hardware import cuda_available

        return cuda_available() if self.cuda is None else self.cuda

    def token_ids(self) -> dict:
        """The base engine's `eos_token_ids` and `pad_token_id`, from the tokenizer and the model files."""
        return {
            "eos_token_ids": eos_token_ids(self.model_path, self.tokenizer),
            "pad_token_id": self.tokenizer.pad_token_id,
        }


class PolicyWeights:
    """The policy's weights as an engine receives them at each sync.

    Iterating yields (name, full tensor) for every entry of the policy's state dict, one at a time:
    under FSDP each is gathered just before it is yielded (every rank iterates in step), so no second
    full copy of the model is resident. A LoRA policy (a peft model) streams its merged weights under
    the base model's names, W + (B @ A) * scale per adapted layer (`loorl.models.lora.merged_weights`),
    so a copying engine loads them as a full fine-tune's. `module` is the live policy itself (adapters
    and all), for an engine that samples with it in place instead of copying (the HF engine); a copying
    engine never needs it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if is_lora(self.module):
            return merged_weights(full_tensors(self.module), scalings=lora_scalings(self.module))
        return full_tensors(self.module)

    @classmethod
    def of(cls, value) -> PolicyWeights:
        return value if isinstance(value, PolicyWeights) else cls(value)


class RolloutEngine(ABC):
    """Samples K completions per prompt from the current policy."""

    name: str = "engine"
    # True: the DataModule calls `generate` (and only it: never the grading or a reward model) inside
    # the trainer's precision context, Lightning's autocast under bf16-mixed. For an engine that samples
    # with the live policy, which must compute as training_step does. False (default): an engine with
    # its own weights and dtype (vLLM), whose float32 would otherwise quietly become bf16 matmuls.
    generates_in_trainer_precision: bool = False
    # True: `generate` takes `stop` and `max_new_tokens` (see there), so tools can run between turns
    stops_on_sequences: bool = False
    # True: it also has `generate_keeping` and `continue_kept`, which keep a call's key/value cache for
    # its rows' next turn (`loorl.rollout.engines.kept_cache`; the HF engine's dynamic cache); False: each
    # turn is a `generate` on the whole transcript so far
    continues_turns: bool = False
    # True: it samples outside the training process already (vLLM servers): never wrapped in a sampler
    # process (`rollout.devices`), and `submit` returns at once
    samples_apart: bool = False
    # set by an engine that samples in the background (`submit`): how long the last `receive` waited
    wait_seconds: float | None = None
    # True: `generate` (and `submit`) take `rows`, each prompt's fields, for an environment that resets
    # one instance per sample with its prompt's row (`environment._target_`: `multi_turn.ToolEngine`)
    takes_rows: bool = False

    # ---- the class: settings, checks, construction ---------------------------------------------
    @classmethod
    def check(cls, ctx: EngineContext) -> None:
        """Raise a one-line ConfigError for settings this engine cannot run with (default: none)."""
        return None

    @classmethod
    def refuse_options(cls, ctx: EngineContext, own: str) -> None:
        """For an engine with settings of its own (`own` names them): `rollout.options` would be ignored."""
        if ctx.rollout.options:
            key = sorted(ctx.rollout.options)[0]
            raise ConfigError(
                f"rollout.options.{key} is set, but the {cls.name} engine takes no rollout.options (they "
                f"are a rollout._target_ engine's): its settings are {own}"
            )

    @classmethod
    def logprobs_match_trainer(cls, model_dtype: str) -> bool:
        """True when the engine's sampler log-probs equal the trainer's recomputation (then the
        learner skips recomputing them where it can). Default: False, the safe answer."""
        return False

    @classmethod
    def create(cls, ctx: EngineContext) -> RolloutEngine:
        """The engine for this run (unbuilt where building is costly: it may start at the first sync).
        Default: `cls(sampling, eos_token_ids=..., pad_token_id=..., **rollout.options)`."""
        return cls(ctx.rollout.sampling, **ctx.token_ids(), **ctx.rollout.options)

    def __init__(
        self, sampling: SamplingConfig, *, eos_token_ids: int | list[int], pad_token_id: int
    ) -> None:
        self.sampling = sampling
        # every id that ends a completion (Qwen: <|im_end|> and <|endoftext|>; Llama 3.1: three)
        self.eos_token_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError("a rollout engine needs at least one end-of-sequence token id")
        self.pad_token_id = pad_token_id

    # ---- the instance ------------------------------------------------------------------------------
    @abstractmethod
    def sync(self, weights: PolicyWeights, version: int | None = None, *, force: bool = False) -> None:
        """Make the engine sample from these weights (`PolicyWeights`; a bare module is wrapped).

        `version` (the optimizer step count) lets an engine skip a copy it already holds; `force`
        copies anyway (a checkpoint may have replaced the weights under the same step count).
        """

    def sleep(self) -> None:
        """Release memory the engine does not need while the policy trains (default: nothing)."""
        return None

    def use_temperature(self, temperature: float) -> None:
        """Sample at `temperature` from the next `generate` on (`rollout.temperature_schedule`). Default:
        the sampling config's temperature replaced; an engine that builds its sampler's parameters once
        overrides it, a wrapper passes it on to its inner engine."""
        self.sampling = replace(self.sampling, temperature=temperature)

    @abstractmethod
    def generate(
        self, prompt_ids: list[list[int]], *, n: int, greedy: bool = False, seed: int | None = None
    ) -> list[list[Completion]]:
        """`n` completions for each prompt, as `result[prompt][sample]`. `seed`: the sampler's random
        stream for this call (the same seed and weights give the same samples); None: the engine's
        own running stream.

        An engine with `stops_on_sequences` also takes `stop` (token-id sequences that end a
        completion, kept in it, like an EOS that does not finish it) and `max_new_tokens` (this call's
        limit instead of the sampling config's): what multi-turn rollouts with tools need
        (`loorl.rollout.multi_turn`)."""

    def generate_with_greedy(
        self, prompt_ids: list[list[int]], *, n: int, seed: int | None = None, **kwargs
    ) -> tuple[list[list[Completion]], list[Completion]]:
        """`generate`'s `n` samples of each prompt (the same ones, for the same seed) and one greedy
        completion of each (ReMax's baseline), as (`result[prompt][sample]`, `greedy[prompt]`).

        Default: a second `generate` call with `greedy=True`; an engine that can mix greedy and sampled
        requests in one call (vLLM's `LLM.generate` takes a `SamplingParams` per prompt) overrides it."""
        groups = self.generate(prompt_ids, n=n, seed=seed, **kwargs)
        greedy = self.generate(prompt_ids, n=1, greedy=True, seed=seed, **kwargs)  # [B][1]
        return groups, [g[0] for g in greedy]

    # ---- sampling ahead (rollout.max_staleness > 0) ------------------------------------------------
    # `submit` starts a generation with the weights of the last `sync` and returns a ticket; `receive(ticket)`
    # returns its completions and the seconds it took. The default generates in `submit`, in this process
    # (nothing overlaps); an engine in a process of its own (`wrappers.process_engine.ProcessEngine`) or one
    # that sends its requests to servers (`vllm_server.ServerEngine`) returns at once and generates while the
    # trainer trains. `max_in_flight`: how many submitted requests it holds at once (the DataModule
    # receives the oldest before submitting past it).
    max_in_flight: int = 1_000_000

    def submit(self, prompt_ids: list[list[int]], *, n: int, seed: int | None = None, **kwargs) -> int:
        """`kwargs`: what this engine's `generate` takes besides (`rows`, for an environment's)."""
        start = time.perf_counter()
        done = (self.generate(prompt_ids, n=n, seed=seed, **kwargs), time.perf_counter() - start)
        return self._hold(done)

    def receive(self, ticket: int | None = None) -> tuple[list[list[Completion]], float]:
        """The completions of the request `ticket` (None: the oldest held) and the seconds it took."""
        held = self.__dict__.setdefault("_held", {})
        return held.pop(min(held) if ticket is None else ticket)

    def _hold(self, done) -> int:
        """Keep a finished request's answer until it is received; its ticket."""
        held = self.__dict__.setdefault("_held", {})
        ticket = self.__dict__.get("_tickets", 0)
        self._tickets = ticket + 1
        held[ticket] = done
        return ticket

    def weight_sync_stats(self) -> dict[str, float]:
        """The last weight update's `perf/weight_sync_seconds` and `perf/weight_sync_bytes`, logged with
        the step, for an engine that copies weights to servers (a wrapper asks its inner engine).
        Default: none."""
        return {}

    def start(self) -> None:
        """Start what `submit` will need ahead of time (a sampler process); default: nothing."""
        return None

    def close(self) -> None:
        """Free what outlives a run (a sampler process); default: nothing."""
        return None

    def cut_at_eos(
        self, tokens: list[int], logprobs: list[float], stop: list[list[int]] | None = None
    ) -> Completion:
        """The completion up to and including its first end-of-sequence id (any of them), or the end of
        the first of the `stop` sequences (a tool call's closing tag: not finished, the sample goes on)."""
        stops = set(self.eos_token_ids)
        sequences = [q for q in stop or [] if q]
        for i, t in enumerate(tokens):
            if t in stops:
                return Completion(tokens[: i + 1], logprobs[: i + 1], True)
            if any(i + 1 >= len(q) and tokens[i + 1 - len(q) : i + 1] == q for q in sequences):
                return Completion(tokens[: i + 1], logprobs[: i + 1], False)
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
