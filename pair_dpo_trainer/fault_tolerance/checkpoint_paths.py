"""What a checkpoint directory holds and which of its paths resume will open, resolved as the loaders resolve them.

A loader joins names it reads from files of the checkpoint to the checkpoint's path: DeepSpeed the tag in ``latest``
(``<checkpoint>/<tag>/*_model_states.pt``, unpickled with ``weights_only=False``, and ``glob``-ed), HF's Trainer the
shard names of a ``*.index.json``, torch's distributed checkpoint (FSDP2) the shard names in its ``.metadata``. A name
that is absolute or holds ``..`` (``os.path.join`` keeps an absolute second part), a symlink, or a special file would
make the loader read something other than what was scanned, or hang. The checks here refuse all of them, so what
``checkpoint_trust.py`` scans is what resume loads:

- :func:`scan_tree`: every entry of the checkpoint by ``lstat``, nothing opened: a symlink anywhere is
  ``checkpoint_unsafe_path``, a FIFO, socket or device is ``checkpoint_special_file``.
- :func:`deepspeed_tag`: the tag DeepSpeed's ``load_checkpoint(tag=None)`` would read from ``latest`` (its text,
  stripped), refused unless it is one plain directory name (letters, digits, ``_``, ``.``, ``-``; no separator,
  ``..`` or glob character) of a directory the checkpoint holds. The tag is then handed to DeepSpeed explicitly
  (``checkpoint_trust.deepspeed_loads_tag``), so ``latest`` is never read again. (With ``load_universal_checkpoint``
  DeepSpeed would read ``latest_universal``; HF's Trainer writes neither that file nor that layout, and the engine
  gets the scanned tag of ``latest`` all the same.)
- :func:`index_problem`: the shard names of HF's weight indexes are plain relative paths inside the checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pair_dpo_trainer.atomic import file_kind, read_regular

LATEST_FILENAME = "latest"
"""DeepSpeed's tag file (``DeepSpeedEngine.load_checkpoint`` reads it when no tag is passed)."""
DEEPSPEED_DIR_PREFIX = "global_step"
"""HF's test for a DeepSpeed checkpoint (``deepspeed_load_checkpoint`` globs ``<checkpoint>/global_step*``)."""
LATEST_MAX_BYTES = 4096
TAG_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A tag that is one plain directory name: ``os.path.join`` and DeepSpeed's ``glob`` both take it literally."""
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
INDEX_MAX_BYTES = 64 * 2**20


class RefusedError(Exception):
    """A checkpoint resume must not load: ``reason_code`` and the text of the refusal."""

    def __init__(self, reason_code: str, text: str) -> None:
        super().__init__(text)
        self.reason_code, self.text = reason_code, text


@dataclass
class Tree:
    """The regular files (relative POSIX names) and directories of a checkpoint, symlinks and special files refused."""

    files: list[str] = field(default_factory=list)
    dirs: set[str] = field(default_factory=set)


def scan_tree(root: Path) -> Tree:
    """Every entry under ``root`` by ``lstat`` (nothing is opened or followed).

    Raises:
        RefusedError: ``checkpoint_unsafe_path`` (a symlink) or ``checkpoint_special_file`` (FIFO, socket, device).
    """
    tree, pending = Tree(), [""]
    while pending:
        prefix = pending.pop()
        with os.scandir(root / prefix if prefix else root) as entries:
            for entry in entries:
                name = f"{prefix}{entry.name}"
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    tree.dirs.add(name)
                    pending.append(f"{name}/")
                elif stat.S_ISREG(mode):
                    tree.files.append(name)
                elif stat.S_ISLNK(mode):
                    target = os.readlink(entry.path)
                    raise RefusedError(
                        "checkpoint_unsafe_path",
                        f"{name} is a symbolic link (to {target}): a loader would read what it points to, which "
                        "the scan does not vouch for; a checkpoint holds no links",
                    )
                else:
                    raise RefusedError(
                        "checkpoint_special_file",
                        f"{name} is {file_kind(mode)}, not a regular file: reading it would block (a FIFO waits for "
                        "a writer forever) or read a device",
                    )
    tree.files.sort()
    return tree


def deepspeed_tag(root: Path, tree: Tree) -> str | None:
    """The tag DeepSpeed would load (see the module docstring), or None for a checkpoint without DeepSpeed files.

    Raises:
        RefusedError: ``checkpoint_unsafe_path`` (a tag that is not a plain directory name, or a checkpoint path that
            DeepSpeed's ``glob`` would expand), ``checkpoint_incomplete`` (``global_step*`` without ``latest``, or a
            tag naming no directory of the checkpoint).
    """
    deepspeed = any(name.startswith(DEEPSPEED_DIR_PREFIX) and "/" not in name for name in [*tree.dirs, *tree.files])
    if LATEST_FILENAME not in tree.files:
        if deepspeed:
            raise RefusedError(
                "checkpoint_incomplete",
                f"it holds DeepSpeed's {DEEPSPEED_DIR_PREFIX}* but no {LATEST_FILENAME} file naming the tag to load",
            )
        return None
    if glob.has_magic(str(root)):
        raise RefusedError(
            "checkpoint_unsafe_path",
            "its path has a glob character ([, *, ?), and DeepSpeed finds its files with glob.glob on that path, "
            "which could match another directory; move or rename it",
        )
    try:
        tag = read_regular(root / LATEST_FILENAME, limit=LATEST_MAX_BYTES, follow_symlinks=False).decode().strip()
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise RefusedError("checkpoint_unsafe_path", f"its {LATEST_FILENAME} cannot be read as a tag ({exc})") from exc
    if not TAG_PATTERN.fullmatch(tag):
        raise RefusedError(
            "checkpoint_unsafe_path",
            f"its {LATEST_FILENAME} names the tag {tag[:200]!r}, which is not one plain directory name inside the "
            "checkpoint (an absolute path, '..', a separator or a glob character): DeepSpeed would load files from "
            "elsewhere",
        )
    if tag not in tree.dirs:
        raise RefusedError(
            "checkpoint_incomplete", f"its {LATEST_FILENAME} names the tag {tag!r}, a directory it does not hold"
        )
    return tag


def index_problem(root: Path, tree: Tree) -> str | None:
    """Why a weight index of the checkpoint names a shard outside it (or cannot be read), else None."""
    for index in WEIGHT_INDEXES:
        if index not in tree.files:
            continue
        try:
            weight_map = json.loads(read_regular(root / index, limit=INDEX_MAX_BYTES)).get("weight_map", {})
            names = [str(value) for value in weight_map.values()]
        except (OSError, ValueError, AttributeError) as exc:
            return f"its {index} cannot be read ({exc})"
        for name in names:
            if safe_name(name) is None:
                return f"its {index} names the shard {name[:200]!r}, a path outside the checkpoint"
    return None


def safe_name(name: str) -> str | None:
    """``name`` as a normalised relative POSIX path inside a directory (``./x`` and ``a//x`` normalised), or None for
    one that is absolute, climbs out (``..``), names the directory itself, or holds a NUL."""
    if not isinstance(name, str) or "\0" in name:
        return None
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        return None
    return str(path)
