"""Summary of a ``torch.profiler`` trace of one optimizer step: host syncs by region and origin, top ops.

Used by ``scripts/bench_dpo.py --profile``. The bench marks the step with ``record_function`` regions whose names
start with ``bench::`` (``bench::step``, ``bench::microbatch``, ``bench::optimizer.step``, ``bench::after_optimizer``);
every event is attributed to the innermost region whose time interval contains its start (so backward ops, which run
on the autograd thread, are attributed too).

Counted as host syncs (or sync candidates):

* CUDA runtime calls ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy``
  (the blocking, non-async copy);
* device-side ``Memcpy DtoH`` copies, attributed to the CPU op that launched them (a DtoH copy into pageable memory
  blocks the host; into pinned memory it is followed by a sync when the value is read);
* the ops ``aten::item``, ``aten::_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``, ``if t:``) and
  ``aten::nonzero`` (data-dependent shape: boolean indexing, ``nonzero``). On a CPU-only run these do not sync a
  device; they are still listed so that the code paths show up in CPU tests.

Origins come from the profiler's parent chain (``with_stack=True`` records Python frames as parent events): the first
Python frames outside ``torch/`` are printed, e.g. ``transformers/trainer.py(2800): _get_grad_norm``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

SYNC_RUNTIME = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")
DTOH = "Memcpy DtoH"
REGION_PREFIX = "bench::"
OUTSIDE = "(outside bench regions)"
MICROBATCH_REGIONS = ("bench::microbatch",)
_TORCH_FRAMES = ("torch/", "<built-in", "threading.py", "contextlib.py", "<frozen")
OWNERS = ("pair_dpo_trainer", "bench_dpo", "transformers", "accelerate", "deepspeed")
"""Code owners a sync is attributed to: the package of the innermost Python frame outside torch."""


def _start(event: Any) -> float:
    return float(event.time_range.start)


def _end(event: Any) -> float:
    return float(event.time_range.end)


def _is_python(event: Any) -> bool:
    return bool(getattr(event, "is_python_function", False)) or ".py(" in event.name


def _on_device(event: Any) -> bool:
    return not str(getattr(event, "device_type", "CPU")).endswith("CPU")


def regions_of(events: Iterable[Any]) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every host-side ``bench::`` region, shortest first (innermost wins)."""
    found = [(e.name, _start(e), _end(e)) for e in events if e.name.startswith(REGION_PREFIX) and not _on_device(e)]
    return sorted(found, key=lambda r: r[2] - r[1])


def region_at(regions: Sequence[tuple[str, float, float]], time_us: float) -> str:
    """Name of the innermost region containing ``time_us``, or :data:`OUTSIDE`."""
    for name, start, end in regions:
        if start <= time_us <= end:
            return name
    return OUTSIDE


def owner_of(where: str) -> str:
    """The package (one of :data:`OWNERS`, else ``other``) of the first Python frame named in ``where``."""
    frames = where.split("; ")[-1].split(" <- ")
    for frame in frames:
        for owner in OWNERS:
            if f"{owner}/" in frame or frame.startswith(owner) or f"/{owner}.py" in frame:
                return owner
        if ".py(" in frame:
            return "other"
    return "other"


def origin(event: Any, frames: int = 3) -> str:
    """The enclosing op and the first ``frames`` Python frames outside torch, from the profiler parent chain."""
    op, python = None, []
    parent = event.cpu_parent
    while parent is not None and len(python) < frames:
        if _is_python(parent):
            if not parent.name.startswith(_TORCH_FRAMES):
                python.append(parent.name)
        elif op is None and not parent.name.startswith(REGION_PREFIX):
            op = parent.name
        parent = parent.cpu_parent
    parts = [f"in {op}"] if op else []
    if python:
        parts.append(" <- ".join(python))
    return "; ".join(parts) if parts else "(no parent recorded)"


def _kind(event: Any) -> str | None:
    name = event.name
    if name in SYNC_RUNTIME or name in SYNC_OPS:
        return name
    return None


def sync_events(events: Sequence[Any]) -> list[tuple[str, Any]]:
    """``(kind, event)`` for every sync candidate; DtoH copies are returned with the CPU op that launched them."""
    found: list[tuple[str, Any]] = []
    for event in events:
        if _on_device(event):
            continue
        kind = _kind(event)
        if kind is not None:
            found.append((kind, event))
        for kernel in getattr(event, "kernels", None) or ():
            if DTOH in getattr(kernel, "name", ""):
                found.append((DTOH, event))
    return found


def containing_op(events: Sequence[Any], event: Any) -> Any:
    """The shortest non-Python op on ``event``'s thread whose interval contains it (for runtime calls that the
    profiler recorded without a parent), or None."""
    best, best_len = None, float("inf")
    start, end = _start(event), _end(event)
    for other in events:
        if other is event or other.thread != event.thread or _is_python(other) or other.name.startswith("cuda"):
            continue
        if _start(other) <= start and end <= _end(other) and _end(other) - _start(other) < best_len:
            best, best_len = other, _end(other) - _start(other)
    return best


def count_syncs(events: Sequence[Any], max_searches: int = 200) -> tuple[Counter, Counter]:
    """Returns ``(counts[(region, kind, owner)], origins[(kind, region, origin)])``."""
    regions = regions_of(events)
    counts: Counter = Counter()
    origins: Counter = Counter()
    for kind, event in sync_events(events):
        region = region_at(regions, _start(event))
        source = event
        if event.cpu_parent is None and kind in SYNC_RUNTIME and max_searches > 0:
            max_searches -= 1
            parent = containing_op(events, event)
            source = parent if parent is not None else event
            where = (f"in {parent.name}; " if parent is not None else "") + origin(source)
        else:
            where = origin(source)
        origins[(kind, region, where)] += 1
        counts[(region, kind, owner_of(where))] += 1
    return counts, origins


def top_ops(events: Sequence[Any], use_device: bool, limit: int = 15) -> list[dict[str, Any]]:
    """Top ops (no Python frames, no regions, no runtime calls) by self device time (CUDA) or self CPU time."""
    rows: dict[str, dict[str, Any]] = {}
    for event in events:
        if _is_python(event) or event.name.startswith(REGION_PREFIX) or event.name.startswith("cuda"):
            continue
        if _on_device(event):
            continue  # kernels are counted through the ops that launched them
        row = rows.setdefault(event.name, {"name": event.name, "calls": 0, "self_dev_ms": 0.0, "self_cpu_ms": 0.0})
        row["calls"] += 1
        row["self_dev_ms"] += float(getattr(event, "self_device_time_total", 0.0)) / 1e3
        row["self_cpu_ms"] += float(event.self_cpu_time_total) / 1e3
    key = "self_dev_ms" if use_device else "self_cpu_ms"
    return sorted(rows.values(), key=lambda r: r[key], reverse=True)[:limit]


def _headline(counts: Counter) -> list[str]:
    kinds = (*SYNC_RUNTIME, DTOH, *SYNC_OPS)
    in_loop: Counter = Counter()
    for (region, kind, owner), n in counts.items():
        if region in MICROBATCH_REGIONS:
            in_loop[(kind, owner)] += n
    lines = [
        "Sync candidates inside the micro-batch loop (bench::microbatch: H2D copy, forward, loss, backward; under",
        "DeepSpeed also the engine's optimizer step, which runs inside the last micro-batch's backward), by owner:",
        f"  {'kind':28s} " + " ".join(f"{o:>16s}" for o in (*OWNERS, "other")),
    ]
    for kind in kinds:
        lines.append(f"  {kind:28s} " + " ".join(f"{in_loop[(kind, o)]:16d}" for o in (*OWNERS, "other")))
    lines.append("All sync candidates by region (region | kind | owner | count):")
    lines += [f"  {r:28s} | {k:26s} | {o:16s} | {n}" for (r, k, o), n in sorted(counts.items())]
    return lines


def format_summary(events: Sequence[Any], use_device: bool, title: str = "") -> str:
    """The text written to ``profile_summary.txt``: headline counts, origins, top-15 ops."""
    counts, origins = count_syncs(events)
    lines = [title] if title else []
    lines += _headline(counts)
    device_dtoh = sum(1 for e in events if _on_device(e) and DTOH in e.name)
    lines.append(f"Cross-check: device-side '{DTOH}' events in the whole trace: {device_dtoh}")
    lines.append("Origins (count | kind | region | enclosing op; first Python frames outside torch):")
    for (kind, region, where), n in sorted(origins.items(), key=lambda x: (-x[1], x[0])):
        lines.append(f"  {n:4d} | {kind} | {region} | {where}")
    unit = "self CUDA" if use_device else "self CPU"
    lines.append(f"Top-15 ops by {unit} time in the profiled step:")
    lines.append(f"  {'op':48s} {'calls':>7s} {'self CUDA ms':>13s} {'self CPU ms':>12s}")
    for row in top_ops(events, use_device):
        lines.append(
            f"  {row['name'][:48]:48s} {row['calls']:7d} {row['self_dev_ms']:13.3f} {row['self_cpu_ms']:12.3f}"
        )
    return "\n".join(lines) + "\n"
