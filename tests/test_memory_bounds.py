"""Memory bounded before the work: a batch, a sequence or a compiled step that cannot fit the
device's memory (on the CPU, the host's available memory) is one error line naming the setting
that fixes it, before anything large is allocated or compiled. The memory the machine reports is
made small here, so every case is cheap and safe."""

import importlib
import re

import pytest

from experiments import attention, optimizers, remat, train as train_cli
from experiments.common import describe_out_of_memory
from jaxaccel.core import hardware
from jaxaccel.run import loop
from jaxaccel.run.config import parse
from jaxaccel.core.errors import ConfigError

TINY = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--max-seq-len", "32",
        "--seq-len", "32", "--batch-size", "4", "--no-progress"]


def run_args(corpus_path, tmp_path, *more):
    return [*TINY, "--data", corpus_path, "--steps", "1", "--run-dir", str(tmp_path / "run"),
            "--cache-dir", str(tmp_path / "cache"), *more]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def host_memory(monkeypatch):
    """Set the host's available memory (the CPU's device memory too) to a number of bytes."""
    def set_to(nbytes: int):
        monkeypatch.setattr(hardware, "host_memory_bytes", lambda: nbytes)
    return set_to


@pytest.fixture
def no_steps(monkeypatch):
    """The steps that ran (none, where the run was refused before them)."""
    ran = []
    monkeypatch.setattr(loop, "run_steps", lambda *a, **k: ran.append(1))
    return ran


def test_the_host_memory_is_read():
    assert 0 < hardware.host_memory_bytes()
    assert hardware.device_memory_bytes() <= hardware.host_memory_bytes()   # the CPU: the host's


# Class 1: a sequence too long (or a batch too large) for the memory.

def test_a_batch_larger_than_host_memory_is_refused_by_validation(host_memory):
    host_memory(10**6)
    long = parse(["--max-seq-len", "100000", "--batch-size", "16"])
    with pytest.raises(ConfigError, match="one training batch of 16 rows x 100,000 tokens") as e:
        long.validate()
    assert e.value.field == "model.max_seq_len" and "--seq-len" in str(e.value)
    wide = parse(["--seq-len", "256", "--batch-size", "100000"])
    with pytest.raises(ConfigError, match="--batch-size") as e:
        wide.validate()
    assert e.value.field == "data.batch_size"
    parse(["--seq-len", "256", "--batch-size", "16"]).validate()     # 81,920 bytes: fits


def test_attention_scores_beyond_memory_are_refused_before_compiling(
        corpus_path, tmp_path, capsys, host_memory, no_steps, monkeypatch):
    """The CLI case --max-seq-len 100000000 --seq-len 100000000 aborted inside XLA's compiler;
    the scores' bytes are known from the traced forward before anything is compiled."""
    host_memory(500_000)        # the batch fits; 4 x 2 x 512 x 512 float32 scores do not
    compiled = []
    compile_module = importlib.import_module("jaxaccel.run.loop.compile")
    monkeypatch.setattr(compile_module.CompiledFn, "compile",
                        lambda self, *a: compiled.append(1))
    args = run_args(corpus_path, tmp_path, "--max-seq-len", "512", "--seq-len", "512")
    assert train_cli.main(args) == 2
    line = one_line(capsys)
    assert "attention scores" in line and "--seq-len" in line and "--max-seq-len" in line
    assert line.endswith("[--seq-len / data.seq_len]") and not compiled and not no_steps


def test_a_step_larger_than_host_memory_is_refused_before_the_state_is_made(
        corpus_path, tmp_path, capsys, host_memory, no_steps, monkeypatch):
    """On the CPU the compiled step's sizes are checked against the host's memory, from the
    state's shapes, before the state is allocated."""
    host_memory(200_000)        # the batch and the scores fit; parameters + Adam do not
    setup = importlib.import_module("jaxaccel.run.loop.setup")
    made = []
    # the state's initialisation may compile, but never runs
    monkeypatch.setattr(setup, "compile_init", lambda lowered: lambda *args: made.append(1))
    assert train_cli.main(run_args(corpus_path, tmp_path)) == 2
    line = one_line(capsys)
    assert "the train step needs" in line and "this host has 200,000 available" in line
    assert "--batch-size" in line and "--memory-budget 200000" in line
    assert not made and not no_steps


# Class 2: the validation batch, and an experiment's own batch factor.

def test_an_eval_batch_beyond_memory_names_eval_batch_size_before_training(
        corpus_path, tmp_path, capsys, host_memory, no_steps):
    host_memory(10**7)          # a training batch (2,560 bytes) fits, 10**6 rows do not
    assert train_cli.main(run_args(corpus_path, tmp_path, "--eval-batch-size", "1000000")) == 2
    line = one_line(capsys)
    assert "validation batch of 1,000,000 rows" in line
    assert line.endswith("[--eval-batch-size / run.eval_batch_size]") and not no_steps


def test_a_large_batch_factor_beyond_memory_is_refused_before_any_row_trains(
        tmp_path, capsys, host_memory, monkeypatch):
    host_memory(10**6)          # table 1's 8 x 256 rows fit, table 2's 800 x 256 do not
    trained = []
    common = importlib.import_module("experiments.common")
    monkeypatch.setattr(common, "train_until_stopped", lambda cfg: trained.append(cfg))
    code = optimizers.main(["--large-batch-factor", "100", "--optimizers", "adamw",
                            "--large-batch-optimizers", "adamw", "--scalings", "none",
                            "--run-dir", str(tmp_path / "opt")])
    assert code == 2 and not trained
    line = one_line(capsys)
    assert "one training batch of 800 rows" in line
    assert line.endswith("[--large-batch-factor / experiment.large_batch_factor]"), line


# Class 3: the remat experiment's own largest-batch probes.

def test_a_remat_probe_out_of_memory_names_the_experiments_setting(capsys, monkeypatch):
    class JaxRuntimeError(Exception):       # the name jax's allocation failures carry
        pass

    real = remat.compile_step

    def compile_step(step, state, rows, seq_len):
        if rows > 1:
            raise JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return real(step, state, rows, seq_len)

    # Batch 1: the row's one real compile; the search's first probe beyond it runs out.
    monkeypatch.setattr(remat, "compile_step", compile_step)
    code = remat.main(["--policies", "none", "--no-scan-rows", "--n-layers", "1", "--d-model",
                       "32", "--n-heads", "2", "--seq-len", "16", "--batch-size", "1",
                       "--timed-steps", "1", "--max-batch-limit", "64"])
    line = one_line(capsys)
    assert code == 2 and "--max-batch-limit" in line and "--accumulate" not in line
    assert line.endswith("[--max-batch-limit / experiment.max_batch_limit]")


# Class 4: attention lengths whose inputs and outputs cannot fit.

ATTENTION = ["--head-dims", "16", "--heads", "2", "--impls", "xla", "--layouts", "dense",
             "--causal", "causal", "--batch", "1", "--warmup", "0", "--iters", "1"]


@pytest.mark.parametrize("flags, flag", [
    (["--seq-lens", "512"], "--seq-lens"),
    (["--seq-lens", "64", "--max-t-limit", "1024"], "--max-t-limit")])
def test_attention_lengths_beyond_memory_are_refused(capsys, monkeypatch, flags, flag):
    monkeypatch.setattr(hardware, "device_memory_bytes", lambda device=None: 1_000_000)
    timed = []
    monkeypatch.setattr(attention, "median_seconds", lambda *a: timed.append(1) or 1.0)
    assert attention.main([*ATTENTION, *flags]) == 2      # T=64 fits, 512 not (its scores)
    line = one_line(capsys)
    bound = int(re.search(rf"pass {flag} of at most ([\d,]+)", line)[1].replace(",", ""))
    assert 64 < bound < 512 and f"[{flag} /" in line and not timed    # test_experiment_bounds


# Class 5: the final evaluation out of memory.

def test_final_eval_out_of_memory_names_the_evaluations_settings(corpus_path, tmp_path, capsys,
                                                                  monkeypatch):
    finish = importlib.import_module("jaxaccel.run.loop.finish")

    def out_of_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 954. GiB for an array")

    monkeypatch.setattr(finish, "run_eval", out_of_memory)
    assert train_cli.main(run_args(corpus_path, tmp_path, "--eval-every", "0")) == 2
    line = one_line(capsys)
    assert "out of memory in the final evaluation" in line
    assert "--eval-batch-size" in line and "--final-eval-batches" in line
    assert "--batch-size" not in line.replace("--eval-batch-size", "")
    # elsewhere the line stays the general one
    assert "--batch-size" in describe_out_of_memory(MemoryError("x"))
