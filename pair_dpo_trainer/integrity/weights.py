"""Safetensors headers checked without loading a tensor: a 0-byte, truncated or foreign ``*.safetensors`` file is
refused (``bad_weights``) by ``verify-snapshot``, ``pin`` and the reference check at train start, before the loader's
``SafetensorError`` would end the run.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON (an object mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}``, plus an optional ``"__metadata__"`` of strings), then
the tensors' bytes. :func:`header_problem` is independent of the ``safetensors`` library and as strict as its reader:
known dtypes, each tensor's byte span equal to its shape times its dtype's size, the spans contiguous from 0, and
``8 + N + <the last end offset>`` equal to the file's size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pair_dpo_trainer.atomic import open_regular
from pair_dpo_trainer.errors import SnapshotIntegrityError

MAX_HEADER_BYTES = 100_000_000
"""The largest header the safetensors reader accepts."""

DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64,
}  # fmt: skip
"""Bits per element of each dtype name a safetensors header may give."""


def header_length(head: bytes) -> int | None:
    """``N``, the header length in the file's first 8 bytes (None when the file is shorter)."""
    return int.from_bytes(head[:8], "little") if len(head) >= 8 else None


def header_problem(head: bytes, file_size: int) -> str | None:
    """What is wrong with a safetensors file, from its first bytes and its size; None for a well-formed one.

    Args:
        head: The file's first ``8 + N`` bytes (fewer only when the file is shorter), ``N`` from
            :func:`header_length`.
        file_size: The file's size in bytes.

    Returns:
        A sentence naming the first problem found, or None.

    Example:
        >>> header_problem(b"", 0)
        'the file has 0 bytes, fewer than the 8 of a safetensors header length'
    """
    n = header_length(head)
    if n is None:
        return f"the file has {file_size} bytes, fewer than the 8 of a safetensors header length"
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        return f"its header length {n} is larger than the file ({file_size} bytes) allows: not a safetensors file"
    try:
        header = json.loads(head[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        return f"its {n}-byte header is not UTF-8 JSON ({exc}): not a safetensors file"
    if not isinstance(header, dict) or head[8:9] != b"{":
        return "its header is not a JSON object of tensors"
    end, problem = _tensors_end(header)
    if problem is not None:
        return problem
    if 8 + n + end != file_size:
        return (
            f"its tensors end at byte {8 + n + end} but the file has {file_size} bytes "
            f"({'truncated' if file_size < 8 + n + end else 'trailing bytes'})"
        )
    return None


def _tensors_end(header: dict[str, Any]) -> tuple[int, str | None]:
    """The end offset of the last tensor, or the first problem of the tensor entries."""
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        return 0, "its __metadata__ is not an object of strings"
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        span, problem = _tensor_span(name, info)
        if problem is not None:
            return 0, problem
        spans.append(span)
    offset = 0
    for begin, end, name in sorted(spans):
        if begin != offset:
            return 0, f"tensor {name!r} starts at data byte {begin}, expected {offset} (a gap or an overlap)"
        offset = end
    return offset, None


def _tensor_span(name: str, info: Any) -> tuple[tuple[int, int, str], str | None]:
    """``(begin, end, name)`` of one tensor entry, or its problem."""
    if not isinstance(info, dict):
        return (0, 0, name), f"tensor {name!r} has no dtype / shape / data_offsets object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BITS:
        return (0, 0, name), f"tensor {name!r} has an unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(_is_index(d) for d in shape)):
        return (0, 0, name), f"tensor {name!r} has no shape of non-negative integers ({shape!r})"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_index(o) for o in offsets)):
        return (0, 0, name), f"tensor {name!r} has no data_offsets [begin, end] ({offsets!r})"
    begin, end = offsets
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if end < begin or bits % 8 or end - begin != bits // 8:
        return (0, 0, name), (
            f"tensor {name!r} ({dtype}, shape {shape}) spans data bytes [{begin}, {end}), not the "
            f"{bits / 8:g} bytes its shape and dtype take"
        )
    return (begin, end, name), None


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_head(path: Path) -> tuple[bytes, int]:
    """The first ``8 + N`` bytes of the file (``N`` capped at :data:`MAX_HEADER_BYTES` and at the file's size)
    and its size; never reads a tensor's bytes.

    Raises:
        OSError: The file cannot be read.
    """
    with open_regular(path) as f:
        size = f.seek(0, 2)
        f.seek(0)
        first = f.read(8)
        n = header_length(first)
        if n is None or n > MAX_HEADER_BYTES or 8 + n > size:
            return first, size
        return first + f.read(n), size


def check_weight_headers(root: Path, weight_files: tuple[str, ...] | list[str]) -> None:
    """Refuses the first ``*.safetensors`` file among ``weight_files`` whose header is not well-formed.

    Args:
        root: The snapshot directory.
        weight_files: The weight files a loader would read (repository paths, e.g.
            ``check_completeness``'s result); files of other formats are skipped.

    Raises:
        SnapshotIntegrityError: ``bad_weights`` naming the file and what is wrong with it; ``unreadable_file``.
    """
    for rel in sorted(weight_files):
        if not rel.endswith(".safetensors"):
            continue
        try:
            head, size = read_head(root / rel)
        except OSError as exc:
            raise SnapshotIntegrityError("unreadable_file", f"cannot read the weights header ({exc})", rel) from exc
        problem = header_problem(head, size)
        if problem is not None:
            raise SnapshotIntegrityError("bad_weights", f"{rel} is not a well-formed safetensors file: {problem}", rel)
