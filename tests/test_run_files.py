"""A run's files: output locations checked before any work, unfinished checkpoints removed,
and metrics.jsonl consistent with the checkpoint a killed run resumes from."""

import json
import math
import os
import shutil

import pytest

from experiments import train as train_cli
from jaxaccel.step.metrics import read_metrics, truncate_metrics

SMALL = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--max-seq-len", "32",
         "--seq-len", "32", "--batch-size", "4", "--eval-every", "0", "--final-eval-batches",
         "1", "--no-progress"]
# This file's runs: SMALL with one layer and a constant learning rate after the warmup, so that
# runs of any length compile the same programs (the run-wide compilation cache serves them after
# the first), and no loss plot (about 0.2 s a run). What the tests check depends on none of them.
FAST = ["--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--max-seq-len", "32",
        "--seq-len", "32", "--batch-size", "4", "--eval-every", "0", "--final-eval-batches", "1",
        "--no-progress", "--schedule", "constant", "--no-loss-plot"]


def test_unwritable_outputs_are_one_line_before_any_work(corpus_path, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for flags, message in ((["--run-dir", str(blocker / "run")], "is not a directory"),
                           (["--run-dir", str(tmp_path / "r"), "--json",
                             str(tmp_path / "missing" / "s.json")], "create it first")):
        code = train_cli.main([*FAST, "--data", corpus_path, "--steps", "2", *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r").exists()


def test_a_killed_run_resumes_with_each_step_once_in_its_metrics(corpus_path, tmp_path, capsys):
    run_dir = tmp_path / "run"
    base = [*FAST, "--data", corpus_path, "--steps", "4", "--log-every", "1",
            "--checkpoint-every", "2", "--run-dir", str(run_dir),
            "--cache-dir", str(tmp_path / "cache")]
    assert train_cli.main(base) == 0
    # as if killed after step 4's metrics but before its checkpoint finished
    shutil.rmtree(run_dir / "checkpoints" / "4")
    os.makedirs(run_dir / "checkpoints" / "4.orbax-checkpoint-tmp-1")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "kind": "tra')
    assert train_cli.main([*base, "--resume"]) == 0
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]
    # the run record: config, command line, software and devices, summary, whatever the flags
    for name in ("config.yaml", "command.txt", "environment.json", "summary.json"):
        assert (run_dir / name).stat().st_size > 0
    environment = json.loads((run_dir / "environment.json").read_text())
    assert environment["versions"]["jax"] and environment["device_count"] >= 1
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    capsys.readouterr()


def test_truncating_metrics_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "kind": "train", "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "ki')
    assert len(read_metrics(str(path))) == 3           # a cut last line is left out
    assert truncate_metrics(str(path), 2) == 2
    assert [r["step"] for r in read_metrics(str(path))] == [1, 2]
    assert truncate_metrics(str(tmp_path / "none.jsonl"), 2) == 0


def test_skipped_inputs_are_counted_and_named_when_nothing_is_left(tmp_path, capsys):
    from jaxaccel.data.corpus import load_corpus, skipped_inputs
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    for i in range(40):
        (data / "sub" / f"doc{i}.txt").write_text(f"document {i} has some text in it\n" * 3)
    (data / "binary.bin").write_bytes(b"\xff\xfe\x00\x81" * 8)
    os.symlink(data / "sub", data / "again")               # not followed: no file twice
    stats = load_corpus(str(data), cache_dir=str(tmp_path / "cache")).stats
    assert skipped_inputs(stats) == {"files not UTF-8 text": 1,
                                     "symlinked folders (not followed)": 1}
    assert stats["files"] == 41
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "binary.bin").write_bytes(b"\xff\xfe\x00\x81")
    code = train_cli.main([*FAST, "--data", str(empty), "--run-dir", str(tmp_path / "r"),
                           "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "(skipped: 1 files not UTF-8 text)" in err[0], err


def test_keep_checkpoints_and_keep_every_steps(corpus_path, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train_cli.main([*FAST, "--data", corpus_path, "--steps", "6", "--checkpoint-every",
                           "1", "--keep-checkpoints", "1", "--keep-every-steps", "4",
                           "--run-dir", str(run_dir), "--cache-dir",
                           str(tmp_path / "cache")]) == 0
    assert sorted(os.listdir(run_dir / "checkpoints"), key=int) == ["4", "6"]
    capsys.readouterr()


def test_resume_refuses_a_changed_corpus(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(60):
        (data / f"doc{i}.txt").write_text(f"document number {i} says something\n" * 4)
    base = [*FAST, "--data", str(data), "--steps", "2", "--run-dir", str(tmp_path / "run"),
            "--cache-dir", str(tmp_path / "cache")]
    assert train_cli.main(base) == 0
    (data / "new.txt").write_text("a document added after the run\n" * 4)
    capsys.readouterr()
    assert train_cli.main([*base, "--resume", "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.corpus_fingerprint=" in err[0], err


def finished_args(corpus_path, tmp_path):
    """A run of 2 steps logged every step, into ``tmp_path / "run"``."""
    return [*FAST, "--data", corpus_path, "--steps", "2", "--log-every", "1",
            "--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]


@pytest.fixture(scope="module")
def finished(corpus_path, tmp_path_factory):
    """The folder of a finished run (``finished_args``); a test copies it to its own
    ``tmp_path / "run"``."""
    tmp_path = tmp_path_factory.mktemp("finished")
    assert train_cli.main(finished_args(corpus_path, tmp_path)) == 0
    return tmp_path / "run"


def test_resuming_a_finished_run_says_no_steps_ran(finished, corpus_path, tmp_path, capsys):
    shutil.copytree(finished, tmp_path / "run")
    base = finished_args(corpus_path, tmp_path)
    capsys.readouterr()
    assert train_cli.main([*base, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "no steps ran: the run had reached its last step" in out and "nan" not in out


def test_resume_with_more_steps_extends_a_finished_run(finished, corpus_path, tmp_path,
                                                      capsys):
    shutil.copytree(finished, tmp_path / "run")
    base = finished_args(corpus_path, tmp_path)      # its --steps 2: the later flags win
    capsys.readouterr()
    assert train_cli.main([*base, "--steps", "1", "--resume"]) == 2
    assert "steps=1 is below the checkpoint's step 2" in capsys.readouterr().err
    assert train_cli.main([*base, "--steps", "4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "the run's length changed from 2 steps" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["steps_this_run"] == 2
    assert summary["extended_from_steps"] == 2
    assert [r["step"] for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
            if r["kind"] == "train"] == [1, 2, 3, 4]


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_keeps_the_last(
        corpus_path, tmp_path, capsys, monkeypatch):
    """A full disk at the step-6 checkpoint, in orbax's background write (async saving) or in
    its synchronous part: one line naming the step and the kept checkpoint (step 3), exit 2;
    then --resume continues from step 3."""
    import errno

    import orbax.checkpoint as ocp

    save, wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished

    def full_disk():
        return OSError(errno.ENOSPC, "No space left on device")

    for mode, flags in (("background", []), ("synchronous", ["--no-async-checkpoint"])):
        failing = {}

        def failing_save(self, step, *args, **kwargs):
            if step == 6 and mode == "synchronous":
                raise full_disk()
            failing["step"] = step
            return save(self, step, *args, **kwargs)

        def failing_wait(self):
            wait(self)
            if failing.pop("step", None) == 6:
                try:
                    raise full_disk()
                except OSError as e:        # orbax re-raises the thread's error wrapped
                    raise RuntimeError("async save failed") from e

        monkeypatch.setattr(ocp.CheckpointManager, "save", failing_save)
        monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", failing_wait)
        run_dir = tmp_path / mode
        args = [*FAST, "--data", corpus_path, "--steps", "8", "--checkpoint-every", "3",
                "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache"), *flags]
        assert train_cli.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "checkpoint of step 6 could not be written" in err[0], err
        assert "No space left on device" in err[0] and "step 3 is kept" in err[0], err
        monkeypatch.setattr(ocp.CheckpointManager, "save", save)
        monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", wait)
        assert train_cli.main([*args, "--resume"]) == 0
        summary = json.load(open(run_dir / "summary.json"))
        assert summary["steps"] == 8 and summary["steps_this_run"] == 5     # from step 3
        steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")
                 if json.loads(line)["kind"] == "train"]
        assert steps == sorted(set(steps)) and steps[-1] == 8, steps


def test_a_bpe_run_keeps_its_tokenizer_reports_bits_per_byte_and_resumes(corpus_path, tmp_path,
                                                                        capsys):
    import yaml
    from jaxaccel.data.corpus import load_corpus
    from jaxaccel.outputs.export import export
    run_dir, summary_path = tmp_path / "run", tmp_path / "s.json"
    base = [*FAST, "--data", corpus_path, "--tokenizer", "bpe:300", "--steps", "4",
            "--checkpoint-every", "2", "--run-dir", str(run_dir), "--cache-dir",
            str(tmp_path / "cache"), "--json", str(summary_path)]
    assert train_cli.main([*base, "--stop-at", "2"]) == 0
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["data"]["tokenizer"] == "bpe:300" and config["model"]["vocab_size"] == 384
    assert (run_dir / "tokenizer.json").stat().st_size > 1000
    assert train_cli.main([*base, "--resume"]) == 0
    summary = json.loads(summary_path.read_text())
    corpus = load_corpus(corpus_path, tokenizer="bpe:300", cache_dir=str(tmp_path / "cache"))
    ratio = corpus.stats["val_targets"] / corpus.stats["val_text_bytes"]
    assert summary["steps"] == 4 and summary["val_bpb"] > 0
    assert summary["val_bpb"] == pytest.approx(summary["val_loss"] * ratio / math.log(2))
    assert summary["unigram_bpb"] == pytest.approx(corpus.unigram_bits_per_byte())
    exported = export(str(run_dir), str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported.step == 4 and (tmp_path / "out" / "tokenizer.json").is_file()
    assert config["jaxaccel"]["tokenizer"]["fingerprint"] == corpus.tokenizer.fingerprint
    capsys.readouterr()
    assert train_cli.main([*base, "--resume", "--tokenizer", "bpe:290"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.corpus_fingerprint=" in err[0], err
