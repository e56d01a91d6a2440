"""The tokenised-pairs cache: one directory per (rows, tokenizer, limits), written once, memory-mapped after that.

Location: ``PairDPOConfig.dataset_cache_dir``, by default ``$HF_DATASETS_CACHE/pair_dpo_trainer/pairs`` (``datasets``'
own cache, ``~/.cache/huggingface/datasets`` unless set): node-local on most clusters, so each node tokenises once
and its ranks share the files; shared across runs, so a second run (a resume, another learning rate) tokenises
nothing. Each entry is ``<root>/pairs-<32 hex of the key's SHA-256>/`` holding ``meta.json`` (the key, what was
written, who wrote it and when) and ``pairs.arrow`` (an Arrow stream file) unless nothing had to change (pre-tokenised
rows within the limits: the dataset itself is used).

An entry is checked against the chunked digest its ``meta.json`` records each time it is looked up (on every core,
by the process that looks it up: each node's local main); one that does not match is logged, removed and rebuilt
from the rows, never used.

Details: data/README.md, "Module notes", ``cache.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pair_dpo_trainer.atomic import disk_full, read_regular, space_text, unwritable
from pair_dpo_trainer.errors import ConfigError, PairDPOError
from pair_dpo_trainer.integrity.hashing import digest_per_record

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2
"""Part of every key (2: entries record the chunked digest of ``pairs.arrow``, checked on lookup)."""
META_FILE = "meta.json"
META_MAX_BYTES = 64 * 2**20
"""An entry's ``meta.json`` larger than this is not read (an entry that is no cache's)."""
ARROW_FILE = "pairs.arrow"
_STALE_SECONDS = 24 * 3600


def default_cache_dir() -> Path:
    """``$HF_DATASETS_CACHE/pair_dpo_trainer/pairs`` (the environment variable read now, else ``datasets``')."""
    root = os.environ.get("HF_DATASETS_CACHE")
    if not root:
        import datasets

        root = str(datasets.config.HF_DATASETS_CACHE)
    return Path(root) / "pair_dpo_trainer" / "pairs"


def rows_fingerprint(rows: Iterable[Any]) -> str:
    """SHA-256 of a sequence of rows: each row pickled (protocol 5), length-prefixed, in order.

    Equal fingerprints mean equal rows (a pickle rebuilds exactly its object); equal rows built differently (keys in
    another order, a shared object) may pickle differently: the cache then misses, never mixes datasets up.

    Raises:
        TypeError / pickle.PicklingError: A row that does not pickle.
    """
    digest = hashlib.sha256(b"pair_dpo_trainer.pylist/1\n")
    count = 0
    for row in rows:
        data = pickle.dumps(row, protocol=5)
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
        count += 1
    digest.update(f"\n{count}".encode())
    return digest.hexdigest()


def key_digest(key: Mapping[str, Any]) -> str:
    """SHA-256 of the key's canonical JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    """One complete entry.

    Attributes:
        directory: The entry's directory.
        meta: Its ``meta.json``: ``key``, ``result`` (``rows``, ``num_truncated``, ``arrow`` file name or None,
            ``size``, ``sha256``, ``digest``: the chunked digest record),
            ``created_by`` (``host``, ``pid``), ``created_at``, ``seconds``, ``num_proc``.
        built_here: This process built it (False: found, written by an earlier run or another process).
    """

    directory: Path
    meta: dict[str, Any]
    built_here: bool = False

    @property
    def arrow_path(self) -> Path | None:
        """The Arrow file, or None when the input needed no change."""
        name = self.meta["result"].get("arrow")
        return None if name is None else self.directory / name


def written_by(dataset: Any) -> tuple[Path, dict[str, Any]] | None:
    """The Arrow file a pairs dataset memory-maps and who wrote its cache entry (``created_by``: ``host``, ``pid``);
    None for a dataset that was not read from the cache."""
    files = getattr(dataset, "cache_files", None) or []
    if not files:
        return None
    arrow = Path(files[0]["filename"])
    try:
        meta = json.loads(read_regular(arrow.parent / META_FILE, limit=META_MAX_BYTES))
    except (OSError, ValueError):
        return None
    creator = meta.get("created_by") if isinstance(meta, dict) else None
    return (arrow, creator) if isinstance(creator, dict) else None


class PairCache:
    """The cache under ``root`` (see the module docstring).

    Args:
        root: The cache directory (created when an entry is first built).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def entry_dir(self, key: Mapping[str, Any]) -> Path:
        """Where the entry of ``key`` lives."""
        return self.root / f"pairs-{key_digest(key)[:32]}"

    def lookup(self, key: Mapping[str, Any]) -> CacheEntry | None:
        """The complete entry of exactly ``key`` whose Arrow file matches its recorded size and digest, else None (an
        entry that does not match is removed: see :meth:`_intact`)."""
        directory = self.entry_dir(key)
        try:
            meta = json.loads(read_regular(directory / META_FILE, limit=META_MAX_BYTES))
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("key") != json.loads(json.dumps(dict(key))):
            return None
        result = meta.get("result", {})
        if result.get("arrow") is not None and not self._intact(directory, result):
            return None
        return CacheEntry(directory, meta)

    def _intact(self, directory: Path, result: Mapping[str, Any]) -> bool:
        """Whether the entry's Arrow file has the size and chunked digest ``result`` records; one that has not is
        logged and removed (``get_or_build`` then rebuilds it from the rows)."""
        path = directory / result["arrow"]
        try:
            found = path.stat().st_size
            if found == result["size"]:
                actual, found = digest_per_record(path, result["digest"])
                if actual == result["digest"]["digest"]:
                    return True
                found_text = f"digest {actual[:16]}..., recorded {result['digest']['digest'][:16]}..."
            else:
                found_text = f"{found} bytes, recorded {result['size']}"
        except (OSError, KeyError, TypeError, ValueError) as exc:
            found_text = f"unreadable: {exc}"
        logger.warning(
            "the tokenised-pairs cache entry at %s did not match its recorded digest (%s): it is removed and rebuilt "
            "from the rows",
            directory,
            found_text,
        )
        self._remove(directory)
        return False

    def _remove(self, directory: Path) -> None:
        """Moves an entry out of the way at once (a rename), then deletes it."""
        gone = self.root / f".{directory.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(directory, gone)
        except OSError:
            return  # already moved by another process
        shutil.rmtree(gone, ignore_errors=True)

    def get_or_build(
        self, key: Mapping[str, Any], build: Callable[[Path], dict[str, Any]], *, num_proc: int = 1
    ) -> CacheEntry:
        """The entry of ``key``; built first when missing.

        Args:
            key: The cache key (JSON-serialisable).
            build: ``build(directory) -> result``: writes the entry's files into ``directory`` (a temporary one) and
                returns the ``result`` recorded in ``meta.json`` (``arrow``: the Arrow file's name or None, ``size``,
                ``rows``, ...).
            num_proc: Recorded in ``meta.json``.

        Raises:
            ConfigError: ``dataset_cache_unwritable`` when the cache directory cannot be written.
        """
        found = self.lookup(key)
        if found is not None:
            return found
        tmp = self._fresh_tmp(key)
        try:
            started = time.perf_counter()
            result = build(tmp)
            meta = {
                "format": CACHE_FORMAT,
                "key": dict(key),
                "result": result,
                "created_by": {"host": socket.gethostname(), "pid": os.getpid()},
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(time.perf_counter() - started, 3),
                "num_proc": num_proc,
            }
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            return self._publish(tmp, key, meta)
        except Exception as exc:  # noqa: BLE001 - a full or read-only disk is named, anything else re-raised as is
            if not isinstance(exc, PairDPOError) and (disk_full(exc, self.root) or unwritable(exc)):
                raise self.unwritable_error(exc) from exc
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed build leaves no partial entry

    def _fresh_tmp(self, key: Mapping[str, Any]) -> Path:
        final = self.entry_dir(key)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale()
            tmp = self.root / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            tmp.mkdir()
        except OSError as exc:
            raise self.unwritable_error(exc) from exc
        return tmp

    def unwritable_error(self, exc: BaseException) -> ConfigError:
        """``dataset_cache_unwritable`` for ``exc``, a failure to create or write an entry under :attr:`root`: names
        the directory, the cause, the free space of its filesystem and the options that move the cache."""
        cause = "its filesystem is full" if disk_full(exc, self.root) else "it cannot be written"
        return ConfigError(
            "dataset_cache_unwritable",
            f"cannot write the tokenised-pairs cache {self.root}: {cause} ({type(exc).__name__}: {exc}; "
            f"{space_text(self.root)}); no partial entry is left. Free space there, or set dataset_cache_dir "
            "(or HF_DATASETS_CACHE) to a writable directory on a disk with room for the tokenised pairs (about 4 "
            "bytes per token).",
        )

    def _publish(self, tmp: Path, key: Mapping[str, Any], meta: dict[str, Any]) -> CacheEntry:
        final = self.entry_dir(key)
        try:
            os.rename(tmp, final)
            return CacheEntry(final, meta, built_here=True)
        except OSError:
            pass  # another process published it first, or a broken entry is in the way
        existing = self.lookup(key)
        if existing is not None:
            return existing
        broken = self.root / f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        with contextlib.suppress(FileNotFoundError):  # lookup removed it: its file did not match its digest
            os.rename(final, broken)
        os.rename(tmp, final)
        shutil.rmtree(broken, ignore_errors=True)
        return CacheEntry(final, meta, built_here=True)

    def _remove_stale(self) -> None:
        now = time.time()
        for path in self.root.glob(".pairs-*"):
            try:
                if now - path.stat().st_mtime > _STALE_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                continue
