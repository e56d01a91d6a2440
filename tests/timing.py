"""One factor for every wait in the tests: a loaded machine makes the suite slower, never red.

Each deadline a test waits on (a launch, a step to be reached, a subprocess, a stall detector's window, pytest-timeout)
is written for an idle 2-core machine and multiplied by :data:`TIME_SCALE`. The factor is
``PAIR_DPO_TEST_TIME_SCALE`` when set, else measured once per process: the larger of how much slower a fixed
pure-Python loop runs than on an idle core of the reference machine, and the 1-minute load average per core (a busy
machine runs each of our processes a fraction of the time). It is never below 1, so an idle machine keeps the written
deadlines.
"""

from __future__ import annotations

import os
import time

ENV = "PAIR_DPO_TEST_TIME_SCALE"
"""Environment variable that fixes the factor (e.g. ``4`` on a machine known to be slow)."""

_REFERENCE_LOOP_SECONDS = 0.1
"""The calibration loop's time on an idle core of the reference machine (2-core CI kind, Python 3.11)."""


def _loop_seconds() -> float:
    start, total = time.perf_counter(), 0
    for i in range(300_000):
        total += i * i % 7
    return time.perf_counter() - start


def _measured() -> float:
    loop = sorted(_loop_seconds() for _ in range(3))[1] / _REFERENCE_LOOP_SECONDS
    load = os.getloadavg()[0] / (os.cpu_count() or 1) if hasattr(os, "getloadavg") else 1.0
    return max(1.0, loop, load)


def _factor() -> float:
    value = os.environ.get(ENV)
    if value:
        return max(1.0, float(value))
    scale = _measured()
    os.environ[ENV] = f"{scale:.2f}"  # processes the tests launch use the same factor
    return scale


TIME_SCALE: float = _factor()


def scaled(seconds: float) -> float:
    """``seconds`` written for an idle machine, stretched by :data:`TIME_SCALE`."""
    return seconds * TIME_SCALE
