"""Which Python globals a ``torch.save`` file would import when unpickled, checked against an allowlist.

DeepSpeed loads its engine checkpoints (``global_stepN/*_model_states.pt``, ``*_optim_states.pt``) with
``torch.load(weights_only=False)``: a pickle there can run any code. :func:`pickle_problem` reads a file's pickle
statically (``torch.serialization.get_unsafe_globals_in_checkpoint``: no byte of it is executed) and names every
global it references that is neither one of torch's ``weights_only`` globals nor in :data:`ALLOWED_GLOBALS`, the
harmless data classes that real Trainer and DeepSpeed ZeRO checkpoints contain (enums, numpy's array
reconstruction). A file that is not a ``torch.save`` zip archive, or whose pickle uses an opcode the static reader
does not know, cannot be checked and is a problem too (fail closed).
"""

from __future__ import annotations

import os
import pickle
import zipfile

ALLOWED_GLOBALS = frozenset(
    {
        # numpy arrays and scalars (HF's rng_state*.pth: numpy's MT19937 state), numpy 2 and numpy 1 module names
        "numpy._core.multiarray._reconstruct",
        "numpy._core.multiarray.scalar",
        "numpy.core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy.ndarray",
        "numpy.dtype",
        # DeepSpeed ZeRO optimizer state (*_optim_states.pt): the stage (an Enum) and the loss scaler (plain
        # attributes: the scale and its schedule; the dynamic one under fp16)
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    }
)
"""Globals outside torch's ``weights_only`` set that a checkpoint may reference: classes and functions that only
rebuild data (calling them with any arguments builds a value, runs nothing else). Never ``builtins`` callables such
as ``eval`` / ``exec`` / ``getattr``, nor ``os``, ``subprocess``, ``posix`` or anything that imports by name."""


def pickle_problem(path: str | os.PathLike[str]) -> str | None:
    """Why unpickling ``path`` could run code, or None when every global it references is allowed.

    Args:
        path: A file ``torch.load`` would read (``*.pt``, ``*.pth``, ``*.bin``).

    Returns:
        A short text naming the disallowed globals (``"references builtins.exec"``), or saying why the file cannot
        be checked (not a ``torch.save`` zip archive, an unreadable pickle); None when it is safe to unpickle.
    """
    from torch.serialization import get_unsafe_globals_in_checkpoint

    if not zipfile.is_zipfile(path):
        return "is not a torch.save zip archive, so its pickle cannot be checked statically"
    try:
        found = get_unsafe_globals_in_checkpoint(path)
    except (ValueError, EOFError, KeyError, RuntimeError, OSError, zipfile.BadZipFile, pickle.UnpicklingError) as exc:
        return f"cannot be checked statically ({type(exc).__name__}: {exc})"
    disallowed = sorted(set(found) - ALLOWED_GLOBALS)
    return f"references {', '.join(disallowed)}" if disallowed else None
