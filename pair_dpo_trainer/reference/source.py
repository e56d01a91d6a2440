"""Where the reference comes from, proven before any weight is loaded.

Standard DPO is only as good as its reference. With ``ref_model_revision`` set, the reference directory
(``ref_model_name_or_path``, else the policy's directory) is verified offline against that pinned commit by
:func:`pair_dpo_trainer.integrity.verify_snapshot` before the policy or the reference is loaded. Without it the run
refuses to start, unless ``allow_unpinned_reference=True`` (a warning, and ``"pinned": false`` in the identity).

Once per node: the node's local main process hashes the snapshot and shares a proof with the node's other ranks,
which run every other check themselves and hash only what the proof does not prove
(:mod:`pair_dpo_trainer.integrity.proof`); a verification failure stops every rank of the node with its reason code.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from pair_dpo_trainer.config.sections import ReferenceOptions
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.integrity import VerifiedSnapshot
from pair_dpo_trainer.integrity.proof import verify_and_prove, verify_with_proof
from pair_dpo_trainer.modeling.paths import require_model_directory
from pair_dpo_trainer.parallel.node import Node

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReferenceSource:
    """The reference's provenance.

    Attributes:
        directory: Local directory the reference weights are loaded from; None for a copy of the in-memory policy
            or an explicit ``ref_model`` object.
        snapshot: The verified snapshot (None when unpinned).
        revision: The pinned commit (None when unpinned).
        repo_id: Hub repository id, when the user gave one (``ref_model_repo_id``).
        files_hashed: Snapshot files this process hashed itself (the others were proven by its node's local main).
    """

    directory: str | None
    snapshot: VerifiedSnapshot | None
    revision: str | None
    repo_id: str | None
    files_hashed: int = 0

    @property
    def pinned(self) -> bool:
        """True when the reference directory was verified against a full commit hash."""
        return self.snapshot is not None


def resolve_reference_source(
    reference: ReferenceOptions,
    node: Node,
    *,
    policy_dir: str | None,
    policy_name_or_path: str | None,
    ref_model_given: bool,
) -> ReferenceSource | None:
    """Decides, and for a pinned revision verifies, where the reference comes from. None when reference-free.

    Args:
        reference: The run's reference section.
        node: This process's node (its local main verifies the snapshot once for the node).
        policy_dir: Directory the trainer will load the policy from (the ``model`` argument was a path).
        policy_name_or_path: ``model.name_or_path`` of an in-memory policy (a local directory or a hub name).
        ref_model_given: The user passed an explicit ``ref_model`` object.

    Raises:
        ConfigError: ``reference_not_pinned`` (standard DPO without ``ref_model_revision`` and without
            ``allow_unpinned_reference``), ``reference_not_local`` (no local directory to verify, or an unpinned
            ``ref_model_name_or_path`` that is not a model directory),
            ``unsupported_combination`` (a ``ref_model`` object cannot be verified against a revision).
        SnapshotIntegrityError: The directory does not verify (reason codes of ``verify_snapshot``).
    """
    if not reference.uses_reference:  # reference_free=True, or only reference-free objectives
        return None
    if reference.ref_model_revision is None:
        return _unpinned(reference, policy_dir, ref_model_given)
    if ref_model_given:
        raise ConfigError(
            "unsupported_combination",
            "an in-memory ref_model cannot be verified against ref_model_revision: pass its local directory as "
            "ref_model_name_or_path instead of the object, or drop ref_model_revision and set "
            "allow_unpinned_reference=True.",
        )
    directory = reference.ref_model_name_or_path or policy_dir or policy_name_or_path
    if directory is None or not os.path.isdir(directory):
        raise ConfigError(
            "reference_not_local",
            f"ref_model_revision is set but the reference {directory!r} is not a local directory: download it "
            "with `hf download REPO --revision <40-hex sha> --local-dir DIR` and set ref_model_name_or_path=DIR.",
        )
    snapshot, hashed = _verify_once_per_node(reference, node, directory, reference.ref_model_revision)
    logger.info(
        "reference snapshot %s verified at %s (%d files, %d hashed by this process)",
        directory,
        snapshot.revision,
        len(snapshot.files),
        hashed,
    )
    return ReferenceSource(directory, snapshot, snapshot.revision, reference.ref_model_repo_id, files_hashed=hashed)


def _verify_once_per_node(
    reference: ReferenceOptions, node: Node, directory: str, revision: str
) -> tuple[VerifiedSnapshot, int]:
    """The node's local main verifies and proves; the other ranks check with its proof (module docstring)."""
    options: dict[str, Any] = {"threads": reference.verify_threads, "allow_pickle": reference.allow_pickle_weights}
    shared = node.once(lambda: verify_and_prove(directory, revision, progress=_progress_bar(directory), **options))
    snapshot, proof = shared.value
    if shared.here:
        return snapshot, len(snapshot.files)
    return verify_with_proof(directory, revision, proof, **options)


def _unpinned(reference: ReferenceOptions, policy_dir: str | None, ref_model_given: bool) -> ReferenceSource:
    if not reference.allow_unpinned_reference:
        raise ConfigError(
            "reference_not_pinned",
            "standard DPO needs a pinned reference: set ref_model_revision to the 40-hex commit of the reference "
            "directory (`hf download REPO --revision <sha> --local-dir DIR` writes the metadata it is verified "
            "against; for a directory you saved yourself, e.g. after SFT, run `pair-dpo pin DIR` and pass the "
            "revision it prints), or set allow_unpinned_reference=True to accept an unverified reference.",
        )
    logger.warning(
        "allow_unpinned_reference=True: the reference is not verified against a pinned revision; its identity is "
        "recorded with pinned=false."
    )
    directory = None if ref_model_given else (reference.ref_model_name_or_path or policy_dir)
    if directory is not None and reference.ref_model_name_or_path:
        require_model_directory(
            directory, role="reference", option="ref_model_name_or_path", code="reference_not_local"
        )
    return ReferenceSource(directory, None, None, reference.ref_model_repo_id)


def _progress_bar(directory: str):
    """A tqdm byte bar on a terminal, else None (no callback)."""
    if not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    bar = tqdm(total=0, unit="B", unit_scale=True, desc=f"verifying {os.path.basename(directory)}", leave=False)

    def update(delta: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(delta)

    return update
