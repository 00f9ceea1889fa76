"""``--profile START:STOP``: a ``jax.profiler`` trace of steps START .. STOP - 1 and the device
operations that took the most time in it.

The loop calls ``StepProfiler.before`` before dispatching each step and ``after`` once it is
dispatched; the trace starts once the steps before START are done and stops once STOP - 1 is,
so the wall time between is their step time. ``top_ops`` sums, per operation, the durations of
the trace's events with an ``hlo_op`` statistic over the device planes (the host plane without
any): ms per step, and share of the step time (of all devices' total, on a mesh)."""

import dataclasses
import glob
import os
import time
import warnings
from collections import Counter, defaultdict

import jax

from jaxaccel.core.errors import ConfigError


def parse_window(text: str) -> tuple[int, int]:
    """``"START:STOP"`` -> (START, STOP), 0 <= START < STOP; one ConfigError line otherwise."""
    start, sep, stop = str(text).partition(":")
    if not sep or not start.strip().isdigit() or not stop.strip().isdigit():
        raise ConfigError(f"profile {text!r} is not START:STOP (two step numbers); write e.g. "
                          f"--profile 10:15 to trace steps 10 to 14", field="run.profile")
    start, stop = int(start), int(stop)
    if stop <= start:
        raise ConfigError(f"profile {text}: STOP must be above START; write e.g. --profile "
                          f"{start}:{start + 5}", field="run.profile")
    return start, stop


def check_window(text: str, first_step: int, total_steps: int) -> tuple[int, int]:
    """The window of ``text``, checked to lie in steps ``first_step`` .. ``total_steps`` - 1."""
    start, stop = parse_window(text)
    if start < first_step or stop > total_steps:
        raise ConfigError(f"profile {text} is outside this run's steps {first_step} to "
                          f"{total_steps - 1}; choose START:STOP with {first_step} <= START < "
                          f"STOP <= {total_steps}", field="run.profile")
    return start, stop


@dataclasses.dataclass
class ProfileReport:
    """What a profile found: the steps traced, their wall time, the top operations."""

    trace_dir: str
    start: int
    stop: int
    step_ms: float
    devices: int
    ops: list           # [{"name", "ms_per_step", "share"}], most time first


class StepProfiler:
    """Traces steps ``start`` .. ``stop`` - 1 of a run into ``directory`` (module docstring)."""

    def __init__(self, window: tuple[int, int], directory: str, top: int = 10):
        self.start, self.stop = window
        self.directory, self.top = directory, top
        self.report: ProfileReport | None = None
        self._began = None

    def starts(self, step: int) -> bool:
        """Whether ``before`` starts the trace at ``step`` (the loop pauses its clock)."""
        return step == self.start

    def stops(self, step: int) -> bool:
        """Whether ``after`` stops the trace and reads it back at ``step``."""
        return step == self.stop - 1 and self._began is not None

    def before(self, step: int, state):
        if step == self.start:
            jax.block_until_ready(state)
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self._began = time.perf_counter()

    def after(self, step: int, state):
        if step == self.stop - 1 and self._began is not None:
            jax.block_until_ready(state)
            seconds = time.perf_counter() - self._began
            self.close()
            self.report = top_ops(self.directory, self.start, self.stop, seconds, self.top)

    def close(self):
        """Stop a trace still running (a run stopped inside the window)."""
        if self._began is not None:
            jax.profiler.stop_trace()
            self._began = None


def top_ops(directory: str, start: int, stop: int, seconds: float, top: int = 10
            ) -> ProfileReport:
    """The ``top`` operations of the newest trace under ``directory`` (module docstring)."""
    from jax.profiler import ProfileData
    traces = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*",
                                           "*.xplane.pb")), key=os.path.getmtime)
    if not traces:
        raise RuntimeError(f"jax.profiler wrote no trace under {directory}")
    data = ProfileData.from_file(traces[-1])
    per_plane = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)     # event stats' __module__
        for plane in data.planes:
            totals = defaultdict(int)
            for line in plane.lines:
                for event in line.events:
                    op = next((value for key, value in event.stats if key == "hlo_op"), None)
                    if op is not None:
                        totals[op] += event.duration_ns
            if totals:
                per_plane[plane.name] = totals
    device_planes = [name for name in per_plane if name.startswith("/device:")]
    summed = Counter()
    for name in device_planes or per_plane:
        summed.update(per_plane[name])
    steps = stop - start
    step_ms = seconds * 1e3 / steps
    devices = max(len(device_planes), 1)
    ops = [{"name": op, "ms_per_step": ns / 1e6 / steps,
            "share": ns / 1e6 / steps / (step_ms * devices)}
           for op, ns in sorted(summed.items(), key=lambda item: -item[1])[:top]]
    return ProfileReport(trace_dir=os.path.dirname(traces[-1]), start=start, stop=stop,
                         step_ms=step_ms, devices=devices, ops=ops)


def format_report(report: ProfileReport) -> str:
    """The report as the lines ``experiments.train`` prints."""
    lines = [f"profile             steps {report.start}-{report.stop - 1}, "
             f"{report.step_ms:.2f} ms per step; trace in {report.trace_dir}"]
    width = max([len(op["name"]) for op in report.ops] + [9])
    lines.append(f"  {'operation'.ljust(width)}  ms/step   share")
    lines += [f"  {op['name'].ljust(width)}  {op['ms_per_step']:7.3f}  {op['share']:6.1%}"
              for op in report.ops]
    return "\n".join(lines)
