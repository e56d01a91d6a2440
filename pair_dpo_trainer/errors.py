"""Error types shared by the whole package.

Every error a user can trigger carries a stable ``reason_code``: a short snake_case
string set where the error is raised (never parsed from the message). The codes are
documented in ``docs/reason_codes.md``; tests assert them.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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


Problem = tuple[str, str]
"""One ``(reason_code, message)`` of a collect-all check (``PairDPOConfig`` and ``training.checks.run_problems``)."""


class ConfigError(PairDPOError, ValueError):
    """An invalid configuration value or an unsupported combination of options.

    Args:
        reason_code: As for :class:`PairDPOError` (``invalid_config`` when several problems are raised at once).
        message: As for :class:`PairDPOError`.
        problems: Every ``(reason_code, message)`` found by the check that raised (``[(reason_code, message)]``
            when the error was raised for one problem).

    Attributes:
        problems: The list above, so a caller (or test) reads every problem without parsing the message.
    """

    def __init__(self, reason_code: str, message: str, problems: list[Problem] | None = None) -> None:
        super().__init__(reason_code, message)
        self.problems: list[Problem] = problems if problems is not None else [(reason_code, message)]


class ScheduleError(PairDPOError):
    """The pair schedule cannot be planned, or ranks disagree about it."""


class RunError(PairDPOError):
    """The run cannot go on safely: its output directory is in use, or a collective timed out or lost a peer."""


class CheckpointError(PairDPOError):
    """A checkpoint cannot be written (e.g. ``disk_full``) or resumed from (incomplete, missing, other data).

    Attributes:
        directory: For ``disk_full``: the run directory whose filesystem filled up (else None).
        free_bytes: For ``disk_full``: the free bytes measured there (None when unknown).
    """

    directory: str | None = None
    free_bytes: int | None = None


PREEMPTED_EXIT_CODE = 75
"""Exit status of a run stopped by a stop signal (SIGTERM, SIGINT): ``EX_TEMPFAIL`` of ``sysexits.h``."""


class Preempted(SystemExit):
    """A stop signal (SIGTERM, SIGINT) ended the run; uncaught, the process exits with :data:`PREEMPTED_EXIT_CODE`.

    A ``SystemExit``, not a :class:`PairDPOError`: ``except Exception`` does not swallow it, ``finally`` blocks run
    (temporary files are removed) and the interpreter exits normally (the output-dir lock is released).

    Attributes:
        reason_code: ``"preempted"``.
        message: What was interrupted and how to go on.
    """

    reason_code = "preempted"

    def __init__(self, message: str = "") -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


_REDOWNLOAD = "hf download REPO --revision <40-hex sha> --local-dir DIR"
_PIN = "`pair-dpo pin DIR` (a directory you saved yourself, e.g. after SFT)"

# How to fix each snapshot / identity failure; appended to the message so every raise site names the fix.
SNAPSHOT_FIXES: dict[str, str] = {
    "revision_not_pinned": f"pass the full 40-hex commit sha you downloaded ({_REDOWNLOAD})",
    "not_a_directory": "pass the --local-dir of the download",
    "unsafe_path": "re-download into a fresh directory and copy files in instead of linking them",
    "metadata_malformed": f"re-download the file ({_REDOWNLOAD} PATH)",
    "revision_mismatch": "re-download the whole snapshot at the pinned revision into a fresh directory",
    "metadata_missing": f"remove the file, or download it from the pinned commit ({_REDOWNLOAD} PATH); for a "
    f"directory without download metadata run {_PIN} and pass the revision it prints",
    "file_missing": "re-download the file, or remove its stale .metadata if the file is not part of the commit",
    "missing_config": f"download the complete snapshot ({_REDOWNLOAD})",
    "no_weights": f"download the complete snapshot ({_REDOWNLOAD})",
    "missing_shard": f"download every shard of the commit ({_REDOWNLOAD})",
    "pickle_weights": "convert the weights to safetensors, or allow pickle weights explicitly "
    "(allow_pickle_weights=True / --allow-pickle) if you trust the repository",
    "malformed_index": "re-download the index; if it persists the repository's index is broken",
    "empty_weight_map": "re-download the index; if it persists the repository's index is broken",
    "bad_suffix": "fix the repository's index so each shard has the format's suffix",
    "bad_weights": f"re-download the file ({_REDOWNLOAD} PATH); for a directory you saved yourself, re-save the "
    "model with save_pretrained and pin it again (`pair-dpo pin DIR --force`)",
    "hash_mismatch": "re-download the file from the pinned commit and find out what changed it",
    "unreadable_file": "fix the file's permissions or the storage and retry",
    "reference_changed": "resume with the same reference snapshot and revision as the original run",
    "identity_malformed": "restore pair_dpo_reference.json from the original checkpoint",
    "already_pinned": "verify it at its recorded commit (pair-dpo verify-snapshot DIR --revision <commit>), or "
    "re-pin the directory's current bytes with `pair-dpo pin DIR --force`",
}


class SnapshotIntegrityError(PairDPOError):
    """A reference snapshot that does not verify against its pinned revision.

    The message ends with how to fix the failure (``SNAPSHOT_FIXES``), whatever module raised it.

    Args:
        reason_code: Stable identifier of the failure.
        message: Human-readable explanation.
        path: Offending path relative to the snapshot root, if any.
    """

    def __init__(self, reason_code: str, message: str, path: str | None = None) -> None:
        text = message if path is None else f"{message} (path: {path})"
        fix = SNAPSHOT_FIXES.get(reason_code)
        super().__init__(reason_code, text if fix is None or fix in text else f"{text}; fix: {fix}")
        self.path = path


def raise_problems(problems: Sequence[Problem], *, what: str | None = None) -> None:
    """Raises one ``ConfigError`` listing every problem (nothing when there is none).

    Args:
        problems: ``(reason_code, message)`` pairs.
        what: Names the object in a summary line (``"PairDPOConfig"``: ``"PairDPOConfig has 2 invalid
            option(s): ..."``); None raises a single problem with its own message.

    Raises:
        ConfigError: the problem's own code when there is one, ``invalid_config`` for several; ``.problems`` lists
            them all.

    Example:
        >>> raise_problems([])
        >>> try:
        ...     raise_problems([("bad_beta", "beta=0: set beta > 0."), ("bad_length", "max_length=1: set > 1.")])
        ... except ConfigError as error:
        ...     print(error.reason_code, [code for code, _ in error.problems])
        invalid_config ['bad_beta', 'bad_length']
    """
    if not problems:
        return
    code = problems[0][0] if len(problems) == 1 else "invalid_config"
    if what is None and len(problems) == 1:
        message = problems[0][1]
    else:
        lines = "\n".join(f"  - [{c}] {text}" for c, text in problems)
        message = f"{what or 'this run'} has {len(problems)} invalid option(s):\n{lines}"
    raise ConfigError(code, message, problems=list(problems))


# Exceptions that cross a process boundary (a tokenising worker, another rank) keep their type, code and message.
# ``pickle`` rebuilds an exception by calling its class with ``exc.args``; a PairDPOError takes (reason_code, message)
# but stores its formatted text as its only arg, so it cannot make the round trip by itself.


@dataclass(frozen=True)
class FrozenException:
    """A picklable record of one exception.

    Attributes:
        cls: The exception class (pickled by reference), or None when it cannot be pickled.
        args: ``exc.args``.
        attributes: ``exc.__dict__`` (only when every value pickles).
        text: ``"<type>: <message>"`` and the traceback, for a class that cannot be rebuilt.
    """

    cls: type[BaseException] | None
    args: tuple[Any, ...]
    attributes: dict[str, Any]
    text: str


def freeze_exception(exc: BaseException) -> FrozenException:
    """Returns a picklable record of ``exc`` (see the module docstring)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        state = (type(exc), tuple(exc.args), dict(vars(exc)))
        pickle.loads(pickle.dumps(state))
    except Exception:  # an exception carrying something unpicklable: keep its text only
        return FrozenException(None, (), {}, text)
    return FrozenException(state[0], state[1], state[2], text)


def thaw_exception(frozen: FrozenException) -> BaseException:
    """Rebuilds the exception of :func:`freeze_exception` (a ``RuntimeError`` with its text when it cannot be)."""
    if frozen.cls is None:
        return RuntimeError(f"in another process:\n{frozen.text}")
    try:
        exc = frozen.cls(*frozen.args)
    except Exception:  # e.g. a PairDPOError: (reason_code, message) in, one formatted text in args
        exc = frozen.cls.__new__(frozen.cls)
        exc.args = frozen.args
    vars(exc).update(frozen.attributes)
    return exc
