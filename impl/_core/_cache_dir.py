"""Where groupflow keeps what it builds once and reuses: trained teachers, a compiled model."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$GROUPFLOW_CACHE`, else `$XDG_CACHE_HOME/groupflow`, else `~/.cache/groupflow` (an
    empty variable counts as unset)."""
    explicit = os.environ.get("GROUPFLOW_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "groupflow"
