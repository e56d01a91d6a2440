"""Completeness of a model snapshot: ``config.json`` and one complete set of weights.

Accepted weights, in the order ``transformers`` prefers them:

1. safetensors: ``model.safetensors`` and/or ``model.safetensors.index.json``;
2. pickle (only with ``allow_pickle=True``): ``pytorch_model.bin`` and/or ``pytorch_model.bin.index.json``.

The first format with any file present is the one checked. Every index present for it must have a non-empty
``weight_map`` whose values are safe relative paths with the format's suffix, each a file of the verified set.
Nothing here loads weights: the index is plain JSON.
"""

from __future__ import annotations

import json
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path

from pair_dpo_trainer.atomic import open_regular
from pair_dpo_trainer.errors import SnapshotIntegrityError
from pair_dpo_trainer.integrity.layout import check_repo_path

CONFIG_NAME = "config.json"
INDEX_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class WeightFormat:
    """One on-disk weight format.

    Attributes:
        name: ``"safetensors"`` or ``"pickle"``.
        single: Name of the single-file checkpoint.
        index: Name of the sharded checkpoint's index.
        suffix: Suffix every shard must have.
        pickle: True when loading it would unpickle data.
    """

    name: str
    single: str
    index: str
    suffix: str
    pickle: bool


WEIGHT_FORMATS = (
    WeightFormat("safetensors", "model.safetensors", "model.safetensors.index.json", ".safetensors", False),
    WeightFormat("pickle", "pytorch_model.bin", "pytorch_model.bin.index.json", ".bin", True),
)


def _load_weight_map(root: Path, index: str) -> dict[str, object]:
    """Reads ``index`` and returns its ``weight_map`` (raises ``malformed_index`` / ``empty_weight_map``)."""
    try:
        with open_regular(root / index) as f:
            raw = f.read(INDEX_MAX_BYTES + 1)
    except OSError as exc:
        raise SnapshotIntegrityError("unreadable_file", f"cannot read the weight index: {exc}", index) from exc
    if len(raw) > INDEX_MAX_BYTES:
        raise SnapshotIntegrityError("malformed_index", f"larger than {INDEX_MAX_BYTES} bytes", index)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise SnapshotIntegrityError("malformed_index", f"not valid JSON: {exc}", index) from None
    if not isinstance(data, dict):
        raise SnapshotIntegrityError("malformed_index", "the index is not a JSON object", index)
    weight_map = data.get("weight_map")
    if weight_map is None or weight_map == {}:
        raise SnapshotIntegrityError("empty_weight_map", "the index has no or an empty 'weight_map'", index)
    if not isinstance(weight_map, dict):
        raise SnapshotIntegrityError("malformed_index", "'weight_map' is not a JSON object", index)
    return weight_map


def index_shards(root: Path, fmt: WeightFormat, present: Set[str]) -> tuple[str, ...]:
    """Validates the index of ``fmt`` and returns its shard names, sorted and de-duplicated.

    Args:
        root: The resolved snapshot root.
        fmt: The weight format whose index is present.
        present: Repository paths that exist and have metadata (they will all be hashed).

    Returns:
        The shard repository paths.

    Raises:
        SnapshotIntegrityError: ``malformed_index``, ``empty_weight_map``, ``unsafe_path``, ``bad_suffix`` or
            ``missing_shard`` (path: the index or the offending shard name).
    """
    weight_map = _load_weight_map(root, fmt.index)
    values = [v for v in weight_map.values() if isinstance(v, str)]
    if len(values) != len(weight_map):
        raise SnapshotIntegrityError("malformed_index", "a 'weight_map' value is not a string", fmt.index)
    shards = sorted(set(values))
    for shard in shards:
        check_repo_path(shard, what=f"{fmt.index} weight_map")
    for shard in shards:
        if not shard.endswith(fmt.suffix):
            raise SnapshotIntegrityError(
                "bad_suffix", f"{fmt.index} names a shard without the {fmt.suffix!r} suffix", shard
            )
    for shard in shards:
        if shard not in present:
            raise SnapshotIntegrityError(
                "missing_shard", f"{fmt.index} names a shard that is not in the verified snapshot", shard
            )
    return tuple(shards)


def check_completeness(root: Path, present: Set[str], *, allow_pickle: bool) -> tuple[str, ...]:
    """Checks that the snapshot holds a config and one complete set of weights.

    Args:
        root: The resolved snapshot root.
        present: Repository paths that exist and have metadata.
        allow_pickle: Accept ``.bin`` (pickle) weights when no safetensors weights exist.

    Returns:
        The weight files a loader would read (single file and/or shards), sorted.

    Raises:
        SnapshotIntegrityError: ``missing_config``, ``no_weights``, ``pickle_weights`` or an index failure.
    """
    if CONFIG_NAME not in present:
        raise SnapshotIntegrityError("missing_config", "the snapshot has no config.json", CONFIG_NAME)
    for fmt in WEIGHT_FORMATS:
        has_single, has_index = fmt.single in present, fmt.index in present
        if not (has_single or has_index):
            continue
        if fmt.pickle and not allow_pickle:
            raise SnapshotIntegrityError(
                "pickle_weights",
                "only pickle (.bin) weights are present; convert them to safetensors or pass "
                "allow_pickle=True (--allow-pickle)",
                fmt.index if has_index else fmt.single,
            )
        weights = set(index_shards(root, fmt, present)) if has_index else set()
        if has_single:
            weights.add(fmt.single)
        return tuple(sorted(weights))
    names = ", ".join(name for fmt in WEIGHT_FORMATS for name in (fmt.single, fmt.index))
    raise SnapshotIntegrityError("no_weights", f"the snapshot has none of {names}")
