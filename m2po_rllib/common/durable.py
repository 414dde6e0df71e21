"""Writes that survive a `kill -9` (or a lost node) at any moment: a file or a directory is
written beside its final name, flushed to disk, then renamed over it. A rename within one
directory is atomic on POSIX file systems, so a reader sees the old version or the new
one, never a mix; the directory's own fsync makes the rename itself durable."""

from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory `path` (new names, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file under `root` and then every directory, deepest first."""
    for here, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(here, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(here)


def write_text(path: str | os.PathLike, text: str) -> None:
    """`path` holds `text` whole, or keeps its previous contents."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: str | os.PathLike, value, indent: int | None = 2, **dumps_kwargs) -> None:
    write_text(path, json.dumps(value, indent=indent, **dumps_kwargs))
