"""Complete checkpoints only: a local checkpoint directory is replaced whole or not at all.

RLlib's `save_to_path` writes file by file into the directory it is given, so a process
killed mid-save leaves a mix of the new and the old checkpoint, or a file cut short, in
place of the last good one. Here a save goes to a fresh sibling (`NAME.new-<id>`), is
flushed to disk, and is sealed by a manifest written last (`MANIFEST`: every file with its
size, the iteration, the time). Only then the directories are switched:

    NAME -> NAME.prev,  NAME.new-<id> -> NAME,  NAME.prev removed

A kill between any two steps leaves at least one sealed checkpoint among NAME, NAME.prev and
NAME.new-<id>; `resolve` restores the newest sealed one and says so when it is not NAME.
Checkpoints written before manifests existed (or by RLlib itself) restore as they are.
URIs (s3://, gs://) are written by RLlib directly: an object store's upload is its own
transaction, not this one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from m2po_rllib.common import durable

logger = logging.getLogger(__name__)

MANIFEST = "m2po_checkpoint.json"
PREVIOUS = ".prev"
NEW = ".new-"


class IncompleteCheckpointError(FileNotFoundError):
    """No sealed checkpoint at a path or beside it; the message says what is missing."""


def save(path: str | os.PathLike, write: Callable[[str], Any], *, iteration: int | None = None) -> str:
    """Write a checkpoint with `write(directory)` and switch it in at `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f"{path.name}{NEW}{uuid.uuid4().hex[:8]}")
    write(str(fresh))
    _seal(fresh, iteration)
    previous = path.with_name(path.name + PREVIOUS)
    if path.exists():
        # `fresh` is sealed: an older NAME.prev is no longer needed as a fallback
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(path, previous)
        durable.fsync_dir(path.parent)
    os.rename(fresh, path)
    durable.fsync_dir(path.parent)
    for leftover in _siblings(path):  # NAME.prev and any NAME.new-* of saves that were killed
        shutil.rmtree(leftover, ignore_errors=True)
    durable.fsync_dir(path.parent)
    return str(path)


def _seal(directory: Path, iteration: int | None) -> None:
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST
    }
    durable.fsync_tree(directory)
    durable.write_json(directory / MANIFEST, {"iteration": iteration, "time_ns": time.time_ns(), "files": files})


def _siblings(path: Path) -> list[Path]:
    if not path.parent.is_dir():
        return []
    return [
        p for p in path.parent.iterdir()
        if p.is_dir() and (p.name == path.name + PREVIOUS or p.name.startswith(path.name + NEW))
    ]


def problems(directory: str | os.PathLike) -> list[str]:
    """What makes `directory` not a sealed checkpoint ([] when it is one)."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return [f"no {MANIFEST} (the save did not finish)"]
    # A save may switch this directory in or out while it is read (a reader beside a writer):
    # whatever vanishes meanwhile counts as missing, never as an error.
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return [f"no {MANIFEST} (the directory moved while it was read)"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"unreadable {MANIFEST}: {e}"]
    out = []
    for name, size in files.items():
        p = directory / name
        try:
            actual = p.stat().st_size if p.is_file() else None
        except FileNotFoundError:
            actual = None
        if actual is None:
            out.append(f"{name} is missing")
        elif actual != size:
            out.append(f"{name} has {actual} bytes, {size} were written")
    return out


def _manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def is_sealed(directory: str | os.PathLike) -> bool:
    return not problems(directory)


def _legacy(directory: Path) -> bool:
    """A checkpoint from before manifests (or RLlib's own): RLlib's metadata, no manifest."""
    return (directory / "rllib_checkpoint.json").is_file() and not (directory / MANIFEST).exists()


def newest(path: str | os.PathLike) -> Path | None:
    """The newest sealed checkpoint among `path` and the siblings a killed save leaves, or a
    checkpoint without a manifest at `path` itself (written before manifests existed)."""
    path = Path(path)
    sealed = []
    for p in [path, *_siblings(path)]:
        try:
            if p.is_dir() and is_sealed(p):
                sealed.append((p, _manifest(p)))
        except FileNotFoundError:  # a save switched it in or out meanwhile
            continue
    if sealed:
        return max(sealed, key=lambda pm: (pm[1].get("iteration") or -1, pm[1]["time_ns"]))[0]
    if path.is_dir() and _legacy(path):
        return path
    return None


def resolve(path: str | os.PathLike) -> str:
    """The checkpoint to restore for `path`: `path` if it is sealed, else the newest sealed
    one beside it (with a warning naming what was wrong). Raises IncompleteCheckpointError
    when there is none."""
    path = Path(path)
    found = newest(path)
    if found is None:
        what = "; ".join(problems(path)) if path.is_dir() else "no such directory"
        raise IncompleteCheckpointError(
            f"{path} is not a complete checkpoint ({what}) and no complete one is beside it "
            f"({path.name}{PREVIOUS}, {path.name}{NEW}*): it cannot be restored; start a new run"
        )
    if found != path:
        why = "; ".join(problems(path)) if path.is_dir() else "it is missing"
        iteration = _manifest(found).get("iteration")
        logger.warning(
            "checkpoint %s is incomplete (%s): restoring %s (iteration %s), the newest complete one "
            "(a save was interrupted)", path, why, found, iteration,
        )
    return str(found)


# -- paths at the API's edge (M2PO.save_to_path / restore_from_path / from_checkpoint) --
def local_path(path):
    """A local checkpoint path (relative, or with ~) made absolute; a URI (`s3://...`),
    None or a pyarrow path as given. RLlib's checkpoints read a relative path as a URI
    without a scheme ("URI has empty scheme")."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def restorable(path):
    """A local path's newest complete checkpoint (`resolve`); a URI as given."""
    path = local_path(path)
    return resolve(path) if isinstance(path, str) and "://" not in path else path
