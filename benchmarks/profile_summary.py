"""Summary of a ``torch.profiler`` trace of one optimizer step: host syncs by region and origin, top ops.

Used by ``python -m benchmarks.dpo --profile``. The bench marks the step with ``record_function`` regions whose names
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

Host time by region (:func:`host_breakdown`, printed after the top ops): per profiled step, the host wall time
inside each ``record_function`` range named ``pair_dpo::*`` (the trainer's ``compute_loss``: ``policy_logps``,
``reference_logps``, ``loss``), ``bench::*`` and ``hf::*`` (the bench's: optimizer step, after-optimizer, gradient
clipping), plus ``backward (derived)`` = from the end of the last ``pair_dpo::loss`` of a micro-batch to the end of
its ``bench::microbatch`` (the backward call: the host launches backward kernels, or waits), and
``other/unattributed`` = ``bench::step`` minus the union of all of these. Then the device side: the summed duration
of all CUDA kernels / copies in the trace, and their union ("GPU busy"), against the step's wall time: a step whose
GPU is busy for a small fraction of it is bound by the host (kernel launches, Python), not by the GPU.

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
OWNERS = ("pair_dpo_trainer", "benchmarks", "transformers", "accelerate", "deepspeed")
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


BREAKDOWN_PREFIXES = ("pair_dpo::", "bench::", "hf::")
"""Host ranges of the time breakdown: the trainer's ``pair_dpo::*``, the bench's ``bench::*`` and ``hf::*``."""
STEP_REGION = "bench::step"
LOSS_REGION = "pair_dpo::loss"
CONTAINER_REGIONS = (STEP_REGION, *MICROBATCH_REGIONS)
"""Ranges that contain other ranges: shown, but not part of the sum that ``other/unattributed`` is the rest of."""
BACKWARD = "backward (derived)"
OTHER = "other/unattributed"
REGION_ORDER = (
    "pair_dpo::policy_logps",
    "pair_dpo::reference_logps",
    "pair_dpo::loss",
    BACKWARD,
    "hf::clip_grad_norm",
    "bench::optimizer.step",
    "bench::after_optimizer",
)
REGION_NOTES = {
    BACKWARD: "end of pair_dpo::loss -> end of bench::microbatch (DeepSpeed: + its optimizer step)",
    "hf::clip_grad_norm": "HF gradient clipping",
    "bench::after_optimizer": "scheduler, zero_grad, step-end callbacks incl. the bench's CUDA sync = GPU drain",
    OTHER: "step minus the union of the rows above",
    STEP_REGION: "wall time of the profiled step(s), CUDA-synced at both ends",
    "bench::microbatch": "container: H2D copy, the pair_dpo:: ranges, backward",
}


def _union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    return sum(end - start for start, end in _merged(intervals))


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint intervals, by start."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def host_ranges(events: Iterable[Any]) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of the host-side ranges of :data:`BREAKDOWN_PREFIXES`, by start time."""
    found = [
        (e.name, _start(e), _end(e))
        for e in events
        if e.name.startswith(BREAKDOWN_PREFIXES) and not _on_device(e) and not _is_python(e)
    ]
    return sorted(found, key=lambda r: r[1])


def device_activity(events: Iterable[Any]) -> list[tuple[float, float]]:
    """``(start_us, end_us)`` of every device kernel / copy / memset (device-side user annotations excluded)."""
    return [
        (_start(e), _end(e))
        for e in events
        if _on_device(e)
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith(BREAKDOWN_PREFIXES)
        and not e.name.startswith("ProfilerStep")
    ]


def backward_ranges(ranges: Sequence[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """``(BACKWARD, start, end)`` of each micro-batch: from its last ``pair_dpo::loss`` range to its end."""
    found = []
    for name, mb_start, mb_end in ranges:
        if name not in MICROBATCH_REGIONS:
            continue
        loss_ends = [e for n, s, e in ranges if n == LOSS_REGION and mb_start <= s <= mb_end]
        if loss_ends:
            found.append((BACKWARD, max(loss_ends), mb_end))
    return found


def host_breakdown(events: Sequence[Any]) -> dict[str, Any]:
    """Per-step host time by region, and device busy time against the step wall time (see the module docstring).

    Returns:
        ``{"steps": n, "step_ms": wall ms per step, "rows": [{"region", "calls", "host_ms"}] (per step, in
        :data:`REGION_ORDER`, then other ranges found, then other/unattributed and the containers),
        "kernel_ms", "busy_ms", "kernels"}``; ``steps`` is 0 when the trace has no ``bench::step`` range.
    """
    ranges = host_ranges(events)
    steps = [(s, e) for n, s, e in ranges if n == STEP_REGION]
    if not steps:
        return {"steps": 0, "step_ms": 0.0, "rows": [], "kernel_ms": 0.0, "busy_ms": 0.0, "kernels": 0}

    def in_steps(start: float) -> bool:
        return any(s <= start <= e for s, e in steps)

    ranges = [r for r in ranges if in_steps(r[1])]
    totals: dict[str, list[float]] = {}  # name -> [calls, total_us]
    leaf_intervals: list[tuple[float, float]] = []
    for name, start, end in ranges:
        row = totals.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += end - start
        if name not in CONTAINER_REGIONS:
            leaf_intervals.append((start, end))
    for _, start, end in backward_ranges(ranges):
        row = totals.setdefault(BACKWARD, [0, 0.0])
        row[0] += 1
        row[1] += end - start
        leaf_intervals.append((start, end))
    n = len(steps)
    step_us = sum(e - s for s, e in steps)
    other_us = step_us - _union_us(leaf_intervals)
    names = [r for r in REGION_ORDER if r in totals]
    names += sorted(r for r in totals if r not in REGION_ORDER and r not in CONTAINER_REGIONS)
    rows = [{"region": r, "calls": int(totals[r][0]), "host_ms": totals[r][1] / 1e3 / n} for r in names]
    rows.append({"region": OTHER, "calls": n, "host_ms": other_us / 1e3 / n})
    rows += [
        {"region": r, "calls": int(totals[r][0]), "host_ms": totals[r][1] / 1e3 / n}
        for r in CONTAINER_REGIONS
        if r in totals
    ]
    device = [(s, e) for s, e in device_activity(events) if in_steps(s)]
    return {
        "steps": n,
        "step_ms": step_us / 1e3 / n,
        "rows": rows,
        "kernel_ms": sum(e - s for s, e in device) / 1e3 / n,
        "busy_ms": _union_us(device) / 1e3 / n,
        "kernels": len(device),
    }


GAP_US = 100.0
"""A device idle period this long or longer counts as a gap in :func:`idle_gaps` (shorter ones are launch spacing)."""


def _innermost(ranges: Sequence[tuple[str, float, float]], time_us: float, default: str) -> str:
    """The name of the latest-starting range that contains ``time_us`` (the innermost of nested ranges)."""
    inside = [(start, name) for name, start, end in ranges if start <= time_us <= end]
    return max(inside)[1] if inside else default


def idle_gaps(events: Sequence[Any], limit: int = 5) -> dict[str, Any]:
    """Where the device idles inside the profiled steps, and what the host was doing meanwhile.

    Every period of at least :data:`GAP_US` between the device's busy intervals (the step's start and end included)
    is charged to the host region (:data:`BREAKDOWN_PREFIXES`, the innermost, else :data:`OTHER`) and the innermost
    host op running at its midpoint: on a step bound by the host, that is the work the device waits for; a long gap
    under a synchronising op is a wait instead.

    Returns:
        ``{"idle_ms": idle ms per step, "gaps": gaps per step, "by_region": {region: ms per step}, "longest":
        [{"ms", "region", "op"}]}`` (the ``limit`` longest gaps); zeros when the trace has no ``bench::step``.
    """
    ranges = host_ranges(events)
    steps = [(s, e) for n, s, e in ranges if n == STEP_REGION]
    if not steps:
        return {"idle_ms": 0.0, "gaps": 0, "by_region": {}, "longest": []}
    leaves = [r for r in ranges if r[0] not in CONTAINER_REGIONS] + backward_ranges(ranges)
    ops = [(e.name, _start(e), _end(e)) for e in events if not _on_device(e) and not _is_python(e)]
    ops = [r for r in ops if not r[0].startswith(BREAKDOWN_PREFIXES) and not r[0].startswith("ProfilerStep")]
    busy = _merged(device_activity(events))
    gaps: list[tuple[float, float]] = []
    for step_start, step_end in steps:
        cursor = step_start
        for start, end in busy:
            if end <= step_start or start >= step_end:
                continue
            if start - cursor >= GAP_US:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        if step_end - cursor >= GAP_US:
            gaps.append((cursor, step_end))
    by_region: dict[str, float] = {}
    charged = []
    for start, end in gaps:
        middle = (start + end) / 2
        region = _innermost(leaves, middle, OTHER)
        by_region[region] = by_region.get(region, 0.0) + (end - start) / 1e3 / len(steps)
        charged.append((end - start, region, start, middle))
    longest = [
        {"ms": length / 1e3, "region": region, "op": _innermost(ops, middle, "(no host op)")}
        for length, region, _, middle in sorted(charged, reverse=True)[:limit]
    ]
    return {
        "idle_ms": sum(end - start for start, end in gaps) / 1e3 / len(steps),
        "gaps": len(gaps) // len(steps),
        "by_region": dict(sorted(by_region.items(), key=lambda item: -item[1])),
        "longest": longest,
    }


def format_gaps(gaps: dict[str, Any]) -> list[str]:
    """The text lines of :func:`idle_gaps`."""
    if not gaps["gaps"]:
        return [f"Device idle gaps >= {GAP_US:.0f} us per step: none."]
    lines = [
        f"Device idle gaps >= {GAP_US:.0f} us per step: {gaps['gaps']}, {gaps['idle_ms']:.3f} ms; by the host region "
        "running meanwhile:"
    ]
    lines += [f"  {region:28s} {ms:10.3f} ms" for region, ms in gaps["by_region"].items()]
    lines.append("Longest gaps (ms | host region | innermost host op at the gap's middle):")
    lines += [f"  {g['ms']:8.3f} | {g['region']} | {g['op']}" for g in gaps["longest"]]
    return lines


def format_breakdown(breakdown: dict[str, Any], use_device: bool) -> list[str]:
    """The text lines of :func:`host_breakdown`."""
    if not breakdown["steps"]:
        return ["Host time by region: no bench::step range in the trace."]
    step = breakdown["step_ms"]
    lines = [
        f"Host wall time per step by region ({breakdown['steps']} profiled step(s); host time between range enter "
        "and exit, profiler overhead included):",
        f"  {'region':28s} {'calls':>6s} {'host ms/step':>13s} {'% of step':>10s}  note",
    ]
    for row in breakdown["rows"]:
        share = 100.0 * row["host_ms"] / step if step else 0.0
        note = REGION_NOTES.get(row["region"], "")
        lines.append(f"  {row['region']:28s} {row['calls']:6d} {row['host_ms']:13.3f} {share:9.1f}%  {note}")
    if not use_device or not breakdown["kernels"]:
        lines.append(f"Device time per step: n/a (no CUDA kernels in the trace); step wall {step:.3f} ms.")
        return lines
    busy = breakdown["busy_ms"]
    verdict = "launch/host-bound" if busy < 0.8 * step else "GPU-bound"
    lines.append(
        f"Device time per step: CUDA kernels+copies {breakdown['kernel_ms']:.3f} ms summed "
        f"({breakdown['kernels'] // breakdown['steps']} per step), GPU busy (union) {busy:.3f} ms = "
        f"{100.0 * busy / step:.1f}% of the {step:.3f} ms step wall: {verdict} (GPU idle {step - busy:.3f} ms/step)."
    )
    return lines


def format_summary(
    events: Sequence[Any], use_device: bool, breakdown: dict[str, Any], gaps: dict[str, Any] | None, title: str = ""
) -> str:
    """The text written to ``profile_summary.txt``: headline counts, origins, top-15 ops, then the host-time
    ``breakdown`` (:func:`host_breakdown`) and, on a GPU, the idle ``gaps`` (:func:`idle_gaps`), which the caller
    computes once for the text and the row."""
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
    lines += format_breakdown(breakdown, use_device)
    if gaps is not None:
        lines += format_gaps(gaps)
    return "\n".join(lines) + "\n"
