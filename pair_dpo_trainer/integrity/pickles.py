"""Which Python globals a ``torch.save`` file would import when unpickled, checked against an allowlist.

DeepSpeed loads its engine checkpoints (``global_stepN/*_model_states.pt``, ``*_optim_states.pt``) with
``torch.load(weights_only=False)``: a pickle there can run any code. :func:`pickle_problem` reads a file's pickle
statically (``torch.serialization.get_unsafe_globals_in_checkpoint``: no byte of it is executed) and names every
global it references that is neither one of torch's ``weights_only`` globals nor in :data:`ALLOWED_GLOBALS`, the
harmless data classes that real Trainer and DeepSpeed ZeRO checkpoints contain (enums, numpy's array
reconstruction). A file that is not a ``torch.save`` zip archive, or whose pickle uses an opcode the static reader
does not know, cannot be checked and is a problem too (fail closed).

Torch's distributed checkpoint (DCP: FSDP2's ``SHARDED_STATE_DICT`` checkpoints, ``pytorch_model_fsdp_0/``,
``optimizer_0/``) keeps its index in a raw pickle, ``.metadata``, which ``FileSystemReader.read_metadata`` loads with
``pickle.load``. :func:`dcp_metadata_problem` loads it with an unpickler that resolves only
:data:`DCP_METADATA_GLOBALS` (and torch's dtypes), so nothing else can be called, and then checks that every shard file
it names is a plain file name inside its directory (the reader joins them to the directory: an absolute name or one
with ``..`` would read a file outside the checkpoint).
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import PurePosixPath
from typing import Any

from pair_dpo_trainer.atomic import open_regular, read_regular

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


_UNREADABLE = (ValueError, EOFError, KeyError, RuntimeError, OSError, zipfile.BadZipFile, pickle.UnpicklingError)


def pickle_problem(path: str | os.PathLike[str]) -> str | None:
    """Why unpickling ``path`` could run code, or None when every global it references is allowed.

    Args:
        path: A file ``torch.load`` would read (``*.pt``, ``*.pth``, ``*.bin``).

    Returns:
        A short text naming the disallowed globals (``"references builtins.exec"``), or saying why the file cannot
        be checked (not a ``torch.save`` zip archive, an unreadable pickle); None when it is safe to unpickle.
    """
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        f = open_regular(path)  # never opened for blocking reads unless a regular file (a FIFO would hang)
    except OSError as exc:
        return f"cannot be read ({exc})"
    with f:
        if not zipfile.is_zipfile(f):
            return "is not a torch.save zip archive, so its pickle cannot be checked statically"
        try:
            f.seek(0)
            found = get_unsafe_globals_in_checkpoint(f)
        except (
            ValueError,
            EOFError,
            KeyError,
            RuntimeError,
            OSError,
            zipfile.BadZipFile,
            pickle.UnpicklingError,
        ) as exc:
            return f"cannot be checked statically ({type(exc).__name__}: {exc})"
    disallowed = sorted(set(found) - ALLOWED_GLOBALS)
    return f"references {', '.join(disallowed)}" if disallowed else None


DCP_METADATA_GLOBALS = frozenset(
    {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.serialization._get_layout",
        "torch.Size",
        "pathlib.Path",
        "pathlib.PosixPath",
        "pathlib.PurePosixPath",
        "collections.OrderedDict",
    }
)
"""What a DCP ``.metadata`` pickle may reference besides torch's dtypes: its dataclasses (plain fields), ``torch.Size``,
the layout lookup, and paths (``StorageMeta.checkpoint_id``); constructing any of them runs no other code."""
DCP_METADATA_MAX_BYTES = 1024 * 2**20
"""A DCP ``.metadata`` larger than this is refused."""


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Resolves only :data:`DCP_METADATA_GLOBALS` and torch's dtypes; anything else stops the load."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        qualified = f"{module}.{name}"
        if qualified in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"references {qualified}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("uses a persistent id, which a DCP .metadata never holds")


def dcp_metadata_problem(path: str | os.PathLike[str]) -> str | None:
    """Why loading the DCP ``.metadata`` at ``path`` could run code or read outside its directory, or None.

    Returns:
        A short text: a global outside :data:`DCP_METADATA_GLOBALS` (``"references builtins.exec"``), a shard file
        name that is not a plain name inside the directory, or why the file cannot be read; None when it is safe.
    """
    try:
        data = read_regular(path, limit=DCP_METADATA_MAX_BYTES)
        metadata = _DcpMetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        return str(exc) if str(exc).startswith("references") else f"cannot be checked ({exc})"
    except Exception as exc:  # noqa: BLE001 - a malformed pickle of any kind is refused (fail closed)
        return f"cannot be checked ({type(exc).__name__}: {exc})"
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return "is not a DCP checkpoint index (no storage_data)"
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _plain_name(name):
            return f"names the shard file {name!r}, which is not a plain file name inside its directory"
    return None


def _plain_name(name: str) -> bool:
    """One path component, neither ``.`` nor ``..``, no separator (POSIX or Windows), no NUL."""
    return (
        bool(name)
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and name not in {".", ".."}
        and PurePosixPath(name).name == name
    )
