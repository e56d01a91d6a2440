"""The clock sampler reads a real child process's lines (a stand-in for ``nvidia-smi -lms``) and summarises the
samples of a time window: the fields a benchmark row gets for its timed steps."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from benchmarks import clocks
from benchmarks.clocks import FIELDS, ClockSampler, clock_fields

FAKE_SMI = """
import sys, time
def out(line):
    print(line, flush=True)
out("1900, 1980, 300.0, 700.00, Not Active")
time.sleep(0.5)
out("1500, 1980, 690.0, 700.00, Active")
out("garbage line")
out("1400, 1980, [N/A], 700.00, Active")
time.sleep(0.5)
out("1950, 1980, 320.0, 700.00, Not Active")
time.sleep(60)
"""


def _sampled() -> ClockSampler:
    sampler = ClockSampler(0, command=[sys.executable, "-c", FAKE_SMI]).start()
    deadline = time.monotonic() + 30
    while len(sampler.samples) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    return sampler


def test_fields_summarise_only_the_samples_inside_the_window():
    sampler = _sampled()
    assert sampler._process is not None and sampler._process.returncode is not None  # stop ended the child
    assert [values[0] for _, values in sampler.samples] == ["1900", "1500", "1400", "1950"]  # the bad line dropped
    inside = (sampler.samples[1][0], sampler.samples[2][0])  # the two power-capped samples only
    assert sampler.fields(*inside) == {
        "gpu_clock_samples": 2,
        "gpu_sm_clock_mhz_median": 1450.0,
        "gpu_sm_clock_max_mhz": 1980.0,
        "gpu_power_w_median": 690.0,  # "[N/A]" is no reading, not a zero
        "gpu_power_limit_w": 700.0,
        "gpu_power_capped_frac": 1.0,
    }
    everything = sampler.fields(0.0, float("inf"))
    assert everything["gpu_sm_clock_mhz_median"] == 1700.0 and everything["gpu_power_capped_frac"] == 0.5


def test_row_fields_take_the_timed_steps_and_scale_mfu_to_the_clock():
    sampler = _sampled()
    t = [when for when, _ in sampler.samples]
    ends = [t[0] - 1.0, (t[0] + t[1]) / 2, t[2] + 1e-6]  # warm-up step, then two timed steps: samples 1 and 2 inside
    fields = clock_fields(sampler, ends, warmup=2, mfu8n_989=0.5)
    assert fields["gpu_clock_samples"] == 2 and fields["gpu_sm_clock_mhz_median"] == 1450.0
    assert fields["mfu8N_at_sm_clock"] == round(0.5 * 1980 / 1450, 4)


def test_without_nvidia_smi_the_fields_are_none():
    sampler = ClockSampler(0, command=["/nonexistent/nvidia-smi"]).start()
    sampler.stop()
    assert sampler.fields(0.0, float("inf")) == dict.fromkeys(FIELDS)
    unsampled = {**dict.fromkeys(FIELDS), "mfu8N_at_sm_clock": None}
    assert clock_fields(None, [1.0, 2.0], warmup=1, mfu8n_989=0.5) == unsampled


def test_sampled_yields_a_sampler_on_cuda_and_stops_it_when_the_block_raises(monkeypatch):
    started: list[ClockSampler] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(clocks, "nvml_index", lambda index: index)
    original_start = ClockSampler.start

    def start(self):
        self.command = [sys.executable, "-c", FAKE_SMI]
        started.append(self)
        return original_start(self)

    monkeypatch.setattr(ClockSampler, "start", start)
    with pytest.raises(RuntimeError), clocks.sampled(True) as sampler:
        assert sampler is started[0]
        raise RuntimeError("training failed")
    assert sampler._process is not None and sampler._process.returncode is not None  # stopped despite the raise
    with clocks.sampled(False) as none:
        assert none is None
