"""loorl: RLOO and its sibling critic-free estimators for LLM fine-tuning (README.md)."""

from loorl.util.allocator import cap_onednn_primitive_cache

# before any oneDNN product of the process (the config's bf16 probe, a script's, a test's): the
# cache is sized at its first use (loorl.util.allocator)
cap_onednn_primitive_cache()
