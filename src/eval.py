"""Entry point: `python src/eval.py policy=PATH [group=option ...] [eval.key=value ...]` (README:
Evaluation)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a checkout without installing

from loorl.cli.console import launch  # noqa: E402
from loorl.cli.evaluate import main  # noqa: E402

if __name__ == "__main__":
    launch("eval", main)
