"""The GPU's SM clock and power draw during a run's timed steps, sampled by ``nvidia-smi`` in a child process.

Why a benchmark row records them: a GPU that draws its power limit lowers its SM clock below the maximum, by how
much depends on the chip and on the work (docs/benchmarks.md has what an H200 did). Two runs' tok/s are only
comparable when their clocks are, so every row says what the clock was; a run that keeps the tensor cores busier
draws more power and runs at a lower clock than a lighter one (TRL's step) on the same GPU, which a same-call ratio
folds in.

The sampler is a separate ``nvidia-smi -lms`` process read by a daemon thread: nothing touches the training
process's CUDA context, and the host cost is one line read every ``period_ms``. Without ``nvidia-smi`` (a CPU
machine) the fields are None.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.sw_power_cap"
"""One sample: SM clock and its maximum (MHz), power draw and limit (W), whether the power cap throttles now."""

FIELDS = (
    "gpu_clock_samples",
    "gpu_sm_clock_mhz_median",
    "gpu_sm_clock_max_mhz",
    "gpu_power_w_median",
    "gpu_power_limit_w",
    "gpu_power_capped_frac",
)
"""The row's fields (None when nothing was sampled in the window)."""


def nvml_index(device_index: int) -> int:
    """``nvidia-smi``'s index of torch's CUDA device ``device_index`` (``CUDA_VISIBLE_DEVICES`` applied)."""
    import torch

    try:
        return int(torch.cuda._get_nvml_device_index(device_index))
    except (AttributeError, RuntimeError, ValueError):  # an older torch, or UUIDs it cannot map: the visible index
        return device_index


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]" on a GPU that does not report it
        return None


class ClockSampler:
    """Samples :data:`QUERY` for one GPU every ``period_ms`` until :meth:`stop`.

    Args:
        index: The GPU's ``nvidia-smi`` index (:func:`nvml_index`).
        period_ms: Sampling period in milliseconds.
        command: The sampling command, printing lines of :data:`QUERY`'s values (default ``nvidia-smi``; tests pass a
            fake).
    """

    def __init__(self, index: int, period_ms: int = 200, command: list[str] | None = None) -> None:
        self.command = command or [
            "nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", str(index), "-lms",
            str(period_ms),
        ]  # fmt: skip
        self.samples: list[tuple[float, list[str]]] = []  # (time.perf_counter() when read, the line's values)
        self._process: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ClockSampler:
        """Starts sampling; without the command (no ``nvidia-smi``) it samples nothing."""
        try:
            self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            values = [v.strip() for v in line.split(",")]
            if len(values) == len(QUERY.split(",")):
                self.samples.append((time.perf_counter(), values))

    def stop(self) -> None:
        """Ends the sampling process and waits for the reader."""
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def fields(self, start: float, end: float) -> dict[str, Any]:
        """:data:`FIELDS` over the samples read in ``[start, end]`` (``time.perf_counter()``: the timed steps)."""
        window = [values for t, values in self.samples if start <= t <= end]
        clocks = [c for c in (_number(v[0]) for v in window) if c is not None]
        power = [p for p in (_number(v[2]) for v in window) if p is not None]
        if not clocks:
            return dict.fromkeys(FIELDS)
        return {
            "gpu_clock_samples": len(window),
            "gpu_sm_clock_mhz_median": statistics.median(clocks),
            "gpu_sm_clock_max_mhz": _number(window[0][1]),
            "gpu_power_w_median": round(statistics.median(power), 1) if power else None,
            "gpu_power_limit_w": _number(window[0][3]),
            "gpu_power_capped_frac": round(sum(v[4] == "Active" for v in window) / len(window), 3),
        }


@contextlib.contextmanager
def sampled(cuda: bool) -> Iterator[ClockSampler | None]:
    """A :class:`ClockSampler` of this process's current CUDA device for the block (None without CUDA), stopped when
    the block ends, however it ends."""
    sampler = None
    if cuda:
        import torch

        sampler = ClockSampler(nvml_index(torch.cuda.current_device())).start()
    try:
        yield sampler
    finally:
        if sampler is not None:
            sampler.stop()


def clock_fields(sampler: ClockSampler | None, ends: list[float], warmup: int, mfu8n_989: float) -> dict[str, Any]:
    """The row's clock fields over the timed steps (``ends[max(warmup, 1) - 1]`` to ``ends[-1]``, as the step times
    are taken), and ``mfu8N_at_sm_clock``: the 8N MFU against the peak at the median clock (989 TFLOP/s is the
    peak at the maximum clock; tensor-core throughput scales with the SM clock)."""
    if sampler is None or len(ends) <= max(warmup, 1) - 1:
        return {**dict.fromkeys(FIELDS), "mfu8N_at_sm_clock": None}
    fields = sampler.fields(ends[max(warmup, 1) - 1], ends[-1])
    clock, top = fields["gpu_sm_clock_mhz_median"], fields["gpu_sm_clock_max_mhz"]
    at_clock = round(mfu8n_989 * top / clock, 4) if clock and top else None
    return {**fields, "mfu8N_at_sm_clock": at_clock}
