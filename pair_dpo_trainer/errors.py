"""Error types shared by the whole package.

Every error a user can trigger carries a stable ``reason_code``: a short snake_case
string set where the error is raised (never parsed from the message). The codes are
documented in ``docs/reason_codes.md``; tests assert them.
"""

from __future__ import annotations


class PairDPOError(Exception):
    """Base class: an error with a stable machine-readable ``reason_code``.

    Args:
        reason_code: Stable identifier of the failure, e.g. ``"prefix_mismatch"``.
        message: Human-readable explanation that names the option or input to fix.
    """

    def __init__(self, reason_code: str, message: str) -> None:
        super().__init__(f"[{reason_code}] {message}")
        self.reason_code = reason_code
        self.message = message


class PreferenceRowError(PairDPOError, ValueError):
    """A dataset row that cannot become a valid preference pair."""


class ConfigError(PairDPOError, ValueError):
    """An invalid configuration value or an unsupported combination of options."""


class ScheduleError(PairDPOError):
    """The pair schedule cannot be planned, or ranks disagree about it."""


class SnapshotIntegrityError(PairDPOError):
    """A reference snapshot that does not verify against its pinned revision.

    Args:
        reason_code: Stable identifier of the failure.
        message: Human-readable explanation.
        path: Offending path relative to the snapshot root, if any.
    """

    def __init__(self, reason_code: str, message: str, path: str | None = None) -> None:
        super().__init__(reason_code, message if path is None else f"{message} (path: {path})")
        self.path = path
