"""Trackers: TensorBoard event files that hold the metrics.jsonl numbers, W&B offline runs
resumed by run directory, and a tracker asked for but not installed as one error line."""

import glob
import json
import os
import struct
import sys
import types

import pytest

from jaxaccel.run import trackers
from jaxaccel.run.config import build
from jaxaccel.core.errors import ConfigError
from jaxaccel.run.loop import train


def read_events(run_dir):
    """(step, tag, value) of every scalar in the run's TensorBoard event files."""
    from tensorboardX.proto import event_pb2
    out = []
    for path in glob.glob(os.path.join(run_dir, "tensorboard", "events.*")):
        data, i = open(path, "rb").read(), 0
        while i < len(data):                        # TFRecord: length, crc, payload, crc
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + n])
            out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
            i += 12 + n + 4
    return out


def test_tensorboard_holds_the_runs_metrics(corpus_path, tmp_path):
    cfg = build(values={
        "gpt.d_model": 32, "gpt.n_layers": 1, "gpt.n_heads": 4, "model.max_seq_len": 32,
        "data.path": corpus_path, "data.seq_len": 32, "data.batch_size": 4, "run.steps": 4,
        "run.eval_every": 0, "run.log_every": 2, "run.checkpoint_every": 0,
        "run.final_eval_batches": 1, "run.progress": False, "run.trackers": "tensorboard",
        "run.loss_plot": False,
        "run.run_dir": str(tmp_path / "run"), "data.cache_dir": str(tmp_path / "cache")})
    summary = train(cfg)
    with open(os.path.join(summary.run_dir, "metrics.jsonl")) as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}
    events = {step: value for step, tag, value in read_events(summary.run_dir)
              if tag == "train/loss"}
    assert sorted(events) == sorted(losses) == [2, 4]
    assert all(events[s] == pytest.approx(losses[s], rel=1e-6) for s in losses)


def test_a_missing_tracker_is_one_error_line_before_any_work(monkeypatch, tmp_path, capsys):
    from experiments import train as train_cli
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else real(name))
    run_dir = tmp_path / "run"
    code = train_cli.main(["--data", "/no/such/corpus", "--trackers", "wandb",
                           "--run-dir", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'jaxaccel[wandb]'" in err[0], err
    assert not run_dir.exists()
    for text, message in (("tensorboard,tensorboard", "without repeats"), ("mlflow", "comma list"),
                          (",", "comma list")):
        with pytest.raises(ConfigError, match=message):
            trackers.parse(text)
    with pytest.raises(ConfigError, match="unknown wandb_mode"):
        trackers.check("none", wandb_mode="cloud")
    assert trackers.parse("none") == [] and trackers.parse(None) == []


def test_wandb_runs_offline_in_the_run_dir_and_resumes_the_same_run(monkeypatch, tmp_path):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for _ in range(2):
        [tracker] = trackers.open_trackers(["wandb"], str(tmp_path), config={"run": {"steps": 4}})
        tracker.log(2, "eval", {"loss": 1.25})
        tracker.close()
    first, second = calls[0][1], calls[3][1]
    assert first["mode"] == "offline" and first["dir"] == str(tmp_path)
    assert first["id"] == second["id"] and first["resume"] == "allow"
    assert first["config"] == {"run": {"steps": 4}} and first["project"] == "jaxaccel"
    assert calls[1] == ("log", {"eval/loss": 1.25}, 2) and calls[2] == ("finish",)
