"""Entry point: `python src/train.py [group=option ...] [key=value ...]` (see README.md)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a checkout without installing

from loorl.cli.console import launch  # noqa: E402
from loorl.cli.train import main  # noqa: E402

if __name__ == "__main__":
    launch("train", main)
