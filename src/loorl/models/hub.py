"""Where a model name points without loading anything: a local folder, or the hub (and whether it answers)."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse


def looks_like_local_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.path.isdir(os.path.expanduser(name))


def hub_unreachable_reason() -> str | None:
    """A fast check that the hub answers at all (transformers retries for ~25 s when offline)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError as err:
        return f"hub unreachable: {err}"
    return None
