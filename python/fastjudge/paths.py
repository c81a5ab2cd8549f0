"""Where fastjudge keeps what it makes on a machine: the demo judge, compiled steps."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$FASTJUDGE_CACHE``, else ``$XDG_CACHE_HOME/fastjudge``, else ``~/.cache/fastjudge``."""
    root = os.environ.get("FASTJUDGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastjudge")
    return Path(root)
