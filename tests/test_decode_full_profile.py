"""benchmarks/decode_full.py's reading of a torch.profiler trace: per-kernel rows, the timeline and the host's phases
count GPU work only (kernels, copies, memsets), not the record_function ranges CUPTI also puts on the GPU's
timeline, CUPTI's overhead records or PyTorch's operators. A recorded trace of ONNX Runtime CUDA had its
"decode step" range as one more 18 ms "kernel", and the GPU busy for the whole step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
decode_full = pytest.importorskip("decode_full")


class Event:
    """The part of torch's _KinetoEvent the readers use."""

    def __init__(self, name: str, device: str, activity: str, start: int, duration: int):
        self._name, self._device, self._activity, self._start, self._duration = name, device, activity, start, duration

    def name(self):
        return self._name

    def device_type(self):
        return f"DeviceType.{self._device}"

    def activity_type(self):
        return self._activity

    def start_ns(self):
        return self._start

    def duration_ns(self):
        return self._duration


class Trace:
    """A profiler whose ``profiler.kineto_results.events()`` are ``events``."""

    def __init__(self, events):
        results = type("Results", (), {"events": lambda _self: events})()
        self.profiler = type("Profiler", (), {"kineto_results": results})()


def two_steps() -> Trace:
    events = []
    for base in (0, 20_000):  # two steps of 10 us, 10 us apart
        events += [
            Event("decode step", "CPU", "user_annotation", base, 10_000),
            Event("decode step", "CUDA", "gpu_user_annotation", base + 100, 9_800),  # the range, on the GPU
            Event("aten::mm", "CPU", "cpu_op", base + 200, 1_000),
            Event("cuLaunchKernel", "CPU", "cuda_driver", base + 300, 200),
            Event("cuLaunchKernel", "CPU", "cuda_driver", base + 1_300, 200),
            Event("k", "CUDA", "kernel", base + 1_000, 2_000),
            Event("k", "CUDA", "kernel", base + 4_000, 1_000),
            Event("Memcpy DtoH (Device -> Pinned)", "CUDA", "gpu_memcpy", base + 6_000, 500),
            Event("argmax", "CPU", "user_annotation", base + 10_000, 300),
        ]
    events.append(Event("Activity Buffer Request", "CUDA", "overhead", 0, 40_000))
    return Trace(events)


def test_kernel_rows_count_kernels_and_copies_only():
    rows = {r["kernel"]: r for r in decode_full.kernel_rows(two_steps(), steps=2)}
    assert set(rows) == {"k", "Memcpy DtoH (Device -> Pinned)"}
    assert rows["k"]["us_per_token"] == pytest.approx(3.0) and rows["k"]["launches_per_token"] == 2
    assert rows["Memcpy DtoH (Device -> Pinned)"]["us_per_token"] == pytest.approx(0.5)


def test_timeline_busy_time_is_the_work_not_the_step_range():
    line = decode_full.timeline(two_steps(), steps=2, wall_s=40e-6)
    assert line["busy_us"] == pytest.approx(3.5)  # 2 + 1 + 0.5 us a step, not the range's 9.8
    assert line["span_us"] == pytest.approx((26_500 - 1_000) / 1e3 / 2)
    assert line["gap_median_us"] == pytest.approx(1.0)  # 3000 -> 4000 and 5000 -> 6000 in each step
    assert line["launch_api_us"] == pytest.approx(0.2)


def test_host_phases_end_at_the_last_work_not_at_the_range():
    phases = decode_full.host_phases(two_steps())
    assert phases["step"] == pytest.approx(10.0)
    assert phases["gpu_end_to_return"] == pytest.approx(3.5)  # the copy ends at 6.5 us of the step's 10
    assert phases["to_first_launch"] == pytest.approx(0.3) and phases["argmax"] == pytest.approx(0.3)



class UntypedEvent:
    """torch 2.11's _KinetoEvent: an Event without ``activity_type``."""

    def __init__(self, e: Event):
        self.name, self.device_type, self.start_ns, self.duration_ns = e.name, e.device_type, e.start_ns, e.duration_ns


def test_a_torch_without_activity_types_still_counts_the_work_not_the_ranges():
    untyped = Trace([UntypedEvent(e) for e in two_steps().profiler.kineto_results.events()])
    rows = {r["kernel"]: r for r in decode_full.kernel_rows(untyped, steps=2)}
    assert set(rows) == {"k", "Memcpy DtoH (Device -> Pinned)"}  # not the ranges, not CUPTI's overhead
    assert rows["k"]["us_per_token"] == pytest.approx(3.0)
    assert decode_full.timeline(untyped, steps=2, wall_s=40e-6)["busy_us"] == pytest.approx(3.5)
    assert decode_full.host_phases(untyped)["gpu_end_to_return"] == pytest.approx(3.5)
