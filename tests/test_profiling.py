"""--profile START:STOP: a trace of those steps in the run directory and the top operations read
from it; bad windows are one line before any work."""

import os
import time

import pytest

from experiments import train as train_cli
from jaxaccel.run import profiling
from jaxaccel.core.errors import ConfigError
from jaxaccel.run.profiling import check_window, parse_window
from tests.test_run_files import SMALL


def test_a_profiled_run_reports_its_top_operations(corpus_path, tmp_path, capsys,
                                                   monkeypatch):
    # Reading the trace back is not training: a read-back that took 1,000 s (on a clock moved on
    # by it) leaves the run's training seconds below that.
    offset, real_clock, read_back = [0.0], time.perf_counter, profiling.top_ops
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset[0])

    def slow_read_back(*args, **kwargs):
        offset[0] += 1000.0
        return read_back(*args, **kwargs)

    monkeypatch.setattr(profiling, "top_ops", slow_read_back)
    run_dir = tmp_path / "run"
    assert train_cli.main([*SMALL, "--data", corpus_path, "--steps", "6", "--profile", "2:5",
                           "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "profile             steps 2-4" in out, out
    import json
    profile = json.load(open(run_dir / "summary.json"))["profile"]
    assert (profile["start"], profile["stop"]) == (2, 5) and profile["step_ms"] > 0
    ops = profile["ops"]
    assert 1 <= len(ops) <= 10 and all(op["ms_per_step"] > 0 for op in ops)
    assert [op["ms_per_step"] for op in ops] == sorted((op["ms_per_step"] for op in ops),
                                                       reverse=True)
    # The operations ran inside the traced steps: together at most the steps' wall time (a
    # little over for threads that overlap), and a real share of it.
    assert 0.05 < sum(op["share"] for op in ops) < 2.5, ops
    assert any(name.endswith(".xplane.pb") for name in os.listdir(profile["trace_dir"]))
    assert profile["trace_dir"].startswith(str(run_dir / "profile"))
    assert 0 < json.load(open(run_dir / "summary.json"))["train_s"] < 1000


@pytest.mark.parametrize("text, message", [
    ("5", "is not START:STOP"), ("a:b", "is not START:STOP"), ("4:4", "STOP must be above"),
    ("-1:3", "is not START:STOP")])
def test_malformed_windows_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_window(text)


def test_a_window_outside_the_run_is_one_line_before_any_work(corpus_path, tmp_path, capsys):
    with pytest.raises(ConfigError, match="outside this run's steps 3 to 9"):
        check_window("1:4", 3, 10)
    assert check_window("3:10", 3, 10) == (3, 10)
    for window, message in (("4:9", "outside this run's steps 0 to 5"),
                            ("2", "is not START:STOP")):
        code = train_cli.main([*SMALL, "--data", corpus_path, "--steps", "6", "--profile",
                               window, "--run-dir", str(tmp_path / window),
                               "--cache-dir", str(tmp_path / "c")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
        assert not (tmp_path / window / "checkpoints").exists()
