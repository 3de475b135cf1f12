"""A study part's settings resolved and compared: each setting's config composed at a seed and
flattened, its differences from the part's first setting (each must be a key the part's `may_differ`
names; across seeds, only the seed's own value may change), and the digest that names its runs'
folder."""

from __future__ import annotations

import hashlib
import json

from omegaconf import OmegaConf

from loorl.config import ConfigError, compose_config
from loorl.research.study import Part

RUN_KEYS = ("output_dir", "resume_from")  # where a run writes and how it restarts: not what it computes
RUN_FOLDER = "/study/run"  # the output_dir every setting is resolved with (keys under it name no setting)


def resolved(overrides: list[str], seed: int) -> dict[str, object]:
    """The resolved config of a run, flattened to dotted keys, without RUN_KEYS."""
    cfg = compose_config(*overrides, f"seed={seed}", f"output_dir={RUN_FOLDER}")
    flat = flatten(OmegaConf.to_container(cfg, resolve=True))
    return {k: v for k, v in flat.items() if k not in RUN_KEYS}


def flatten(node, prefix: str = "") -> dict[str, object]:
    """A nested config as dotted keys (an empty mapping stays a value)."""
    if isinstance(node, dict) and node:
        out = {}
        for key, value in node.items():
            out |= flatten(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: node}


def differences(a: dict, b: dict) -> dict[str, tuple[object, object]]:
    """key -> (a's value, b's value) where they differ (a missing key reads as `<absent>`)."""
    absent = "<absent>"
    return {
        k: (a.get(k, absent), b.get(k, absent))
        for k in sorted(set(a) | set(b))
        if a.get(k, absent) != b.get(k, absent)
    }


def named(key: str, may_differ: list[str]) -> bool:
    return any(key == m or key.startswith(m + ".") for m in may_differ)


def check_part(part: Part, *, echo=print) -> None:
    """Compose every setting (seed 0, and the first setting at a second seed), keep each setting's
    resolved config and digest, print the differences and raise ConfigError at the first one the part
    does not name."""
    configs = {}
    for setting in part.settings:
        setting.config = configs[setting.label] = resolved(setting.overrides, part.seeds[0])
        setting.digest = config_digest(setting.config)
    first = part.settings[0]
    echo(
        f"[{part.name}] {len(part.settings)} settings x seeds {part.seeds}; "
        f"they differ from {first.label!r} in:"
    )
    part.plan = []
    for setting in part.settings[1:]:
        diff = differences(configs[first.label], configs[setting.label])
        shown = "; ".join(f"{k}: {a} -> {b}" for k, a, b in ((k, *v) for k, v in diff.items())) or "nothing"
        part.plan.append(f"{setting.label}: {shown}")
        echo(f"  {setting.label}: {shown}")
        stray = [k for k in diff if not named(k, part.may_differ)]
        if stray:
            a, b = diff[stray[0]]
            raise ConfigError(
                f"study part {part.name}: setting {setting.label!r} also changes {stray[0]} ({a} -> {b}), "
                f"which may_differ ({part.may_differ}) does not name: pin it in the overrides or name it"
            )
    if len(part.seeds) > 1:
        seed = part.seeds[1]
        for key, (a, b) in differences(configs[first.label], resolved(first.overrides, seed)).items():
            if (a, b) != (part.seeds[0], seed):
                raise ConfigError(
                    f"study part {part.name}: {key} changes with the seed ({a} -> {b}) but is not the seed: "
                    "seeds may change only the seed and what takes its value"
                )


# Keys added to the config after studies had run, at the value that leaves a run as it was: left out of
# the digest at that value, so that the runs from before keep their folders (and are not run again).
LATER_KEYS: dict[str, object] = {"loss.zvp_alpha": None}  # RL-ZVP off (issue 81)

# Where a run reads its cached models (`LOORL_CACHE`): not what it computes. Hashed at the default, so a
# run's folder and record are the same whatever the machine's cache path (and the digests made before
# this, all at the default, stay).
PLACE_KEYS: dict[str, str] = {"model.cache_dir": "~/.cache/loorl"}


def digested(config: dict) -> dict:
    """What `config_digest` hashes of a resolved (flat) config: without its seed-valued keys and the
    `LATER_KEYS` at their neutral values, the `PLACE_KEYS` at their defaults."""
    seed = config.get("seed")
    kept = {k: v for k, v in config.items() if not ((k == "seed" or k.endswith(".seed")) and v == seed)}
    kept = {k: v for k, v in kept.items() if not (k in LATER_KEYS and v == LATER_KEYS[k])}
    return kept | {k: v for k, v in PLACE_KEYS.items() if k in kept}


def config_digest(config: dict) -> str:
    """A short hash of a resolved config's `digested` keys: the folder of a setting's runs."""
    return hashlib.sha256(json.dumps(digested(config), sort_keys=True, default=str).encode()).hexdigest()[:10]
