"""Where longhorizon keeps what it makes once and reuses: the user's cache folder.

`$LONGHORIZON_CACHE` if set, else `$XDG_CACHE_HOME/longhorizon`, else `~/.cache/longhorizon`;
under it `models/` (converted and tiny models), `search/` (the search env's corpora), `web/` (the
local web apps' snapshots). Never the current folder: a command run from elsewhere finds the same
files.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(*parts: str) -> Path:
    """A folder under the user's cache (not created: callers make what they write into)."""
    root = os.environ.get("LONGHORIZON_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "longhorizon"
    )
    return Path(root, *parts)
