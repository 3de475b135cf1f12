"""Code named by a dotted path in the config (`estimator._target_`, `loss._target_`, `rollout._target_`):
imported once, checked before any model loads, every failure one line naming the setting."""

from __future__ import annotations

from typing import Any

from loorl.errors import ConfigError


def import_object(path: str, setting: str) -> Any:
    """The object at `package.module.name` (a function or a class); ConfigError naming `setting`."""
    from hydra.utils import get_object

    try:
        return get_object(path)
    except Exception as err:  # noqa: BLE001 - ImportError, AttributeError, a failing module body
        cause = err.__cause__ or err
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise ConfigError(
            f"{setting}={path} cannot be imported ({reason}): check the dotted path, and that its "
            "package is importable (installed, or on PYTHONPATH)"
        ) from None
