"""Offline verification of a pinned reference snapshot and the reference identity record.

``verify_snapshot`` proves that a ``hf download --local-dir`` directory is exactly a pinned Hub commit (from
the download metadata and the file bytes, without network access and without loading weights); ``pin_snapshot``
writes such metadata, with a content-derived revision, for a directory saved locally (``pair-dpo pin``); ``identity``
records and compares what the reference model was across checkpoints. Reason codes: ``docs/reason_codes.md``.
"""

from __future__ import annotations

from pair_dpo_trainer.integrity.identity import (
    IDENTITY_FILENAME,
    PROBE_DECIMALS,
    IdentityComparison,
    ReferenceIdentity,
    assert_same_reference,
    build_identity,
    compare_identity,
    parameter_digest,
    probe_digest,
    read_identity,
    write_identity,
)
from pair_dpo_trainer.integrity.layout import is_pinned_revision
from pair_dpo_trainer.integrity.pin import pin_snapshot
from pair_dpo_trainer.integrity.snapshot import (
    VerifiedFile,
    VerifiedSnapshot,
    manifest_digest,
    verify_snapshot,
)

__all__ = [
    "IDENTITY_FILENAME",
    "PROBE_DECIMALS",
    "IdentityComparison",
    "ReferenceIdentity",
    "VerifiedFile",
    "VerifiedSnapshot",
    "assert_same_reference",
    "build_identity",
    "compare_identity",
    "is_pinned_revision",
    "manifest_digest",
    "parameter_digest",
    "pin_snapshot",
    "probe_digest",
    "read_identity",
    "verify_snapshot",
    "write_identity",
]
