"""tools/gpu_session.py: every step of every GPU call is a command its experiment accepts (the
GPU session that runs them has no time to find a renamed flag), and the driver records a step
that fails, one that runs past its limit and one that cannot run, and goes on."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import gpu_session  # noqa: E402

from experiments import attention, embedding, precision, speedup  # noqa: E402
from jaxaccel.run.config import parse  # noqa: E402


def parse_step(argv: list[str]):
    """The experiment's own parse of a step's arguments (no work is done)."""
    module, args = argv[1], argv[2:]
    if module == "experiments.train":
        return parse(args)
    if module == "experiments.attention":
        return parse(args, attention.AttentionConfig)
    if module == "experiments.embedding":
        return parse(args, embedding.EmbeddingConfig)
    if module == "experiments.precision":
        return parse(args, precision.PrecisionConfig, defaults=precision.DEFAULTS,
                     fixed=precision.FIXED)
    if module == "experiments.speedup":
        return parse(args, speedup.SpeedupConfig, defaults=speedup.preset(args),
                     fixed=speedup.FIXED)
    raise AssertionError(f"no parser for {module}")


@pytest.mark.parametrize("smoke", [False, True])
def test_every_step_is_a_command_its_experiment_accepts(smoke, tmp_path):
    for call in gpu_session.CALLS.values():     # a call's steps write into one folder
        assert len({s.name for s in call}) == len(call)
    steps = [s for call in gpu_session.CALLS.values() for s in call]
    for step in steps:
        cmd = gpu_session.command(step, tmp_path, smoke)
        if step.needs == "peer":
            assert cmd[1] == str(gpu_session.PEER)
            continue
        if cmd[1].endswith(".py"):                  # a script of the project's tools
            assert (gpu_session.ROOT / cmd[1]).is_file(), cmd
            continue
        assert cmd[1] == "-m", cmd
        if step.needs == "bpe":     # the tokenizer file is made on the day (not in the repo)
            cmd = [("bpe:50257" if a == str(gpu_session.BPE) else a) for a in cmd]
        parse_step(cmd[1:])


def test_a_failing_a_hanging_and_a_missing_step_are_recorded(tmp_path, monkeypatch, capsys):
    script = tmp_path / "step.py"
    script.write_text("import json, os, signal, sys, time\n"
                      "def partial(*_):\n"
                      "    time.sleep(1)\n"       # a row saving its checkpoint
                      "    json.dump({'rows': [{'status': 'ok'}], 'meta': {'interrupted': "
                      "'SIGTERM'}}, open(sys.argv[-1], 'w'))\n"
                      "    sys.exit(143)\n"
                      "signal.signal(signal.SIGTERM, partial)\n"
                      "if sys.argv[1] == 'hang': time.sleep(60)\n"
                      "json.dump({'rows': [{'status': 'ok'}]}, open(sys.argv[-1], 'w'))\n"
                      "sys.exit(sys.argv[1] == 'fail')\n")
    monkeypatch.setitem(gpu_session.CALLS, "train", [
        gpu_session.Step("fails", [str(script), "fail"], 30),
        gpu_session.Step("hangs", [str(script), "hang"], 2),     # stops, keeping its table
        gpu_session.Step("peer", [str(script), "ok"], 30, needs="peer", json=False),
        gpu_session.Step("works", [str(script), "ok"], 30)])
    monkeypatch.setattr(gpu_session, "PEER", tmp_path / "absent.py")
    monkeypatch.setenv("TMPDIR", str(tmp_path))      # its work folder, removed with tmp_path
    assert gpu_session.main(["train", "--out", str(tmp_path / "out")]) == 1
    steps = {s["name"]: s for s in
             json.loads((tmp_path / "out" / "session.json").read_text())["steps"]}
    assert steps["fails"]["status"] == "failed (exit 1)"
    assert steps["hangs"]["status"] == "timed out after 2 s"
    assert steps["hangs"]["result"]["meta"]["interrupted"] == "SIGTERM"
    assert steps["peer"]["status"].startswith("skipped: absent.py is not here")
    assert steps["works"]["status"] == "ok" and steps["works"]["result"]["rows"]
    printed = capsys.readouterr().out
    assert "- works: ok in" in printed and "1 rows, 0 errors" in printed
