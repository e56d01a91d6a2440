"""The reference identity: computed once per run, written beside every checkpoint, checked on resume.

The identity (``pair_dpo_reference.json``, see :mod:`pair_dpo_trainer.integrity.identity`) holds the verified
snapshot's manifest digest, a digest of the reference's parameters, and a probe digest: the reference log-probs of a
fixed probe batch. On resume a different manifest or parameter digest refuses to start (``reference_changed``); a
different probe digest alone is environment drift (another GPU, driver or kernels) and only logs a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.errors import SnapshotIntegrityError
from pair_dpo_trainer.integrity import (
    IDENTITY_FILENAME,
    ReferenceIdentity,
    assert_same_reference,
    build_identity,
    read_identity,
)
from pair_dpo_trainer.reference.base import Reference
from pair_dpo_trainer.reference.source import ReferenceSource

logger = logging.getLogger(__name__)


def probe_batch(vocab_size: int, sequence_shard: tuple[int, int] | None = None) -> PackedPairBatch:
    """A fixed packed batch of two pairs whose token ids depend only on ``vocab_size`` (deterministic everywhere);
    this rank's slice of it under sequence parallelism (``sequence_shard``, see ``PackedPairCollator``).

    Example:
        ``probe_batch(64).input_ids`` always holds the same 4 sequences of ids in ``[3, 64)``.
    """
    span = max(vocab_size - 3, 1)

    def ids(start: int, length: int, stride: int) -> list[int]:
        return [3 + (start + i * stride) % span for i in range(length)]

    features = [
        {"prompt_input_ids": ids(0, 12, 7), "chosen_input_ids": ids(5, 9, 11), "rejected_input_ids": ids(9, 7, 13)},
        {"prompt_input_ids": ids(2, 5, 17), "chosen_input_ids": ids(1, 14, 3), "rejected_input_ids": ids(4, 10, 5)},
    ]
    return PackedPairCollator(sequence_shard=sequence_shard)(features)


def compute_identity(
    source: ReferenceSource,
    reference: Reference,
    *,
    vocab_size: int,
    device: torch.device | str,
    sequence_shard: tuple[int, int] | None = None,
) -> ReferenceIdentity:
    """Builds the identity of a built reference: provenance, parameter digest and probe digest.

    Args:
        source: Where the reference came from (verified snapshot or unpinned).
        reference: The built reference (its ``identity_parameters`` for the digest, ``probe`` for the probe).
        vocab_size: Vocabulary size of the reference, for the probe batch.
        device: Device the reference runs on.
        sequence_shard: This rank's ``(rank, size)`` in its sequence-parallel group, else None.
    """
    # probe False: a reference that cannot run the probe yet (PEFT under FSDP2)
    probe = probe_batch(vocab_size, sequence_shard).to(device) if reference.probe else None
    probe_logps = reference.sequence_logps(probe) if probe is not None else None
    return build_identity(
        snapshot=source.snapshot,
        revision=source.revision,
        repo_id=source.repo_id,
        named_parameters=reference.identity_parameters(),
        probe_logps=probe_logps,
        device=device,
    )


def check_resume_identity(checkpoint_dir: str | Path, current: ReferenceIdentity) -> None:
    """Refuses a resume whose checkpoint recorded another reference; warns on environment drift.

    Raises:
        SnapshotIntegrityError: ``identity_missing`` when the checkpoint has no identity record,
            ``reference_changed`` when the manifest or parameter digest differs (the message names what differs).
    """
    try:
        recorded = read_identity(checkpoint_dir)
    except FileNotFoundError:
        raise SnapshotIntegrityError(
            "identity_missing",
            f"the checkpoint has no {IDENTITY_FILENAME}, so the reference it was trained against is unknown: resume "
            "from a checkpoint written by PairDPOTrainer, or start a new run.",
            str(checkpoint_dir),
        ) from None
    comparison = assert_same_reference(recorded, current)
    if comparison.reason_code == "environment_drift":
        logger.warning(
            "reference probe log-probs differ from the checkpoint's (environment drift: a different GPU, driver or "
            "kernels, not data corruption): %s",
            comparison.describe(),
        )
