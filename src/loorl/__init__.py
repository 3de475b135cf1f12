"""loorl: RLOO and its sibling critic-free estimators for LLM fine-tuning (README.md)."""
