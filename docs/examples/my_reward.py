"""A reward function written outside loorl, with TRL's signature.

`fn(prompts, completions, **columns) -> list[float | None]`: `columns` are the prompts' `meta`
entries as lists, one value per sample (for `task=arithmetic`: `a` and `b`). None marks a sample
that cannot be scored (left out of every baseline). Used beside the task's verifier:

    PYTHONPATH=docs/examples python src/train.py \
        '+reward.functions.digit={fn: {_target_: my_reward.last_digit_credit, _partial_: true}, weight: 0.5}'
"""

from __future__ import annotations


def last_digit_credit(
    prompts: list[str], completions: list[str], *, a: list[int], b: list[int], **_
) -> list[float | None]:
    """1 when the completion ends with the last digit of a + b, else 0; None for an empty completion."""
    out: list[float | None] = []
    for completion, x, y in zip(completions, a, b):
        text = completion.strip()
        out.append(None if not text else float(text[-1] == str(x + y)[-1]))
    return out
