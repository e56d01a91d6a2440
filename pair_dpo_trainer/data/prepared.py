"""A ``pair-dpo prepare-data`` directory as the trainer gets it: the rows of one split and the manifest they came with.

The token ids of a prepared directory are only valid for the tokenizer and the length limits it was prepared with, so
:func:`load_prepared` returns a :class:`PreparedSplit` (a sequence of rows that carries its manifest) and the trainer
checks it once, before any row is used (:meth:`PreparedSplit.check`, called by
:func:`~pair_dpo_trainer.data.dataset.as_pair_dataset`):

Details: data/README.md, "Module notes", ``prepared.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from pair_dpo_trainer.atomic import read_regular
from pair_dpo_trainer.data.arrow import open_arrow
from pair_dpo_trainer.data.fingerprint import tokenizer_fingerprint
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.integrity.hashing import CHUNKED_FORMAT, digest_per_record, is_digest_record
from pair_dpo_trainer.integrity.proof import FileStamp, settled_stamp

_REDO = "re-run `pair-dpo prepare-data` into a fresh --output directory"

MANIFEST_FORMAT = "pair_dpo_trainer.prepare-data/5"
MANIFEST_MAX_BYTES = 64 * 2**20
"""A ``manifest.json`` larger than this is refused unread (``bad_manifest``)."""
"""The manifest format this package writes and reads (2: records the tokenizer fingerprint; 3: Arrow splits; 4: how
plain strings were rendered, ``apply_chat_template_to_strings`` and ``renderings``; 5: the chunked digest of each
Arrow split, ``outputs[<split>.arrow].digest``, checked before the split is trained on)."""

SPLITS: tuple[str, ...] = ("train", "eval")

PREPARED_SCHEMA = pa.schema(
    [
        ("prompt_input_ids", pa.list_(pa.int32())),
        ("chosen_input_ids", pa.list_(pa.int32())),
        ("rejected_input_ids", pa.list_(pa.int32())),
        ("prompt_hash", pa.string()),
        ("source", pa.string()),
        ("source_row", pa.int64()),
        ("pair", pa.string()),
    ]
)
"""Columns of ``<split>.arrow``: ``pair`` is the JSON of the normalised row (``PreferencePair.as_row()``)."""


@dataclass(frozen=True)
class VerifiedSplit:
    """A split's Arrow file whose bytes matched its manifest's digest: what the node's other ranks check instead of
    hashing the same file again (the pattern of ``integrity.proof``).

    Attributes:
        path: The Arrow file.
        digest: Its digest (the manifest's).
        stamp: Its stamp when hashed (``integrity.proof.settled_stamp``); None when it changed while or just before it
            was hashed: then every rank hashes it.
    """

    path: str
    digest: str
    stamp: FileStamp | None


@dataclass(frozen=True, eq=False)
class PreparedSplit(Sequence):
    """The rows of one split of a prepared directory, with the directory's manifest.

    Behaves as the list of its rows (``len``, indexing, iteration: each row as ``<split>.jsonl`` holds it, messages,
    ``*_input_ids``, ``prompt_hash``, ``source``, ``source_row``); pass it as ``train_dataset`` / ``eval_dataset``.

    Attributes:
        directory: The prepared directory.
        split: ``"train"`` or ``"eval"``.
        manifest: The parsed ``manifest.json``.
        rows: ``<split>.arrow`` as a memory-mapped ``datasets.Dataset`` (:data:`PREPARED_SCHEMA`).
    """

    directory: str
    split: str
    manifest: Mapping[str, Any]
    rows: Any

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = dict(self.rows[int(index)])
        return {**json.loads(row.pop("pair")), **row}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    @property
    def renderings(self) -> dict[str, int]:
        """Accepted rows of the preparation per rendering (``data.tokenize.RENDERINGS``, all splits together)."""
        return dict(self.manifest.get("renderings", {}))

    @property
    def limits(self) -> tuple[int, int]:
        """``(max_length, max_prompt_length)`` the split was prepared with."""
        return int(self.manifest["max_length"]), int(self.manifest["max_prompt_length"])

    def prepared_with(self, *, max_length: int, max_prompt_length: int) -> bool:
        """True when these are the limits the split was prepared with (its rows then need no truncation)."""
        return (self.manifest["max_length"], self.manifest["max_prompt_length"]) == (max_length, max_prompt_length)

    def check(
        self, tokenizer: Any, *, max_length: int, max_prompt_length: int, apply_chat_template_to_strings: bool = False
    ) -> None:
        """Refuses a run that would misread these rows (module docstring); returns when the rows fit the run.

        Raises:
            ConfigError: ``tokenizer_mismatch``, ``rendering_mismatch`` or ``limits_looser_than_prepared``.
        """
        recorded = self.manifest["tokenizer"]["fingerprint"]
        actual = tokenizer_fingerprint(tokenizer)
        if actual != recorded:
            raise ConfigError(
                "tokenizer_mismatch",
                f"{self.directory} was prepared with tokenizer {self.manifest['tokenizer'].get('name')!r} (fingerprint "
                f"{recorded[:12]}...), but this run's tokenizer has fingerprint {actual[:12]}...: its token ids would "
                "mean other text to this model. Run with the tokenizer it was prepared with, or re-run `pair-dpo "
                "prepare-data ... --tokenizer <this model's directory>`.",
            )
        self._check_rendering(apply_chat_template_to_strings)
        looser = _looser_limits(self.manifest, max_length, max_prompt_length)
        if looser:
            prepared_length, prepared_prompt = self.manifest["max_length"], self.manifest["max_prompt_length"]
            raise ConfigError(
                "limits_looser_than_prepared",
                f"{self.directory} was prepared with --max-length {prepared_length} --max-prompt-length "
                f"{prepared_prompt}, and this run asks for more ({'; '.join(looser)}): its rows were already cut "
                "shorter than the run would cut them. Re-run `pair-dpo prepare-data ... --max-length "
                f"{max_length} --max-prompt-length {max_prompt_length}`, or set max_length <= {prepared_length}, "
                f"max_prompt_length <= {prepared_prompt} and max_length - max_prompt_length <= "
                f"{prepared_length - prepared_prompt}.",
            )

    def verify(self, proof: VerifiedSplit | None = None) -> VerifiedSplit:
        """Checks the bytes of ``<split>.arrow`` against the digest its manifest records, hashed on every core.

        Args:
            proof: What another process of this node found (``verify()`` there): when it names this file, with this
                digest, and the file's stamp is still the proven one, the file is not hashed again.

        Returns:
            The proof for the node's other ranks.

        Raises:
            ConfigError: ``bad_manifest`` when the bytes do not match (the file was edited or corrupted after
                ``prepare-data`` wrote it) or cannot be read.
        """
        path = Path(self.directory) / f"{self.split}.arrow"
        record = self.manifest["outputs"][path.name]["digest"]
        if proof is not None and proof.stamp is not None and proof.path == str(path):
            if proof.digest == record["digest"] and FileStamp.of(path) == proof.stamp:
                return proof
        before = FileStamp.of(path)
        try:
            actual, size = digest_per_record(path, record)
        except OSError as exc:
            raise ConfigError("bad_manifest", f"{path} cannot be read ({exc}); {_REDO}.") from exc
        if actual != record["digest"]:
            raise ConfigError(
                "bad_manifest",
                f"{path}: the bytes of {path.name} do not match the digest its manifest.json records (expected "
                f"{record['digest'][:16]}..., actual {actual[:16]}...): the file changed after `pair-dpo prepare-data` "
                "wrote it (edited, or corrupted on disk), and is not trained on. Run pair-dpo prepare-data again, into "
                "a fresh --output directory.",
            )
        return VerifiedSplit(str(path), actual, settled_stamp(path, before, size))

    def _check_rendering(self, apply_chat_template_to_strings: bool) -> None:
        """``rendering_mismatch`` when the split holds plain-string rows rendered otherwise than the run asks."""
        prepared = bool(self.manifest.get("apply_chat_template_to_strings", False))
        strings = self.renderings.get("strings_raw", 0) + self.renderings.get("strings_templated", 0)
        if strings and prepared != apply_chat_template_to_strings:
            way = {True: "with the chat template", False: "as raw text"}
            raise ConfigError(
                "rendering_mismatch",
                f"{self.directory} holds {strings} plain-string rows tokenised {way[prepared]}, but this run renders "
                f"plain strings {way[apply_chat_template_to_strings]} (apply_chat_template_to_strings="
                f"{apply_chat_template_to_strings}): set apply_chat_template_to_strings={prepared}, or re-run "
                f"`pair-dpo prepare-data` {'with' if apply_chat_template_to_strings else 'without'} "
                "--apply-chat-template-to-strings.",
            )


def _looser_limits(manifest: Mapping[str, Any], max_length: int, max_prompt_length: int) -> list[str]:
    prepared_length, prepared_prompt = manifest["max_length"], manifest["max_prompt_length"]
    looser = []
    if max_length > prepared_length:
        looser.append(f"max_length={max_length} > {prepared_length}")
    if max_prompt_length > prepared_prompt:
        looser.append(f"max_prompt_length={max_prompt_length} > {prepared_prompt}")
    if max_length - max_prompt_length > prepared_length - prepared_prompt:
        looser.append(
            f"completion room max_length - max_prompt_length = {max_length - max_prompt_length} > "
            f"{prepared_length - prepared_prompt}"
        )
    return looser


def load_prepared(directory: str | Path, split: str) -> PreparedSplit:
    """Reads one split of a ``prepare-data`` directory with its manifest.

    Args:
        directory: The ``--output`` directory of ``pair-dpo prepare-data``.
        split: ``"train"`` or ``"eval"``.

    Raises:
        ConfigError: ``bad_manifest`` when ``manifest.json`` is missing, unreadable, of another format (e.g. written
            by an older version, without the tokenizer fingerprint) or lacks a field the checks need. The bytes of the
            split are checked against the manifest's digest by :meth:`PreparedSplit.verify`, which the trainer calls
            (once per node) before it reads a row.

    Example:
        >>> train = load_prepared("prepared/", "train")  # doctest: +SKIP
        >>> PairDPOTrainer(model, args, train_dataset=train, ...)  # doctest: +SKIP
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {SPLITS}")
    root = Path(directory)
    manifest = read_manifest(root)
    name = f"{split}.arrow"
    try:
        rows = open_arrow(root / name)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ConfigError("bad_manifest", f"{root / name} cannot be read ({exc}); {_REDO}.") from exc
    recorded = manifest["outputs"][name]["rows"]
    if len(rows) != recorded:
        raise ConfigError("bad_manifest", f"{root / name} holds {len(rows)} rows, its manifest {recorded}; {_REDO}.")
    return PreparedSplit(directory=str(directory), split=split, manifest=manifest, rows=rows)


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """Returns the parsed ``manifest.json`` of a prepared directory, checked for what the trainer needs.

    Raises:
        ConfigError: ``bad_manifest`` (see :func:`load_prepared`).
    """
    path = Path(directory) / "manifest.json"
    try:
        manifest = json.loads(read_regular(path, limit=MANIFEST_MAX_BYTES))
    except FileNotFoundError as exc:
        raise ConfigError(
            "bad_manifest",
            f"{directory} is a directory without manifest.json, so not a `pair-dpo prepare-data` output: pass a "
            f"jsonl / json / parquet file, or {_REDO}.",
        ) from exc
    except (OSError, ValueError) as exc:  # a FIFO or an oversized file included
        raise ConfigError("bad_manifest", f"{path} cannot be read as JSON ({exc}); {_REDO}.") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ConfigError(
            "bad_manifest",
            f"{path} has format {found!r}, not {MANIFEST_FORMAT!r} (older versions recorded no tokenizer "
            f"fingerprint, so the rows cannot be checked against this run's tokenizer, wrote no Arrow splits, or "
            f"rendered plain strings with the chat template without recording it); {_REDO}.",
        )
    tokenizer = manifest.get("tokenizer")
    outputs = manifest.get("outputs")
    fields_ok = (
        isinstance(tokenizer, dict)
        and isinstance(tokenizer.get("fingerprint"), str)
        and all(isinstance(manifest.get(key), int) for key in ("max_length", "max_prompt_length"))
        and isinstance(manifest.get("renderings"), dict)
        and isinstance(outputs, dict)
        and all(_output_ok(outputs.get(f"{split}.arrow")) for split in SPLITS)
    )
    if not fields_ok:
        raise ConfigError(
            "bad_manifest",
            f"{path} lacks tokenizer.fingerprint, max_length, max_prompt_length, renderings or the Arrow outputs "
            f"(their rows and {CHUNKED_FORMAT} digests); {_REDO}.",
        )
    return manifest


def _output_ok(output: Any) -> bool:
    """An ``outputs`` entry of an Arrow split: its ``rows`` and its chunked ``digest`` record."""
    return isinstance(output, dict) and isinstance(output.get("rows"), int) and is_digest_record(output.get("digest"))
