"""Nothing lost, nothing duplicated (issue 35): a checkpoint that cannot be written is one line
and a prompt exit that keeps the last good checkpoint; a run directory is locked while a run
writes it; no record is appended twice, whether a run starts over, resumes or is run again; a
signal is honoured in the final evaluation too."""

import errno
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import REPO
from experiments import train as train_cli
from jaxaccel.run.loop.setup import lock_run_dir
from jaxaccel.step.metrics import read_metrics

# One layer and a constant learning rate after the warmup: runs of any length compile the same
# programs, which the run-wide compilation cache serves after the first; no loss plot (about
# 0.2 s a run). What the tests check depends on none of them.
SMALL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--max-seq-len", "32",
         "--seq-len", "32", "--batch-size", "4", "--eval-every", "0", "--final-eval-batches",
         "1", "--no-progress", "--log-every", "1", "--schedule", "constant", "--no-loss-plot"]


def base_args(corpus_path, tmp_path, steps=6, name="run"):
    return [*SMALL, "--data", corpus_path, "--steps", str(steps), "--checkpoint-every", "3",
            "--run-dir", str(tmp_path / name), "--cache-dir", str(tmp_path / "cache")]


def records(run_dir) -> list[tuple[int, str]]:
    return [(r["step"], r["kind"]) for r in read_metrics(str(run_dir / "metrics.jsonl"))]


def once_each(steps: int) -> list[tuple[int, str]]:
    """The records of a run of ``steps`` logged every step: each step once, one final eval."""
    return [(s, "train") for s in range(1, steps + 1)] + [(steps, "eval")]


# Class 1: a checkpoint write that fails.

# orbax makes step 6's temporary directory; the folder refuses it, as a read-only one would (a
# test cannot make a folder read-only for root). Before the fix orbax made it in a background
# thread that its commit threads waited for: the error line, then the process hung for orbax's
# 300 s timeout in threading._shutdown, its tracebacks printed.
READ_ONLY_AT_STEP_6 = """
import errno, os, sys
mkdir = os.mkdir
def refused(path, *args, **kwargs):
    if "6.orbax-checkpoint-tmp" in os.fspath(path):
        raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
    return mkdir(path, *args, **kwargs)
os.mkdir = refused
from experiments import train
sys.exit(train.main(sys.argv[1:]))
"""


def test_a_folder_that_refuses_a_checkpoint_is_one_line_and_a_prompt_exit(corpus_path, tmp_path,
                                                                        capsys):
    args = base_args(corpus_path, tmp_path, steps=8)
    proc = subprocess.run([sys.executable, "-c", READ_ONLY_AT_STEP_6, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=150)     # orbax waited 300 s
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert "checkpoint of step 6 could not be written" in err[0], err
    assert "Permission denied" in err[0] and "step 3 is kept" in err[0], err
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["3"]
    assert train_cli.main([*args, "--resume"]) == 0
    assert records(tmp_path / "run") == once_each(8)
    capsys.readouterr()


def test_a_read_only_checkpoints_folder_is_one_line_before_any_work(corpus_path, tmp_path,
                                                                    capsys, monkeypatch):
    """Checked with the outputs, before the corpus is read (a test cannot make a folder read-only
    for root: the folder's refusal is made here)."""
    import tempfile
    make = tempfile.TemporaryFile

    def refusing(*args, dir=None, **kwargs):
        if dir is not None and os.path.basename(dir) == "checkpoints":
            raise PermissionError(errno.EACCES, "Permission denied", dir)
        return make(*args, dir=dir, **kwargs)

    os.makedirs(tmp_path / "run" / "checkpoints")
    monkeypatch.setattr(tempfile, "TemporaryFile", refusing)
    assert train_cli.main([*base_args(corpus_path, tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot write in {tmp_path / 'run' / 'checkpoints'} (Permission " \
        f"denied)" in err[0], err
    assert not (tmp_path / "cache").exists()


def test_a_full_disk_is_refused_before_orbax_writes_anything(corpus_path, tmp_path, capsys,
                                                              monkeypatch):
    """Room for the state is checked before each save: a disk with too little is one line, and
    no half-written checkpoint is left; the first checkpoint failing says the run starts over."""
    from jaxaccel.run import checkpoint
    usage, calls = shutil.disk_usage, []

    def full_from_second_save(path):
        calls.append(path)
        real = usage(path)
        return real._replace(free=1000) if len(calls) >= 2 else real

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", full_from_second_save)
    args = base_args(corpus_path, tmp_path, steps=8)
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint of step 6 could not be written" in err[0], err
    assert "1,000 bytes free" in err[0] and "step 3 is kept" in err[0], err
    assert "free disk space and continue with --resume" in err[0], err
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["3"]

    calls.append("the first save fails too")
    assert train_cli.main(base_args(corpus_path, tmp_path, name="first")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no earlier checkpoint exists" in err[0], err
    assert "run the command again (it starts over)" in err[0], err


def test_out_of_memory_in_the_final_evaluation_keeps_the_last_checkpoint(corpus_path, tmp_path,
                                                                          capsys, monkeypatch):
    """The last checkpoint is finished before the final evaluation starts (it used to be left
    as N.orbax-checkpoint-tmp); --resume then runs only the evaluation, recorded once."""
    finish = importlib.import_module("jaxaccel.run.loop.finish")
    seen = []

    def out_of_memory(*args, **kwargs):
        seen.append(sorted(os.listdir(tmp_path / "run" / "checkpoints")))
        raise MemoryError("out of memory in the final evaluation")

    monkeypatch.setattr(finish, "run_eval", out_of_memory)
    args = base_args(corpus_path, tmp_path, steps=7)   # step 7's checkpoint: the run's end's
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of memory" in err[0], err
    assert seen == [["6", "7"]]
    monkeypatch.undo()
    assert train_cli.main([*args, "--resume"]) == 0
    assert records(tmp_path / "run") == once_each(7)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_this_run"] == 0 and summary["val_tokens"] > 0
    capsys.readouterr()


# Class 2: records duplicated or silently restarted.

HOLD_LOCK = """
import sys, time
from jaxaccel.run.loop.setup import lock_run_dir
lock = lock_run_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_a_run_directory_is_locked_while_a_run_writes_it(corpus_path, tmp_path, capsys):
    """A second run into it is one line naming the holder, before any work; a SIGKILLed holder
    leaves no stale lock (the kernel drops a flock with its process)."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert train_cli.main(base_args(corpus_path, tmp_path)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"run dir {run_dir} is in use by another run (pid " \
            f"{holder.pid} on" in err[0], err
        assert err[0].endswith("wait for it to end, or choose another run_dir "
                               "[--run-dir / run.run_dir]"), err
        assert not (run_dir / "metrics.jsonl").exists()
        assert not (tmp_path / "cache").exists()            # refused before the corpus was read
    finally:
        holder.kill()
        holder.wait()
    lock_run_dir(str(run_dir)).close()      # free again: the SIGKILL left no stale lock


def test_a_new_run_starts_over_the_records_of_a_run_that_saved_no_checkpoint(
        corpus_path, tmp_path, capsys):
    """Killed before its first checkpoint, a run leaves records and an unfinished checkpoint;
    the same command again removes both, saying so, and writes each step once (it appended to
    them, steps 1-3 twice, the unfinished checkpoint deleted silently under --no-progress)."""
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "checkpoints" / "3.orbax-checkpoint-tmp" / "state")
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "kind": "train", "loss": 5.0}) + "\n" for s in (1, 2, 3))
        + '{"step": 4, "ki')
    assert train_cli.main(base_args(corpus_path, tmp_path, steps=4)) == 0
    out = capsys.readouterr().out
    assert f"removed {run_dir / 'checkpoints' / '3.orbax-checkpoint-tmp'}: a checkpoint that " \
           f"was not finished" in out, out
    assert f"metrics.jsonl: 4 record(s) of an earlier run into {run_dir} that saved no " \
           f"checkpoint removed; this run starts at step 0" in out, out
    assert records(run_dir) == once_each(4)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["3", "4"]


@pytest.fixture(scope="module")
def finished(corpus_path, tmp_path_factory):
    """The folder of a finished run of 3 steps (``base_args``); a test copies it to its own
    ``tmp_path / "run"``, where its ``base_args`` point."""
    tmp_path = tmp_path_factory.mktemp("finished")
    assert train_cli.main(base_args(corpus_path, tmp_path, steps=3)) == 0
    return tmp_path / "run"


def test_a_new_run_is_refused_where_another_run_left_checkpoints_or_its_summary(
        finished, corpus_path, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    args = base_args(corpus_path, tmp_path, steps=3)
    capsys.readouterr()
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds checkpoints; set resume to continue it or choose " \
        "another run_dir [--resume / run.resume]" in err[0], err
    shutil.rmtree(run_dir / "checkpoints")
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds the summary.json of a finished run" in err[0], err
    assert records(run_dir) == once_each(3)


def test_resuming_a_finished_run_adds_no_record(finished, corpus_path, tmp_path, capsys):
    """It used to append a second, identical final evaluation: the final evaluation's record
    (``"final": true``) comes after the last checkpoint, so a resume replaces it, saying so."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    args = base_args(corpus_path, tmp_path, steps=3)
    before = read_metrics(str(run_dir / "metrics.jsonl"))
    assert before[-1]["kind"] == "eval" and before[-1]["final"] is True
    capsys.readouterr()
    assert train_cli.main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "metrics.jsonl: 1 record(s) written after the checkpoint of step 3 removed" in out
    after = read_metrics(str(run_dir / "metrics.jsonl"))
    assert after[:-1] == before[:-1] and records(run_dir) == once_each(3)
    assert after[-1]["loss"] == before[-1]["loss"]


# Class 6: a signal in the final evaluation.

def test_sigterm_in_the_final_evaluation_stops_the_run(corpus_path, tmp_path, capsys,
                                                        monkeypatch):
    """It was ignored until the evaluation ended, then exit 0 with ``interrupted: null``; now the
    evaluation stops at its next batch: no record of it, exit 143, and --resume finishes it."""
    run_module = importlib.import_module("jaxaccel.run.loop.run")
    place, sent = run_module.place_batch, []

    def signal_at_first_eval_batch(batch, sharding=None):      # eval_every 0: the final one
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGTERM)
        return place(batch, sharding)

    monkeypatch.setattr(run_module, "place_batch", signal_at_first_eval_batch)
    run_dir = tmp_path / "run"
    args = [*base_args(corpus_path, tmp_path, steps=3), "--final-eval-batches", "4"]
    assert train_cli.main(args) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert sent and len(err) == 1, err
    assert err[0].startswith("stopped by SIGTERM at step 3 before the final evaluation "
                             "finished; checkpoint saved; finish with:"), err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] == "SIGTERM" and summary["val_tokens"] == 0
    assert records(run_dir) == once_each(3)[:-1]
    monkeypatch.undo()
    assert train_cli.main([*args, "--resume"]) == 0
    assert records(run_dir) == once_each(3)
    capsys.readouterr()


def test_a_metrics_record_that_cannot_be_written_is_one_line(tmp_path):
    from jaxaccel.core.errors import ConfigError
    from jaxaccel.step.metrics import MetricsWriter

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    writer = MetricsWriter(str(tmp_path))
    writer._file.close()
    writer._file = FullDisk()
    with pytest.raises(ConfigError, match=r"cannot write .*metrics.jsonl \(No space left on "
                                          r"device\); free disk space and continue with "
                                          r"--resume, or pass another run_dir"):
        writer.write(1, "train", {"loss": 1.0})
