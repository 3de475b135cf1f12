"""A third rollout engine, written outside loorl: transformers' own `generate` on the engine's own
copy of the policy, which receives the trainer's weights only through the streamed (name, tensor)
pairs of each sync. `python src/train.py rollout._target_=plugins.engines.GenerateEngine` uses it
(tests/test_plugins.py). Each sync and generate call is appended to the file named by
LOORL_PLUGIN_CALLS, when set."""

from __future__ import annotations

import os

import torch

from loorl.errors import ConfigError
from loorl.rollout.engines.base import EngineContext, PolicyWeights, RolloutEngine
from loorl.types import Completion, SamplingConfig
from loorl.util.padding import pad


def _record(what: str) -> None:
    if path := os.environ.get("LOORL_PLUGIN_CALLS"):
        with open(path, "a") as f:
            f.write(what + "\n")


class GenerateEngine(RolloutEngine):
    """Samples with `model.generate` (do_sample, the run's temperature/top-k/top-p, nothing from the
    model's generation_config.json); the sampler log-probs are those of the processed distribution
    (`compute_transition_scores(normalize_logits=True)`). `rollout.options.batch_size`: prompts per call."""

    name = "generate"
    OPTIONS = ("batch_size",)

    def __init__(self, sampling: SamplingConfig, *, model_path: str, batch_size: int = 64, **token_ids):
        super().__init__(sampling, **token_ids)
        self.model_path, self.batch_size = model_path, batch_size
        self.model, self.version = None, None

    @classmethod
    def check(cls, ctx: EngineContext) -> None:
        unknown = sorted(set(ctx.rollout.options) - set(cls.OPTIONS))
        if unknown:
            raise ConfigError(
                f"rollout.options.{unknown[0]} is not an option of {cls.__name__}: {cls.OPTIONS}"
            )

    @classmethod
    def create(cls, ctx: EngineContext) -> GenerateEngine:
        return cls(ctx.rollout.sampling, model_path=ctx.model_path, **ctx.token_ids(), **ctx.rollout.options)

    def sync(self, weights: PolicyWeights, version: int | None = None, *, force: bool = False) -> None:
        _record("sync")
        if self.model is None:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        if force or version is None or version != self.version:
            own = self.model.state_dict()
            with torch.no_grad():
                for name, tensor in PolicyWeights.of(weights):  # one at a time, as it streams
                    own[name].copy_(tensor)
            self.version = version

    def generate(self, prompt_ids, *, n: int, greedy: bool = False, seed: int | None = None):
        _record("generate")
        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=not greedy, max_new_tokens=self.sampling.max_new_tokens, num_return_sequences=n,
            temperature=self.sampling.temperature, top_k=self.sampling.top_k, top_p=self.sampling.top_p,
            eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        out: list[list[Completion]] = []
        with torch.random.fork_rng(), torch.no_grad():  # the trainer's random stream is left as it was
            if seed is not None:
                torch.manual_seed(seed)
            for start in range(0, len(prompt_ids), self.batch_size):
                ids, mask = pad(
                    prompt_ids[start : start + self.batch_size], value=self.pad_token_id, side="left"
                )
                result = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
                tokens = result.sequences[:, ids.shape[1] :]  # [b*n, C]
                if greedy:
                    logprobs = torch.zeros(tokens.shape)
                else:
                    logprobs = self.model.compute_transition_scores(
                        result.sequences, result.scores, normalize_logits=True
                    )  # [b*n, C]
                rows = [self.cut_at_eos(t, lp) for t, lp in zip(tokens.tolist(), logprobs.tolist())]
                out += [rows[g * n : (g + 1) * n] for g in range(len(rows) // n)]
        return out
