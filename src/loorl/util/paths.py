"""Where the repository's config tree is: `conf/` beside `src/` (an editable install, or a checkout)."""

from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
