"""Which deprecation warnings loorl's own calls raise: `with loorl_deprecations() as seen: ...`.

A library that deprecates an API warns from inside it: the `warnings.warn` call sits in the library's
file, and the stack level it passes points at a caller that may be another library's frame, or torch's
`nn.Module.__call__` when the deprecated thing is a keyword of a model's forward. So a warning's printed
location does not say who made the deprecated call, and filtering by it would hide loorl's calls.
Here the whole stack is read at the `warnings.warn` call: leaving out the frames of the package that
warns (the deprecated API's own code) and torch.nn's call machinery, the first frame left made the
call. It is loorl's when its file is under `src/` (src/loorl or the entry points). Warnings that C code
raises (torch's `TORCH_WARN_DEPRECATION`) do not pass through `warnings.warn`: they are attributed to
the Python frame that called into C, and are loorl's when that frame is.

Written by hand: pytest's `recwarn` and `warnings.catch_warnings` record a warning's message and
printed location, not the stack it came from.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def is_deprecation(category: type[Warning], message: str) -> bool:
    """A deprecation warning's category, or a UserWarning that says "deprecated" (omegaconf 2.4 announces
    the end of `register_new_resolver` so)."""
    said = issubclass(category, UserWarning) and "deprecated" in message
    return issubclass(category, DEPRECATIONS) or said


CALL_MACHINERY = ("torch/nn/modules/module.py",)  # frames between a forward's caller and the forward


@dataclass(frozen=True)
class Deprecation:
    category: str
    message: str
    caller: str  # file:line of the call that made it


def _package(filename: str) -> str:
    """The top-level package a frame's file belongs to ('transformers', 'torch', ...), or the path."""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return parts[parts.index(marker) + 1]
    return filename


def is_loorl(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(SRC)


def caller_of_warning(frame) -> tuple[str, int] | None:
    """(file, line) of the frame that called the deprecated API, from the frame that calls `warnings.warn`."""
    warns_from = _package(frame.f_code.co_filename)
    while frame is not None:
        name = frame.f_code.co_filename
        skip = _package(name) == warns_from or any(name.endswith(m) for m in CALL_MACHINERY)
        if not skip and "importlib" not in name:
            return name, frame.f_lineno
        frame = frame.f_back
    return None


@contextmanager
def loorl_deprecations():
    """Yields a list that fills with the `Deprecation`s whose caller is loorl's code, while the block runs."""
    seen: list[Deprecation] = []
    original = warnings.warn

    def record(message, category=None, stacklevel=1, source=None, **kwargs):
        category = category or (message.__class__ if isinstance(message, Warning) else UserWarning)
        if is_deprecation(category, str(message)):
            found = caller_of_warning(sys._getframe(1))
            if found is not None and is_loorl(found[0]):
                seen.append(Deprecation(category.__name__, str(message), f"{found[0]}:{found[1]}"))
        return original(message, category, stacklevel + 1, source, **kwargs)

    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")  # every occurrence reaches `raised`, whatever pytest's filters say
        warnings.warn = record
        try:
            yield seen
        finally:
            warnings.warn = original
    for w in raised:  # the C-raised ones: attributed to the Python frame that called into C
        if is_deprecation(w.category, str(w.message)) and is_loorl(w.filename):
            entry = Deprecation(w.category.__name__, str(w.message), f"{w.filename}:{w.lineno}")
            if not any(s.caller == entry.caller and s.message == entry.message for s in seen):
                seen.append(entry)
