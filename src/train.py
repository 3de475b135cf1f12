"""Entry point: `python src/train.py [group=option ...] [key=value ...]` (see README.md)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a checkout without installing

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from loorl.config import CONF_DIR, check_group_choices  # noqa: E402
from loorl.errors import ConfigError  # noqa: E402
from loorl.train import main as run  # noqa: E402


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    try:
        check_group_choices([a for a in sys.argv[1:] if not a.startswith("-")])
    except ConfigError as err:
        print(f"error: {err}")
        raise SystemExit(2) from None
    main()
