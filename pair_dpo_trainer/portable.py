"""Exceptions that cross a process boundary (a tokenising worker, another rank) with their type, code and message.

``pickle`` rebuilds an exception by calling its class with ``exc.args``; a :class:`~pair_dpo_trainer.errors.
PairDPOError` takes ``(reason_code, message)`` but stores its formatted text as its only arg, so it cannot make the
round trip. :func:`freeze_exception` keeps the class, the args and the attributes (``reason_code``, ``message``,
``path``...); :func:`thaw_exception` rebuilds the same exception (from its args when the class takes them back, as
``OSError`` does, else without calling ``__init__``), so the receiving side raises what the sending side raised,
reason code included.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import Any


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
