"""File helpers shared by the writers of model folders and checkpoints."""

from __future__ import annotations

import os
from pathlib import Path


def make_readable(folder: Path) -> None:
    """Give the files under ``folder`` the permissions the umask allows (some writers create 0600 files)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in Path(folder).rglob("*"):
        if path.is_file():
            os.chmod(path, 0o666 & ~mask)
