"""A run remembers its own model (issue 51): the factory's file by its absolute path and the
sha256 of its source (config.yaml, every checkpoint), so sampling works from any directory;
experiments.sample and export find a moved file with --model; a changed source is one warning
line; a checkpoint that no longer fits the model is one line naming the parameters that differ,
exit 2, every checkpoint kept (resume, sample, --init-from).

One 2-step run of examples/tiny_lm.py (width 16, one block), named by a relative path as the
README does, serves every test; a test that changes the model file puts it back, and one that
resumes works on a copy of the run."""

import contextlib
import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest
import yaml

from experiments.export import main as export_main
from experiments.sample import main as sample_main
from experiments.train import main as train_main
from jaxaccel.run.checkpoint import Checkpointer, CheckpointMisfit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_LM = os.path.join(REPO, "examples", "tiny_lm.py")
TRAIN = ["--model", "m/tiny_lm.py:make", "--model-args", "width: 16, depth: 1", "--seq-len", "16",
         "--batch-size", "2", "--eval-every", "0", "--final-eval-batches", "1", "--no-progress",
         "--no-loss-plot"]
SAMPLE = ["--prompt", "x", "--max-new-tokens", "2", "--warmup", "0", "--no-check-logits"]


@contextlib.contextmanager
def cwd(path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def edited(path, edit):
    """``path``'s text changed by ``edit`` while inside, then as it was."""
    with open(path) as f:
        original = f.read()
    changed = edit(original)
    assert changed != original
    with open(path, "w") as f:
        f.write(changed)
    try:
        yield
    finally:
        with open(path, "w") as f:
            f.write(original)


@contextlib.contextmanager
def moved(path, to):
    os.renames(path, to)
    try:
        yield
    finally:
        os.renames(to, path)


def narrower_mlp(text: str) -> str:
    """tiny_lm.py with an MLP of twice the width, not four times: fc1 and fc2 change shape (the
    comment changes the file's size, so Python never takes its cached bytecode for it)."""
    return text.replace("4 * width", "2 * width") + "\n# the MLP made narrower\n"


class Run:
    def __init__(self, project, corpus_path, cache):
        self.project, self.corpus_path, self.cache = project, corpus_path, cache
        self.dir = str(project / "runs" / "r")
        self.file = str(project / "m" / "tiny_lm.py")

    def train(self, *args) -> int:
        """experiments.train from the project's folder, with the run's settings."""
        with cwd(self.project):
            return train_main([*TRAIN, "--data", self.corpus_path, "--cache-dir", self.cache,
                               *args])


@pytest.fixture(scope="module")
def run(corpus_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("model_file")
    (root / "proj" / "m").mkdir(parents=True)
    shutil.copy(TINY_LM, root / "proj" / "m" / "tiny_lm.py")
    trained = Run(root / "proj", corpus_path, str(root / "cache"))
    assert trained.train("--steps", "2", "--run-dir", "runs/r") == 0
    return trained


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    return err


def files_under(path) -> list:
    return sorted((os.path.relpath(root, path), sorted(names))
                  for root, _, names in os.walk(path))


def test_the_run_records_its_model_file_by_absolute_path_and_source_hash(run):
    with open(os.path.join(run.dir, "config.yaml")) as f:
        assert yaml.safe_load(f)["model"]["name"] == f"{run.file}:make"
    with open(os.path.join(run.dir, "checkpoints", "2", "meta", "metadata")) as f:
        recorded = json.load(f)["config"]
    with open(run.file, "rb") as f:
        source = hashlib.sha256(f.read()).hexdigest()
    assert recorded["model.name"] == f"{run.file}:make"
    assert recorded["model.source"] == {"file": run.file, "sha256": source}


def test_sampling_from_another_directory_finds_the_model(run, tmp_path, capsys):
    """The README's relative --model, sampled from another folder (it was stored as typed)."""
    with cwd(tmp_path):
        assert sample_main(["--run-dir", run.dir, *SAMPLE]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_moved_model_file_is_named_and_found_with_model(run, tmp_path, capsys):
    elsewhere = str(tmp_path / "elsewhere" / "tiny_lm.py")
    with moved(run.file, elsewhere):
        for main, args in ((sample_main, SAMPLE), (export_main, ["--out", str(tmp_path / "x")])):
            assert main(["--run-dir", run.dir, *args]) == 2
            err = error_line(capsys)
            assert f"whose file {run.file} no longer exists; pass --model FILE.py:make" in err
            assert err.endswith("[--model / experiment.model]")
        assert not os.path.exists(tmp_path / "x")
        assert sample_main(["--run-dir", run.dir, *SAMPLE, "--model", f"{elsewhere}:make"]) == 0
        assert export_main(["--run-dir", run.dir, "--out", str(tmp_path / "exported"),
                            "--model", f"{elsewhere}:make"]) == 0
        assert "warning" not in capsys.readouterr().err         # the same source, moved
        with open(tmp_path / "exported" / "config.json") as f:    # where the model is now
            assert json.load(f)["train_config"]["model"]["name"] == f"{elsewhere}:make"


def test_model_for_a_preset_or_a_missing_file_is_one_line(run, tmp_path, capsys):
    for given, message in (("tiny", "--model tiny points at where a run's own factory"),
                           (f"{tmp_path}/none.py:make", "none.py does not exist")):
        assert sample_main(["--run-dir", run.dir, *SAMPLE, "--model", given]) == 2
        err = error_line(capsys)
        assert message in err and err.endswith("[--model / experiment.model]"), err


def test_a_changed_source_is_one_warning_line(run, tmp_path, capsys):
    """Sample and resume read a run whose model file changed but still fits: a warning naming
    the file, then the work."""
    copy = str(tmp_path / "r")
    shutil.copytree(run.dir, copy)
    with edited(run.file, lambda text: text + "\n# an edit after training\n"):
        assert sample_main(["--run-dir", run.dir, *SAMPLE]) == 0
        assert run.train("--steps", "3", "--run-dir", copy, "--resume") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 2, warnings
    for line, where in zip(warnings, (run.dir, copy)):
        assert line.startswith(f"warning: model file {run.file} is not the source run {where} "
                               f"trained with: sha256 "), line
        assert "its checkpoint fits" in line and "restore the file" in line


def test_changed_shapes_name_the_parameters_and_keep_every_checkpoint(run, tmp_path, capsys):
    """The model file changed its parameters' shapes since training: resume, sample and
    --init-from each refuse in one line naming the parameters, the file and the fix; nothing
    is deleted (the line used to call the checkpoint unreadable and suggest deleting it)."""
    copy = str(tmp_path / "r")
    shutil.copytree(run.dir, copy)
    before = files_under(copy)
    with edited(run.file, narrower_mlp):
        assert run.train("--steps", "3", "--run-dir", copy, "--resume") == 2
        err = error_line(capsys)
        assert err.startswith(f"error: checkpoint {copy}/checkpoints/2 does not fit the model "
                              f"{run.file}:make (its source changed since the run trained): "
                              f"3 parameters differ in shape (blocks/layers/0/fc1/bias: "
                              f"checkpoint (64,), model (32,); blocks/layers/0/fc1/kernel: "
                              f"checkpoint (16, 64), model (16, 32); "), err
        assert f"every other checkpoint in {copy}/checkpoints are intact" in err
        assert f"restore {run.file} as it was when the run trained, or start a new run_dir" in err
        assert err.endswith("[--run-dir / run.run_dir]") and "delete" not in err
        assert files_under(copy) == before

        assert sample_main(["--run-dir", run.dir, *SAMPLE]) == 2
        err = error_line(capsys)
        assert "does not fit the model" in err and "point --model at the file it trained" in err
        assert err.endswith("[--model / experiment.model]")

        assert run.train("--steps", "2", "--run-dir", str(tmp_path / "tuned"), "--init-from",
                         run.dir, "--lora-rank", "2") == 2
        err = error_line(capsys)
        assert f"checkpoint {run.dir}/checkpoints/2 does not fit" in err
        assert err.endswith("or pass another run as init_from [--init-from / run.init_from]")


def test_init_from_a_run_whose_model_file_is_gone_reads_it_with_its_own_model(run, tmp_path,
                                                                               capsys):
    """--init-from a run whose model file has moved takes this run's --model instead, saying
    so; here that file's MLP is narrower, so the base's checkpoint does not fit it."""
    elsewhere = tmp_path / "elsewhere" / "m"
    with moved(run.file, str(elsewhere / "tiny_lm.py")):
        with edited(elsewhere / "tiny_lm.py", narrower_mlp), cwd(elsewhere.parent):
            assert train_main([*TRAIN, "--data", run.corpus_path, "--cache-dir", run.cache,
                               "--steps", "2", "--run-dir", str(tmp_path / "tuned"),
                               "--init-from", run.dir, "--lora-rank", "2"]) == 2
    note, err = capsys.readouterr().err.strip().splitlines()[-2:]
    assert note == (f"note: run {run.dir} trained the model {run.file}:make, whose file is gone; "
                    f"its checkpoint is read with this run's model m/tiny_lm.py:make")
    assert err.startswith(f"error: checkpoint {run.dir}/checkpoints/2 does not fit the model "
                          f"m/tiny_lm.py:make (its source changed since the run trained): ")


def test_check_fits_names_what_differs_and_what_is_only_on_one_side(tmp_path):
    """The library's check: the first three parameters that differ and how many more, then a
    parameter renamed (only in the checkpoint, only in the model); restore says the same. A
    typed PRNG key (a dropout's stream), stored as its key data, fits its key."""
    def state(renamed: bool, width: int):
        params = {f"layer{i}": {"kernel": np.zeros((2, width), np.float32)} for i in range(5)}
        params["new" if renamed else "old"] = {"bias": np.zeros(3, np.float32)}
        params["drop"] = {"key": jax.random.key(0)}
        return {"params": params, "step": np.zeros((), np.int32)}

    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.save(1, state(False, 4), loader_position={}, config={})
    checkpointer.wait()
    checkpointer.check_fits(state(False, 4), 1)
    with pytest.raises(CheckpointMisfit) as raised:
        checkpointer.restore(state(True, 6), config={}, model="the model m.py:make")
    message = str(raised.value)
    assert message.startswith(f"checkpoint {tmp_path}/1 does not fit the model m.py:make: 5 "
                              f"parameters differ in shape (layer0/kernel: checkpoint (2, 4), "
                              f"model (2, 6); layer1/kernel: ")
    assert "; and 2 more); 1 parameter is only in the checkpoint (old/bias); 1 parameter is " \
           "only in the model (new/bias); it and every other checkpoint" in message
    assert raised.value.field == "run.run_dir" and "delete" not in message
    checkpointer.close()
