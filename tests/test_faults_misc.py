"""Faults of their own: a checkpoint whose metadata is incomplete or damaged is one line naming
the step, what is wrong and the fix, before any work; a signal while a command imports its
modules stops it cleanly."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import REPO, terminal_signals
from experiments import train as train_cli

SMALL = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--max-seq-len", "32",
         "--seq-len", "32", "--batch-size", "4", "--eval-every", "0", "--final-eval-batches",
         "1", "--no-progress", "--log-every", "1"]


def args(corpus_path, tmp_path, run_dir, steps=4):
    return [*SMALL, "--data", corpus_path, "--steps", str(steps), "--checkpoint-every", "2",
            "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache")]


def write_meta(run_dir, step: int, text: str):
    with open(run_dir / "checkpoints" / str(step) / "meta" / "metadata", "w") as f:
        f.write(text)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_a_checkpoint_with_incomplete_or_damaged_metadata_is_one_line(corpus_path, tmp_path,
                                                                      capsys):
    """It was a KeyError traceback (no loader_position), after the model's state was built;
    ``{}`` was called a checkpoint of the old format, and a meta that is not JSON "unreadable"
    without saying that an earlier checkpoint is complete. Now one line before any work, naming
    the run directory, the step, what is wrong and the fix."""
    run_dir = tmp_path / "run"
    assert train_cli.main(args(corpus_path, tmp_path, run_dir)) == 0
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]
    meta_path = run_dir / "checkpoints" / "4" / "meta" / "metadata"
    whole = json.loads(meta_path.read_text())
    whole_2 = (run_dir / "checkpoints" / "2" / "meta" / "metadata").read_text()
    resume = [*args(corpus_path, tmp_path, run_dir, steps=6), "--resume"]
    step_4 = run_dir / "checkpoints" / "4"

    write_meta(run_dir, 4, json.dumps({k: v for k, v in whole.items() if k != "loader_position"}))
    capsys.readouterr()
    assert train_cli.main(resume) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: run dir {run_dir}: the metadata of its checkpoint of step 4 "
                           f"is incomplete or damaged ({meta_path} lacks loader_position)"), line
    assert line.endswith(f"the checkpoint of step 2 is complete: delete {step_4} to resume from "
                         f"it, or start a new run_dir [--run-dir / run.run_dir]"), line

    write_meta(run_dir, 4, '{"format": 2, "loader_')
    assert train_cli.main(resume) == 2
    assert f"({meta_path} is not valid JSON: " in one_error_line(capsys)

    write_meta(run_dir, 4, "{}")
    write_meta(run_dir, 2, "[]")
    assert train_cli.main(resume) == 2
    line = one_error_line(capsys)
    assert "lacks loader_position, config); no earlier checkpoint is complete: start a new " \
           "run_dir [--run-dir / run.run_dir]" in line, line

    # --init-from reads the same meta: its flag is named
    assert train_cli.main([*args(corpus_path, tmp_path, tmp_path / "tuned"), "--init-from",
                           str(run_dir)]) == 2
    line = one_error_line(capsys)
    assert "checkpoint of step 4 is incomplete or damaged" in line and line.endswith(
        "no earlier checkpoint is complete: pass another run as init_from "
        "[--init-from / run.init_from]"), line

    # the fix the line gives: step 4 deleted, the run resumes from step 2
    write_meta(run_dir, 2, whole_2)
    shutil.rmtree(step_4)
    assert train_cli.main([*args(corpus_path, tmp_path, run_dir), "--resume"]) == 0
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]


# The experiments package's handlers: while ``python -m experiments.train`` imports jax.
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_command_imports_its_modules_stops_it_cleanly(corpus_path, tmp_path,
                                                                         signum):
    """A Ctrl-C in the command's first second printed a KeyboardInterrupt traceback from inside
    ``import jax``. The child logs its imports (-X importtime): the signal is sent as soon as
    the ``experiments`` package is imported, before jax is (it takes seconds more). Should it
    come later, the command's own handler answers: one line, the signal's exit code, either
    way."""
    with terminal_signals() as before:     # the child starts with a terminal's dispositions
        child = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "experiments.train", "--model", "tiny",
             "--steps", "2", "--data", corpus_path, "--run-dir", str(tmp_path / "run"),
             "--cache-dir", str(tmp_path / "cache"), "--no-progress"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        imported = []
        for line in child.stderr:
            imported.append(line.rsplit("|", 1)[-1].strip())
            if imported[-1] == "experiments":
                break
        assert "jax" not in imported
        child.send_signal(signum)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    err = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert child.returncode == 128 + signum, (child.returncode, err)
    assert len(err) == 1 and err[0].startswith(f"stopped by {signum.name}"), err
    assert "Traceback" not in out and not out.strip(), out
    # imported by this test's module (not run with -m), the package installed no handler:
    # each is what a process starts with (a terminal's, or ignored under nohup), and is again
    assert before[signal.SIGINT] in (signal.default_int_handler, signal.SIG_IGN)
    assert before[signal.SIGTERM] in (signal.SIG_DFL, signal.SIG_IGN)
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_closed_standard_output_stops_the_command_with_one_line(corpus_path, tmp_path):
    """``python -m experiments.train ... | head`` whose head has exited: the summary's print was
    a BrokenPipeError traceback and exit code 1. Now one line and 141, as a program killed by
    SIGPIPE exits; the run's files are written before."""
    child = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", *args(corpus_path, tmp_path,
                                                         tmp_path / "run", steps=2)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.close()        # the reader is gone before the command writes a line
    try:
        err = child.stderr.read().strip().splitlines()
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 128 + signal.SIGPIPE, (child.returncode, err)
    assert len(err) == 1 and err[0].startswith("stopped: standard output was closed"), err
    assert os.path.exists(tmp_path / "run" / "summary.json")
