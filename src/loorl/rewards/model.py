"""`reward=model`: a learned reward model (`AutoModelForSequenceClassification` with one label).

It has its own tokenizer and chat template, its own device and dtype, and scores prompt +
completion in batches. With a chat template the conversation is [user: question, assistant:
completion], where the question is the dataset's raw question (the `question` column) when there
is one, so the policy's own chat formatting does not leak into the reward model's input.
"""

from __future__ import annotations

import torch

from loorl.models.load import torch_dtype


def reward_device(device: str) -> str:
    """The torch device of `reward.functions.*.fn.device`: the trainer's accelerator names (cpu, gpu,
    auto: cuda where available; the config's default follows `trainer.accelerator`) or a torch device."""
    from loorl.util.hardware import uses_cuda

    if device in ("auto", "gpu"):
        return "cuda" if uses_cuda(device) else "cpu"
    return device


class RewardModel:
    def __init__(
        self,
        *,
        path: str,
        batch_size: int = 8,
        dtype: str = "float32",
        device: str = "auto",
        use_chat_template: bool | str = "auto",
        max_length: int = 2048,
    ) -> None:
        self.path, self.batch_size, self.dtype = path, batch_size, dtype
        self.device = reward_device(device)
        self.use_chat_template, self.max_length = use_chat_template, max_length
        self.model = None
        self.tokenizer = None

    def load(self) -> None:
        """Loaded at the first call, not at construction: config errors come before any weights."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.path, num_labels=1, dtype=torch_dtype(self.dtype)
        )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval().requires_grad_(False)

    def render(self, prompt: str, completion: str) -> str:
        template = self.tokenizer.chat_template is not None
        if self.use_chat_template is True or (self.use_chat_template == "auto" and template):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt + completion

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        if self.model is None:
            self.load()
        questions = columns.get("question") or prompts
        texts = [self.render(q, c) for q, c in zip(questions, completions)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=False,
            ).to(self.device)
            logits = self.model(**enc).logits  # [b, 1]
            scores += logits[:, 0].float().tolist()
        return scores
