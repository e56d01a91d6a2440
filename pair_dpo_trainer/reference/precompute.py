"""Precomputed reference log-probs (``precompute_ref_log_probs=True``): one reference pass, a cache, then one model.

Before training, the verified reference runs once over the train (and eval) pairs, each rank its share of an
evaluation-style schedule (:func:`~pair_dpo_trainer.samplers.evaluation.plan_eval`: every pair once, the same number
of micro-batches on every rank, weight-0 fillers where a rank runs short, so ZeRO-3 forwards never wait for a rank
that has stopped). The per-pair log-probs are gathered over the CPU group, written to a cache file, and the features
then carry ``ref_chosen_logps`` / ``ref_rejected_logps``; the collator packs them into ``PackedPairBatch.ref_logps``
and :class:`PrecomputedReference` returns them, so the reference model is freed before the first step.

Details: reference/README.md, "Module notes", ``precompute.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from pair_dpo_trainer.atomic import atomic_open
from pair_dpo_trainer.collators.batch import REF_LOGPS_KEYS, PackedPairBatch, pair_rows
from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.config.sections import BatchLimits, DataOptions, ScheduleOptions
from pair_dpo_trainer.data.arrow import arrow_lengths, is_arrow_dataset, scan
from pair_dpo_trainer.data.costs import pair_cost_array
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.losses.length_weights import with_length_desensitization
from pair_dpo_trainer.parallel.agreement import all_gather_cpu, assert_ranks_agree
from pair_dpo_trainer.samplers.evaluation import EvalBatchSampler, WeightedPairs

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
CACHE_PREFIX = "ref_logps-"


class PrecomputedReference:
    """The reference after a precompute pass: the batch's own ``ref_logps`` (no model)."""

    model: torch.nn.Module | None = None
    probe = True

    def identity_parameters(self) -> None:
        """None: no weights (the identity was recorded with the cache entry)."""
        return None

    def release(self) -> None:
        return None

    def sequence_logps(self, batch: PackedPairBatch) -> torch.Tensor:
        """``batch.ref_logps`` ``[2n]`` float32.

        Raises:
            ConfigError: ``ref_logps_missing`` when the batch carries no precomputed log-probs (a dataset that was
                not given to the trainer as ``train_dataset`` / ``eval_dataset``).
        """
        if batch.ref_logps is None:
            raise ConfigError(
                "ref_logps_missing",
                "this batch has no precomputed reference log-probs (precompute_ref_log_probs=True covers only the "
                "trainer's train_dataset and eval_dataset): pass the dataset as eval_dataset when building the "
                "trainer, or set precompute_ref_log_probs=False.",
            )
        return batch.ref_logps


class WithRefLogps:
    """Dataset view: row ``i`` of ``dataset`` plus ``ref_chosen_logps`` / ``ref_rejected_logps`` (python floats).

    Args:
        dataset: Tokenised pairs (``datasets.Dataset`` or a sequence of mappings).
        logps: ``[N, 2]`` float32 (chosen, rejected) per pair, in dataset order.
    """

    def __init__(self, dataset: Any, logps: torch.Tensor) -> None:
        if len(dataset) != logps.shape[0]:
            raise ValueError(f"{logps.shape[0]} precomputed log-prob pairs for a dataset of {len(dataset)} pairs")
        self.dataset = dataset
        self.logps = logps.to(torch.float32).numpy()  # [N, 2]: 8 bytes per pair, not two Python floats

    def __getitem__(self, index: int) -> dict:
        chosen, rejected = self.logps[int(index)].tolist()
        return {**self.dataset[int(index)], REF_LOGPS_KEYS[0]: chosen, REF_LOGPS_KEYS[1]: rejected}

    def __len__(self) -> int:
        return len(self.dataset)


def _column_parts(dataset: Any, column: str) -> tuple[np.ndarray, Iterator[np.ndarray]]:
    """``(lengths int64, flat ids int64 in pieces)`` of one token-id column; a ``datasets.Dataset`` is read in batches
    of its Arrow columns (the ids are never all in memory at once)."""
    if is_arrow_dataset(dataset):
        import pyarrow.compute as pc

        def pieces() -> Iterator[np.ndarray]:
            for table in scan(dataset, [column]):
                yield pc.list_flatten(table[column]).to_numpy(zero_copy_only=False).astype(np.int64)

        return arrow_lengths(dataset, column), pieces()
    rows = [row[column] for row in dataset]
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    return lengths, iter([values])


def dataset_fingerprint(dataset: Any) -> str:
    """SHA-256 of the token-id columns (per column: name, per-row lengths, flat ids as little-endian int64).

    A ``datasets.Dataset`` (e.g. the memory-mapped pairs the trainer tokenised) is hashed batch by batch from its
    Arrow columns; the digest is the same as for the same pairs in a list of dicts.

    Example:
        Two datasets with the same pairs in the same order have the same fingerprint, whatever their container
        (``datasets.Dataset`` or a list of dicts) or extra columns.
    """
    hasher = hashlib.sha256()
    for column in FEATURE_COLUMNS:
        lengths, pieces = _column_parts(dataset, column)
        hasher.update(f"{column}:{lengths.size}:{int(lengths.sum())}\n".encode())
        hasher.update(lengths.astype("<i8").tobytes())
        for values in pieces:
            hasher.update(values.astype("<i8").tobytes())
    return hasher.hexdigest()


def cache_key(
    *, fingerprint: str, reference: Mapping[str, Any], limits: BatchLimits, precision: str, share_prompt: bool = False
) -> dict[str, Any]:
    """Everything the precomputed values depend on (see the module docstring).

    Args:
        fingerprint: :func:`dataset_fingerprint` of the dataset.
        reference: ``{"pinned": bool, "digest": manifest digest (pinned) or parameter digest (unpinned)}``.
        limits: The run's batch limits (``max_length``, ``max_prompt_length``, ``ld_alpha``).
        precision: The reference's compute precision (e.g. ``"float32|no"``).
        share_prompt: The pass packs the shared-prompt layout: the same values up to rounding, not bit for bit, so
            a cache of one layout is not read by the other (``"layout"`` in the key; absent for the unshared one).
    """
    from pair_dpo_trainer.version import __version__

    key = {
        "format": CACHE_FORMAT,
        "dataset": fingerprint,
        "reference": dict(reference),
        "max_length": int(limits.max_length),
        "max_prompt_length": int(limits.max_prompt_length),
        "precision": precision,
        "pair_dpo_trainer": __version__,
    }
    ld_alpha = limits.ld_alpha
    if ld_alpha is not None:  # LD-DPO weights the reference's sums too (only then in the key)
        key["ld_alpha"] = float(ld_alpha)
    if share_prompt:
        key["layout"] = "shared_prompt"
    return key


def cache_path(cache_dir: str | os.PathLike[str], key: Mapping[str, Any]) -> Path:
    """``<cache_dir>/ref_logps-<first 32 hex of sha256(key JSON)>.pt``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()
    return Path(cache_dir) / f"{CACHE_PREFIX}{digest[:32]}.pt"


@dataclass(frozen=True)
class CacheEntry:
    """One dataset's precomputed log-probs.

    Attributes:
        logps: ``[N, 2]`` float32 (chosen, rejected) per pair in dataset order.
        identity: The reference identity record (``ReferenceIdentity.to_dict()``) of the reference that computed it.
    """

    logps: torch.Tensor
    identity: dict[str, Any]


def read_cache(path: Path, key: Mapping[str, Any], num_pairs: int) -> CacheEntry | None:
    """The entry at ``path`` if it exists and was written for exactly ``key``; None otherwise (logged)."""
    if not path.is_file():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        logps = data["logps"]
        valid = data["key"] == dict(key) and tuple(logps.shape) == (num_pairs, 2) and logps.dtype == torch.float32
    except Exception as exc:  # a truncated or foreign file is a cache miss, never a crash
        logger.warning("ignoring unreadable reference log-prob cache %s (%s); recomputing", path, exc)
        return None
    if not valid:
        logger.warning("reference log-prob cache %s does not match this run's key; recomputing", path)
        return None
    return CacheEntry(logps=logps, identity=data["identity"])


def write_cache(path: Path, key: Mapping[str, Any], entry: CacheEntry) -> Path:
    """Atomically writes an entry (temporary file in the same directory, fsync, ``os.replace``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        torch.save({"key": dict(key), "logps": entry.logps, "identity": entry.identity}, f)
    return path


def compute_ref_logps(
    reference: Any,
    dataset: Any,
    *,
    schedule: ScheduleOptions,
    data: DataOptions,
    limits: BatchLimits,
    device: torch.device | str,
    desc: str,
    share_prompt: bool = False,
) -> torch.Tensor:
    """One pass of ``reference`` over ``dataset``, each rank its share; returns ``[N, 2]`` float32 on every rank.

    Every rank runs the same number of micro-batches of ``per_device_eval_batch_size`` pairs, and of at most
    ``max_tokens_per_microbatch`` tokens when that budget is set (checked over the CPU
    group before the first forward, so a rank with another dataset fails fast instead of hanging in ZeRO-3).

    Args:
        reference: A built reference (``sequence_logps``).
        dataset: Tokenised pairs.
        schedule: The run's schedule section (ranks, ``per_device_eval_batch_size``, the token budget).
        data: The run's data section (``dataloader_num_workers``, progress bars).
        limits: The run's batch limits (``ld_alpha``).
        device: This rank's device.
        desc: Name of the dataset for the progress bar and messages.
        share_prompt: Pack the shared-prompt layout (the run's, so the budget holds the same pairs).
    """
    sampler = EvalBatchSampler(
        pair_cost_array(dataset, share_prompt=share_prompt),
        world_size=schedule.world_size,
        rank=schedule.rank,
        pairs_per_microbatch=schedule.eval_pairs_per_microbatch,
        max_tokens_per_microbatch=schedule.max_tokens_per_microbatch,
    )
    assert_ranks_agree(f"{desc} reference pass", f"{len(dataset)}:{len(sampler)}")
    view: Any = WeightedPairs(dataset)  # a map-style dataset (``__getitem__`` / ``__len__``), not a torch Dataset
    loader: DataLoader[dict[str, Any]] = DataLoader(
        view,
        batch_sampler=sampler,
        collate_fn=PackedPairCollator(share_prompt=share_prompt, sequence_shard=schedule.sequence_shard),
        num_workers=data.num_workers,
    )
    indices: list[int] = []
    values: list[torch.Tensor] = []
    bar = _progress(loader, shown=data.progress and schedule.rank == 0, desc=desc)
    for keys, batch in zip(sampler, bar, strict=True):
        batch = with_length_desensitization(batch.to(device), limits.ld_alpha)
        logps = reference.sequence_logps(batch).detach().float()
        kept = [j for j, (_, weight) in enumerate(keys) if weight > 0]
        indices.extend(keys[j][0] for j in kept)
        values.append(pair_rows(logps)[kept])
    if schedule.sequence_shard is not None and schedule.sequence_shard[0] != 0:  # the group's first rank reports
        indices, values = [], []
    mine = (torch.tensor(indices, dtype=torch.int64), torch.cat(values).cpu() if values else torch.zeros(0, 2))
    result = torch.full((len(dataset), 2), float("nan"), dtype=torch.float32)
    seen = torch.zeros(len(dataset), dtype=torch.int64)
    for rank_indices, rank_values in all_gather_cpu(mine):
        result[rank_indices] = rank_values
        seen.index_add_(0, rank_indices, torch.ones_like(rank_indices))
    if not bool((seen == 1).all()):  # an internal invariant of plan_eval, not a user error
        raise RuntimeError(f"the {desc} reference pass did not cover every pair exactly once")
    if not bool(torch.isfinite(result).all()):
        raise RuntimeError(
            f"[non_finite] a precomputed {desc} reference log-prob is NaN/inf: check the reference weights, the "
            "precision (fp16 overflow) and the data."
        )
    return result


def _progress(loader: DataLoader, *, shown: bool, desc: str):
    """A tqdm bar when ``shown`` (the main process, unless ``disable_tqdm``), the plain loader elsewhere."""
    if not shown:
        return loader
    from tqdm.auto import tqdm

    return tqdm(loader, desc=f"reference log-probs ({desc})", unit="batch")
