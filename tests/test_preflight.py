"""The OOM pre-flight: a compiled step larger than the device's memory is one error line that
gives the numbers and the fixes, before the first step."""

import pytest

from experiments import train as train_cli
from jaxaccel.core import hardware
from jaxaccel.run import loop


def test_a_step_larger_than_the_device_is_refused_before_the_first_step(
        corpus_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hardware, "memory_limit_bytes", lambda device=None: 100_000)
    ran = []
    monkeypatch.setattr(loop, "run_steps", lambda *a, **k: ran.append(1))
    code = train_cli.main(["--data", corpus_path, "--d-model", "32", "--n-layers", "2",
                           "--n-heads", "4", "--max-seq-len", "32", "--seq-len", "32",
                           "--batch-size", "4", "--steps", "2", "--no-progress",
                           "--run-dir", str(tmp_path / "run"),
                           "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not ran
    assert len(err) == 1 and "the train step needs" in err[0] and "has 100,000" in err[0], err
    assert "--memory-budget auto" in err[0] and "--batch-size" in err[0]


def test_memory_budget_auto_is_this_devices_memory(monkeypatch):
    from jaxaccel.run.config import parse
    from jaxaccel.core.errors import ConfigError
    assert hardware.memory_limit_bytes() is None            # the CPU reports none
    cfg = parse(["--memory-budget", "auto"])
    assert cfg.run.memory_budget == "auto" and parse(["run.memory_budget=512"]).run.memory_budget \
        == 512
    with pytest.raises(ConfigError, match="auto needs a device that reports its memory"):
        loop.memory_budget_bytes("auto")
    with pytest.raises(ConfigError, match="neither a number"):
        parse(["--memory-budget", "lots"])
    monkeypatch.setattr(hardware, "memory_limit_bytes", lambda device=None: 80 * 2**30)
    assert loop.memory_budget_bytes("auto") == 80 * 2**30 and loop.memory_budget_bytes(7) == 7
