"""``pair-dpo verify-snapshot PATH --revision SHA``: verify a local reference snapshot offline.

Exit codes: 0 verified (prints a summary), 1 rejected (prints the reason code and path), 2 usage error.
With ``--json`` one JSON object is printed on stdout:
``{"ok": true, "manifest_digest": ..., "file_count": ..., ...}`` or
``{"ok": false, "reason_code": ..., "path": ..., "message": ...}``. A byte progress bar is shown on stderr
when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from pair_dpo_trainer.errors import SnapshotIntegrityError
from pair_dpo_trainer.integrity.snapshot import VerifiedSnapshot, verify_snapshot


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``verify-snapshot`` arguments to ``parser``."""
    parser.add_argument("path", help="Directory written by `hf download REPO --revision SHA --local-dir DIR`.")
    parser.add_argument(
        "--revision",
        required=True,
        help="The pinned commit: 40 lowercase hex digits (branches/tags refused).",
    )
    parser.add_argument("--json", action="store_true", dest="as_json", help="Print one JSON object on stdout.")
    parser.add_argument(
        "--allow-pickle", action="store_true", help="Accept .bin (pickle) weights when no safetensors exist."
    )
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="Hashing threads (default: one per CPU core)."
    )


class Progress:
    """Lazily created tqdm byte bar on stderr (only when stderr is a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None

    def __call__(self, delta: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="hashing", file=sys.stderr)
        self.bar.update(delta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def snapshot_summary(snapshot: VerifiedSnapshot) -> dict[str, Any]:
    """The ``--json`` object of a verified (or pinned) snapshot."""
    return {
        "ok": True,
        "revision": snapshot.revision,
        "root": str(snapshot.root),
        "manifest_digest": snapshot.manifest_digest,
        "file_count": len(snapshot.files),
        "total_bytes": snapshot.total_bytes,
        "weight_files": list(snapshot.weight_files),
    }


def run(args: argparse.Namespace) -> int:
    """Runs ``verify-snapshot``; returns 0 (verified) or 1 (rejected)."""

    def verify(progress: Progress) -> VerifiedSnapshot:
        return verify_snapshot(
            args.path, args.revision, threads=args.threads, allow_pickle=args.allow_pickle, progress=progress
        )

    def detail(snapshot: VerifiedSnapshot) -> str:
        return f"manifest sha256: {snapshot.manifest_digest}"

    return run_snapshot_command(verify, as_json=args.as_json, done="VERIFIED", refused="REJECTED", detail=detail)


def run_snapshot_command(
    action: Callable[[Progress], VerifiedSnapshot],
    *,
    as_json: bool,
    done: str,
    refused: str,
    detail: Callable[[VerifiedSnapshot], str],
) -> int:
    """Runs ``action`` with a progress bar on a terminal and prints its outcome (``verify-snapshot``, ``pin``).

    Returns:
        0 with ``DONE ROOT @ REVISION``, the file summary and ``detail(snapshot)`` (or the ``--json`` summary); 1 with
        ``REFUSED [reason_code] path: ...`` and the message (or ``{"ok": false, ...}``).
    """
    progress = Progress(enabled=sys.stderr.isatty())
    try:
        snapshot = action(progress)
    except SnapshotIntegrityError as exc:
        progress.close()
        if as_json:
            result = {"ok": False, "reason_code": exc.reason_code, "path": exc.path, "message": exc.message}
            print(json.dumps(result, sort_keys=True))
        else:
            print(f"{refused} [{exc.reason_code}] path: {exc.path or '-'}\n  {exc.message}")
        return 1
    progress.close()
    if as_json:
        print(json.dumps(snapshot_summary(snapshot), sort_keys=True))
    else:
        print(
            f"{done} {snapshot.root} @ {snapshot.revision}\n"
            f"  files: {len(snapshot.files)} ({snapshot.total_bytes} bytes), weights: "
            f"{', '.join(snapshot.weight_files)}\n"
            f"  {detail(snapshot)}"
        )
    return 0
