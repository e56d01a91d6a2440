"""The reference model's identity record, written next to each checkpoint and compared on resume.

``pair_dpo_reference.json`` (sorted keys, indent 2, written atomically) holds:

Details: integrity/README.md, "Module notes", ``identity.py``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pair_dpo_trainer.atomic import atomic_open, open_regular
from pair_dpo_trainer.errors import SnapshotIntegrityError

if TYPE_CHECKING:
    import torch

    from pair_dpo_trainer.integrity.snapshot import VerifiedSnapshot

IDENTITY_FILENAME = "pair_dpo_reference.json"
IDENTITY_FORMAT = 1
PROBE_DECIMALS = 3
"""Probe log-probs are formatted with this many decimal places (0.001 nats) before hashing."""

VERSIONED_PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "pair_dpo_trainer")


@dataclass(frozen=True, kw_only=True)
class ReferenceIdentity:
    """What the reference model was, as recorded next to a checkpoint.

    Attributes:
        repo_id: Hub repository id, if known.
        revision: Commit (or whatever revision string the caller used when unpinned).
        pinned: True when the snapshot was verified against a full 40-hex commit.
        manifest_digest: ``VerifiedSnapshot.manifest_digest`` (``None`` when unpinned).
        files: Repository path -> verified digest.
        param_digest: ``parameter_digest`` of the reference parameters, if computed.
        probe_digest: ``probe_digest`` of the probe batch log-probs, if computed.
        versions: Library versions (package -> version).
        device: Device name the probe ran on.
        synced_step: Step of the last TR-DPO sync, or None (the reference is the snapshot itself).
    """

    repo_id: str | None = None
    revision: str | None
    pinned: bool
    manifest_digest: str | None
    files: dict[str, str] = field(default_factory=dict)
    param_digest: str | None = None
    probe_digest: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    device: str | None = None
    synced_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-ready record (with ``format``)."""
        return {"format": IDENTITY_FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReferenceIdentity:
        """Builds a record from ``to_dict`` output.

        Raises:
            SnapshotIntegrityError: ``identity_malformed`` for an unknown format or missing/odd fields.
        """
        if not isinstance(data, Mapping) or data.get("format") != IDENTITY_FORMAT:
            raise SnapshotIntegrityError(
                "identity_malformed", f"not a format-{IDENTITY_FORMAT} reference identity", IDENTITY_FILENAME
            )
        names = {f.name for f in fields(cls)}
        try:
            identity = cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise SnapshotIntegrityError("identity_malformed", str(exc), IDENTITY_FILENAME) from None
        if not isinstance(identity.files, dict) or not isinstance(identity.versions, dict):
            raise SnapshotIntegrityError(
                "identity_malformed", "'files' and 'versions' must be objects", IDENTITY_FILENAME
            )
        return identity


def parameter_digest(named_tensors: Iterable[tuple[str, torch.Tensor | Callable[[], torch.Tensor]]]) -> str:
    """SHA-256 over parameters in sorted-name order: name, dtype, shape and raw bytes.

    Each parameter contributes the UTF-8 line ``json.dumps([name, dtype, shape, nbytes]) + "\\n"`` (dtype
    without the ``torch.`` prefix) followed by its raw bytes in C order, native (little-endian) byte order.
    Tensors are processed one at a time (a non-CPU tensor is copied to CPU on its own), so memory is bounded
    by the largest parameter.

    Args:
        named_tensors: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()``. A value may also be a
            zero-argument callable returning the tensor: it is called once, in sorted-name order, when that
            parameter is hashed (a ZeRO-3 reference gathers one partitioned parameter at a time this way, the
            same order on every rank).

    Returns:
        Lowercase hex SHA-256.

    Raises:
        ValueError: Duplicate names, or a tensor on the meta device (not materialised, e.g. a ZeRO-3 shard).
    """
    import torch

    tensors: dict[str, torch.Tensor | Callable[[], torch.Tensor]] = {}
    for name, tensor in named_tensors:
        if name in tensors:
            raise ValueError(f"duplicate parameter name {name!r}")
        tensors[name] = tensor
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors.pop(name)
        t = (value if isinstance(value, torch.Tensor) else value()).detach()
        if t.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device (gather it before hashing)")
        t = t.to("cpu").resolve_conj().resolve_neg().contiguous()
        header = [name, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()]
        hasher.update((json.dumps(header) + "\n").encode("utf-8"))
        if t.numel():
            hasher.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def probe_digest(logps: torch.Tensor, *, decimals: int = PROBE_DECIMALS) -> str:
    """SHA-256 of a probe batch's log-probs rounded to ``decimals`` decimal places.

    Values are converted to float64 and formatted with ``format(v, f".{decimals}f")`` (``-0.000`` becomes
    ``0.000``); the digest covers the shape, ``decimals`` and the formatted values. Rounding absorbs most
    last-bit noise, but a value near a rounding boundary can still flip: a mismatch means environment drift.

    Args:
        logps: Log-probs tensor of any shape (e.g. ``[2n]`` per-sequence log-probs).
        decimals: Decimal places kept.

    Returns:
        Lowercase hex SHA-256.
    """
    values = logps.detach().to("cpu").double().reshape(-1).tolist()
    zero = format(0.0, f".{decimals}f")
    texts = [format(v, f".{decimals}f") for v in values]
    texts = [zero if t == "-" + zero else t for t in texts]
    payload = json.dumps({"decimals": decimals, "shape": list(logps.shape), "values": texts})
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def collect_versions() -> dict[str, str]:
    """Versions of torch, transformers, accelerate, deepspeed (if installed), pair_dpo_trainer and python."""
    from pair_dpo_trainer.version import __version__

    versions = {"python": platform.python_version(), "pair_dpo_trainer": __version__}
    for package in VERSIONED_PACKAGES:
        if package in versions or importlib.util.find_spec(package) is None:
            continue
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def device_name(device: str | torch.device | None = None) -> str:
    """Human-readable device name: the CUDA device name, else ``cpu (<machine>)``.

    Args:
        device: Device to describe; ``None`` picks the current CUDA device when available, else the CPU.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and torch.cuda.is_available():
        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type == "cuda":
            return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.machine() or 'unknown'})"


def build_identity(
    *,
    snapshot: VerifiedSnapshot | None = None,
    revision: str | None = None,
    repo_id: str | None = None,
    named_parameters: Iterable[tuple[str, torch.Tensor | Callable[[], torch.Tensor]]] | None = None,
    probe_logps: torch.Tensor | None = None,
    device: str | torch.device | None = None,
) -> ReferenceIdentity:
    """Builds the identity record of a reference model.

    Args:
        snapshot: The verified snapshot (sets ``revision``, ``pinned=True``, manifest and files).
        revision: Revision string when there is no verified snapshot (``pinned`` is then false).
        repo_id: Hub repository id, if known.
        named_parameters: Reference parameters to digest, if wanted.
        probe_logps: Reference log-probs of the fixed probe batch, if computed.
        device: Device the probe ran on.
    """
    return ReferenceIdentity(
        repo_id=repo_id,
        revision=snapshot.revision if snapshot is not None else revision,
        pinned=snapshot is not None,
        manifest_digest=snapshot.manifest_digest if snapshot is not None else None,
        files=snapshot.digests if snapshot is not None else {},
        param_digest=parameter_digest(named_parameters) if named_parameters is not None else None,
        probe_digest=probe_digest(probe_logps) if probe_logps is not None else None,
        versions=collect_versions(),
        device=device_name(device),
    )


def write_identity(checkpoint_dir: str | os.PathLike[str], identity: ReferenceIdentity) -> Path:
    """Atomically writes ``pair_dpo_reference.json`` (temporary file in the same directory + ``os.replace``).

    Args:
        checkpoint_dir: Existing checkpoint directory.
        identity: The record.

    Returns:
        Path of the written file.
    """
    directory = Path(checkpoint_dir)
    target = directory / IDENTITY_FILENAME
    text = json.dumps(identity.to_dict(), sort_keys=True, indent=2) + "\n"
    with atomic_open(target) as f:
        f.write(text)
    return target


def read_identity(checkpoint_dir: str | os.PathLike[str]) -> ReferenceIdentity:
    """Reads ``pair_dpo_reference.json`` from a checkpoint directory.

    Raises:
        FileNotFoundError: The checkpoint has no identity record.
        SnapshotIntegrityError: ``identity_malformed``.
    """
    target = Path(checkpoint_dir) / IDENTITY_FILENAME
    with open_regular(target) as f:  # a FIFO in its place is refused, never waited on
        text = f.read().decode("utf-8")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SnapshotIntegrityError("identity_malformed", f"not valid JSON: {exc}", IDENTITY_FILENAME) from None
    return ReferenceIdentity.from_dict(data)


@dataclass(frozen=True)
class IdentityComparison:
    """Which parts of two identity records differ.

    The manifest is always compared (a verified and an unverified reference differ); parameter and probe
    digests are compared only when both records carry them (``not_compared`` lists the others).

    Attributes:
        manifest_differs: Manifest digests differ.
        params_differs: Parameter digests differ.
        probe_differs: Probe digests differ.
        changed_files: Paths added, removed or with another digest.
        not_compared: Digests absent from one side (``"params"``, ``"probe"``).
        version_changes: Package -> ``(expected, actual)`` for differing versions (and ``"device"``).
        synced_steps: ``(expected, actual)`` TR-DPO sync steps when they differ, else None.
    """

    manifest_differs: bool
    params_differs: bool
    probe_differs: bool
    changed_files: tuple[str, ...] = ()
    not_compared: tuple[str, ...] = ()
    version_changes: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    synced_steps: tuple[int | None, int | None] | None = None

    @property
    def reference_changed(self) -> bool:
        """True when the manifest, the parameters or the TR-DPO sync state differ (fatal)."""
        return self.manifest_differs or self.params_differs or self.synced_steps is not None

    @property
    def reason_code(self) -> str | None:
        """``"reference_changed"``, ``"environment_drift"`` (probe only) or ``None`` (identical)."""
        if self.reference_changed:
            return "reference_changed"
        return "environment_drift" if self.probe_differs else None

    def describe(self) -> str:
        """One-line human summary naming what differs."""
        parts = []
        if self.manifest_differs:
            shown = ", ".join(self.changed_files[:5]) + (", ..." if len(self.changed_files) > 5 else "")
            parts.append(f"manifest digest differs (files: {shown or 'none listed'})")
        if self.synced_steps is not None:
            recorded, current = self.synced_steps
            parts.append(
                f"TR-DPO synced reference: recorded at step {recorded}, current {current} (a checkpoint of a "
                "sync_ref_model=True run resumes only with sync_ref_model=True and its synced weights)"
            )
        if self.params_differs:
            parts.append("parameter digest differs")
        if self.probe_differs and self.reference_changed:  # the changed reference explains it: no environment excuse
            parts.append("probe log-prob digest differs too (the reference computes other log-probs)")
        elif self.probe_differs:
            drift = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in sorted(self.version_changes.items()))
            parts.append(
                "probe log-prob digest differs (different GPU, driver or kernels, not corruption"
                + (f"; {drift}" if drift else "")
                + ")"
            )
        return "; ".join(parts) or "identical reference"


def compare_identity(expected: ReferenceIdentity, actual: ReferenceIdentity) -> IdentityComparison:
    """Compares the recorded identity (``expected``) with the current one (``actual``)."""
    changed = sorted(p for p in set(expected.files) | set(actual.files) if expected.files.get(p) != actual.files.get(p))
    not_compared = []
    differs = {}
    for key, attr in (("params", "param_digest"), ("probe", "probe_digest")):
        a, b = getattr(expected, attr), getattr(actual, attr)
        if a is None or b is None:
            not_compared += [key] if (a is None) != (b is None) else []
            differs[key] = False
        else:
            differs[key] = a != b
    keys = set(expected.versions) | set(actual.versions)
    versions = {
        k: (expected.versions.get(k), actual.versions.get(k))
        for k in keys
        if expected.versions.get(k) != actual.versions.get(k)
    }
    if expected.device != actual.device:
        versions["device"] = (expected.device, actual.device)
    return IdentityComparison(
        manifest_differs=expected.manifest_digest != actual.manifest_digest,
        params_differs=differs["params"],
        probe_differs=differs["probe"],
        changed_files=tuple(changed),
        not_compared=tuple(not_compared),
        version_changes=versions,
        synced_steps=None if expected.synced_step == actual.synced_step else (expected.synced_step, actual.synced_step),
    )


def assert_same_reference(expected: ReferenceIdentity, actual: ReferenceIdentity) -> IdentityComparison:
    """Raises if the reference changed; returns the comparison otherwise.

    Returns:
        The comparison; its ``reason_code`` is ``"environment_drift"`` when only the probe digest differs (the
        caller logs a warning: different GPU, driver or kernels, not corruption) and ``None`` when identical.

    Raises:
        SnapshotIntegrityError: ``reference_changed`` when the manifest or parameter digest differs; the
            message names what differs.
    """
    comparison = compare_identity(expected, actual)
    if comparison.reference_changed:
        first = comparison.changed_files[0] if comparison.changed_files else None
        raise SnapshotIntegrityError("reference_changed", comparison.describe(), first)
    return comparison
