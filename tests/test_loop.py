"""The training loop end to end on a small JSONL corpus: summary, resume, signals, bad input."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.train import main
from jaxaccel.config import build, override, parse
from jaxaccel.errors import ConfigError
from jaxaccel.loop import train
from jaxaccel.optim import DEFAULTS

SMALL_MODEL = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--max-seq-len", "32"]


def small_config(corpus_path, tmp_path, name="run", **overrides):
    """A small run's config; ``overrides`` by field name (``batching="pack"``)."""
    values = {"gpt.d_model": 32, "gpt.n_layers": 2, "gpt.n_heads": 4,
              "model.max_seq_len": 32, "data.path": corpus_path, "data.seq_len": 32,
              "data.batch_size": 4, "run.steps": 8, "optimizer.warmup_steps": 2,
              "run.eval_every": 4, "run.eval_batches": 2, "run.log_every": 2,
              "run.checkpoint_every": 3, "run.progress": False,
              "run.run_dir": str(tmp_path / name), "data.cache_dir": str(tmp_path / "cache")}
    paths = {path.partition(".")[2]: path for path in values}
    paths.update(batching="data.batching", buckets="data.buckets",
                 pad_multiple="data.pad_multiple", tokens_per_batch="data.tokens_per_batch",
                 train_tokens="run.train_tokens", resume="run.resume", stop_at="run.stop_at",
                 save_checkpoints="run.save_checkpoints", optimizer="optimizer.name",
                 lr_scaling="optimizer.lr_scaling", base_batch_size="optimizer.base_batch_size",
                 accumulate="optimizer.accumulate", optimizer_state_dtype="optimizer.state_dtype",
                 precision="precision.policy", loss_scale_init="precision.init_scale",
                 loss_scale_growth_interval="precision.growth_interval",
                 tokenizer="data.tokenizer")
    return build(values={**values, **{paths[k]: v for k, v in overrides.items()}})


def final_state(run_dir, step):
    return ocp.StandardCheckpointer().restore(os.path.join(run_dir, "checkpoints", str(step), "state"))


def test_summary_metrics_and_artifacts(corpus_path, tmp_path):
    summary = train(small_config(corpus_path, tmp_path))
    assert summary.real_tokens_per_s > 0 and summary.wall_s > 0 and summary.unigram_bpb > 0
    assert summary.steps == 8 and summary.compiles == 1 and summary.interrupted is None
    assert 0 < summary.padding_efficiency <= 1 and summary.real_tokens_per_s > 0
    assert np.isfinite(summary.val_bpb) and summary.val_tokens > 0
    run_dir = summary.run_dir
    # The resolved config and the command line: --config repeats the run.
    assert parse(["--config", os.path.join(run_dir, "config.yaml")]) == \
        small_config(corpus_path, tmp_path)
    assert open(os.path.join(run_dir, "command.txt")).read() == shlex.join(sys.orig_argv) + "\n"
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6, 8]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4, 8]
    assert os.path.getsize(os.path.join(run_dir, "loss.png")) > 1000
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["6", "8"]


def test_a_target_ends_the_run_at_the_first_evaluation_that_reaches_it(corpus_path, tmp_path):
    """run.target_bpb (time to quality): the run ends at the first periodic evaluation at or
    below the target, reports where, and evaluates those batches once; an unreachable target
    trains to the end and says it was not reached."""
    full = train(small_config(corpus_path, tmp_path, "full", steps=12, eval_every=2))
    evals = [json.loads(line) for line in open(os.path.join(full.run_dir, "metrics.jsonl"))
             if '"eval"' in line]
    # the target: between the 2nd and the 3rd periodic evaluation's bits per byte
    second, third = evals[1]["bpb"], evals[2]["bpb"]
    assert third < second
    target = (second + third) / 2
    cfg = small_config(corpus_path, tmp_path, "target", steps=12, eval_every=2)
    summary = train(override(cfg, {"run.target_bpb": target, "run.final_eval_batches": 2}))
    assert summary.target["reached"] and summary.target["step"] == 6 == summary.steps
    assert summary.target["val_bpb"] == pytest.approx(third) == summary.val_bpb
    assert summary.stopped_at is None and summary.interrupted is None
    assert summary.total_steps == 12 and 0 < summary.target["train_s"] <= summary.train_s
    records = [json.loads(line) for line in open(os.path.join(summary.run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4, 6]
    missed = train(override(small_config(corpus_path, tmp_path, "missed", steps=4, eval_every=2),
                            {"run.target_bpb": 0.01}))
    assert not missed.target["reached"] and missed.steps == missed.target["step"] == 4
    gave_up = train(override(small_config(corpus_path, tmp_path, "gave-up", steps=8,
                                          eval_every=2),
                             {"run.target_bpb": 0.01, "run.target_seconds": 1e-9}))
    assert gave_up.target["step"] == 2 == gave_up.steps and not gave_up.target["reached"]
    assert gave_up.target["gave_up_after_s"] > 0 and gave_up.stopped_at is None
    with pytest.raises(ConfigError, match="eval_every"):
        override(cfg, {"run.target_bpb": 1.0, "run.eval_every": 0}).validate()


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(corpus_path, tmp_path):
    # 20 steps cut at 19: the summary's train bits per byte covers the last tenth (steps 19 and
    # 20), so the resumed run needs step 19's loss, logged by neither run (log_every 2) but kept
    # in the checkpoint.
    # The cut is --stop-at's pause (should_stop, a signal's path, is cut in the next test).
    whole = train(small_config(corpus_path, tmp_path, "whole", steps=20))
    cut = train(small_config(corpus_path, tmp_path, "cut", steps=20, stop_at="19"))
    assert cut.interrupted is None and cut.stopped_at == cut.steps == 19
    assert cut.total_steps == 20 and np.isnan(cut.val_bpb) and cut.diverged_at_step is None
    config = parse(["--config", os.path.join(cut.run_dir, "config.yaml")])
    assert config.run.stop_at is None       # the pause is not written into the run's config
    with pytest.raises(ConfigError, match="stop_at 1/2 is step 10, but the run resumes from "
                                          "step 19"):
        train(small_config(corpus_path, tmp_path, "cut", steps=20, resume=True, stop_at="1/2"))
    resumed = train(small_config(corpus_path, tmp_path, "cut", steps=20, resume=True))
    assert resumed.steps == 20 and resumed.steps_this_run == 1
    a, b = final_state(whole.run_dir, 20), final_state(resumed.run_dir, 20)
    assert len(jax.tree.leaves(a)) > 10
    chex.assert_trees_all_equal(a, b)
    assert resumed.val_bpb == whole.val_bpb
    assert resumed.train_bpb == whole.train_bpb


@pytest.mark.parametrize("save", [True, False])
def test_sigterm_saves_a_checkpoint_and_exits(save, corpus_path, tmp_path):
    """SIGTERM: the step finishes, a checkpoint is saved (none with --no-save-checkpoints, and
    the line says the run cannot be continued), exit 143."""
    run_dir = tmp_path / "signalled"
    cmd = [sys.executable, "-m", "experiments.train", *SMALL_MODEL, "--data", corpus_path,
           "--seq-len", "32", "--batch-size", "4", "--steps", "100000", "--log-every", "1",
           "--eval-every", "0", "--checkpoint-every", "0", "--no-progress",
           "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache"),
           *([] if save else ["--no-save-checkpoints"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size > 0):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err
    steps = os.listdir(run_dir / "checkpoints")
    if save:
        assert "--resume" in err
        assert len(steps) == 1 and int(steps[0]) >= 1
    else:
        assert "no checkpoint written" in err and "--resume" not in err
        assert steps == [] and (run_dir / "metrics.jsonl").stat().st_size > 0


def test_without_checkpoints_a_run_saves_none_and_trains_the_same(corpus_path, tmp_path):
    """run.save_checkpoints off: no checkpoint, periodic or final; the same losses."""
    saved = train(small_config(corpus_path, tmp_path, "saved"))
    unsaved = train(small_config(corpus_path, tmp_path, "unsaved", save_checkpoints=False))
    assert os.listdir(os.path.join(unsaved.run_dir, "checkpoints")) == []
    assert os.listdir(os.path.join(saved.run_dir, "checkpoints"))
    assert unsaved.steps == saved.steps == 8 and unsaved.val_loss == saved.val_loss


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize("args,message", [
    (["--data", "/no/such/path"], "does not exist"),
    (["--n-heads", "5"], "n_heads=5 does not divide d_model=32"),
    (["--n-kv-heads", "3"], "n_kv_heads=3 does not divide n_heads=4"),
    (["--seq-len", "64"], "seq_len=64 exceeds the model context max_seq_len=32"),
    (["--batch-size", "0"], "batch_size must be at least 1"),
    (["--batching", "bucket", "--tokens-per-batch", "16", "--pad-multiple", "8"],
     "smaller than the longest bucket row"),
    (["--batching", "bucket", "--buckets", "0"], "buckets must be an integer in [1, 1024]"),
    (["--batching", "dynamic", "--pad-multiple", "0"], "pad_multiple must be at least 1"),
    (["--batching", "dynamic", "--tokens-per-batch", "256"], "not tokens_per_batch"),
    (["--batch-size", "6", "--accumulate", "4"], "does not split into accumulate=4"),
    (["--no-decay", "norm,(oops"], "bad parameter-path pattern"),
    (["--learning-rate", "-1"], "learning_rate must be a finite number > 0"),
    (["--accumulate", "0"], "accumulate must be at least 1"),
    (["--num-devices", "3"], "num_devices=3 is not available"),
    (["--final-eval-batches", "0"], "final_eval_batches must be at least 1"),
    (["--precision", "fp4"], "unknown precision 'fp4'"),
    (["--token-keep", "0.5"], "would drop no tokens"),
    (["--sampling", "loss", "--batching", "pack"], "draws rows of fixed batching"),
    (["--precision", "params=float32,compute=int8,output=float32"], "unknown dtype 'int8'"),
    (["--loss-scale", "dynamic", "--loss-scale-backoff", "2"], "backoff must be in (0, 1)"),
    (["--stop-at", "3/2"], "stop_at '3/2' is neither a step number nor a share"),
    (["--stop-at", "5"], "stop_at 5 is beyond the run's 2 steps"),
    (["--stop-at", "1", "--no-save-checkpoints"], "save_checkpoints is off"),
])
def test_bad_input_is_one_error_line_with_exit_code_2(args, message, corpus_path, tmp_path,
                                                      capsys):
    base = [*SMALL_MODEL, "--data", corpus_path, "--steps", "2", "--no-progress",
            "--run-dir", str(tmp_path / "bad"), "--cache-dir", str(tmp_path / "cache")]
    code, err = run_cli(base + args, capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_empty_corpus_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("  \n")
    code, err = run_cli(["--data", str(empty), "--run-dir", str(tmp_path / "r"),
                         "--cache-dir", str(tmp_path / "cache")], capsys)
    assert code == 2 and len(err) == 1 and "no non-empty documents" in err[0]


def test_checkpoint_problems_on_resume_are_errors(corpus_path, tmp_path, capsys):
    base = [*SMALL_MODEL, "--data", corpus_path, "--seq-len", "32", "--batch-size", "4",
            "--steps", "3", "--eval-every", "0", "--no-progress", "--run-dir",
            str(tmp_path / "r"), "--cache-dir", str(tmp_path / "cache")]
    assert main(base) == 0
    capsys.readouterr()
    code, err = run_cli(base, capsys)
    assert code == 2 and "already holds checkpoints; set resume" in err[0]
    assert err[0].endswith("[--resume / run.resume]")
    code, err = run_cli(base + ["--resume", "--d-model", "64"], capsys)
    assert code == 2 and len(err) == 1 and "written with other settings: gpt.d_model=32" in err[0]
    code, err = run_cli([*base, "--resume", "--run-dir", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "no checkpoint in" in err[0]
    state_dir = tmp_path / "r" / "checkpoints" / "3" / "state"
    for root, _, files in os.walk(state_dir):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    code, err = run_cli(base + ["--resume"], capsys)
    assert code == 2 and len(err) == 1 and "is unreadable" in err[0], err


def test_cli_exit_code_and_no_traceback_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--n-heads", "3", "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: n_heads=3 does not divide d_model=256; choose n_heads dividing d_model "
        "[--n-heads / gpt.n_heads]"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("strategy,extra", [
    ("dynamic", dict(pad_multiple=8)),
    ("bucket", dict(buckets=3, pad_multiple=8, batch_size=None, tokens_per_batch=96)),
    ("pack", {}),
])
def test_every_shape_compiles_in_warm_up_and_never_after(strategy, extra, corpus_path, tmp_path):
    cfg = small_config(corpus_path, tmp_path, strategy, batching=strategy, steps=12,
                       checkpoint_every=0, **extra)
    summary = train(cfg)
    assert summary.compiles == len(summary.shapes) >= 1
    assert summary.compiles_after_warmup == 0
    if strategy == "pack":
        assert summary.shapes == [[4, 32]]
        assert summary.padding_efficiency > 0.9
    assert summary.data_wait_s >= 0 and np.isfinite(summary.val_bpb)


@pytest.mark.parametrize("strategy,extra", [
    ("pack", {}),
    ("bucket", dict(buckets=3, pad_multiple=8, tokenizer="bpe:300")),   # mid-epoch, BPE ids
])
def test_resume_is_bitwise_with_other_strategies(strategy, extra, corpus_path, tmp_path):
    make = lambda name, **kw: small_config(corpus_path, tmp_path, name, batching=strategy,
                                           eval_every=0, checkpoint_every=0, **extra, **kw)
    whole = train(make("whole"))
    train(make("cut"), should_stop=lambda step: step == 3)
    resumed = train(make("cut", resume=True))
    chex.assert_trees_all_equal(final_state(whole.run_dir, 8), final_state(resumed.run_dir, 8))


def test_train_tokens_sets_the_number_of_steps(corpus_path, tmp_path):
    summary = train(small_config(corpus_path, tmp_path, batching="pack", steps=1000,
                                 train_tokens=4 * 32 * 5, checkpoint_every=0, eval_every=0))
    assert 5 <= summary.steps <= 6
    assert summary.real_tokens >= 0.9 * 4 * 32 * 5


def test_optimizer_flags_reach_the_run(corpus_path, tmp_path):
    summary = train(small_config(corpus_path, tmp_path, optimizer="lion", batch_size=8,
                                 lr_scaling="sqrt", base_batch_size=2, accumulate=2,
                                 optimizer_state_dtype="bfloat16", checkpoint_every=0))
    lion = DEFAULTS["lion"]
    assert summary.learning_rate == pytest.approx(lion.learning_rate * 2.0)
    assert summary.weight_decay == lion.weight_decay
    assert summary.optimizer == "lion" and summary.accumulate == 2
    # Lion keeps one moment: in bfloat16 it takes half the parameters' float32 bytes.
    assert summary.optimizer_state_bytes == pytest.approx(summary.params * 2, rel=0.01)
    assert np.isfinite(summary.val_bpb)
    records = [json.loads(line) for line in open(os.path.join(summary.run_dir, "metrics.jsonl"))]
    assert all(r["update_norm"] > 0 for r in records if r["kind"] == "train")


def test_accumulation_trains_like_the_whole_batch(corpus_path, tmp_path):
    """--accumulate 4 runs the same updates as the whole batch: the final losses agree."""
    common = dict(optimizer="sgd", batching="pack", eval_every=0, checkpoint_every=0)
    whole = train(small_config(corpus_path, tmp_path, "whole", **common))
    split = train(small_config(corpus_path, tmp_path, "split", accumulate=4, **common))
    assert split.val_loss == pytest.approx(whole.val_loss, rel=1e-5)
    assert split.step_memory_bytes["temp"] < whole.step_memory_bytes["temp"]


def test_fp16_resume_restores_the_loss_scale_bitwise(corpus_path, tmp_path):
    """The dynamic loss scale is part of the checkpoint: a cut and resumed fp16 run ends equal
    to an uninterrupted one, scale and growth counter included."""
    make = lambda name, **kw: small_config(corpus_path, tmp_path, name, precision="fp16",  # noqa: E731
                                           loss_scale_init=4.0, loss_scale_growth_interval=2,
                                           eval_every=0,
                                           checkpoint_every=0, **kw)
    whole = train(make("whole"))
    assert whole.precision == "fp16" and whole.loss_scale == 4.0 * 2**4   # grew 4 times
    train(make("cut"), should_stop=lambda step: step == 3)
    cut_state = final_state(str(tmp_path / "cut"), 3)
    assert int(cut_state["loss_scale"]["growth_tracker"]) == 1
    resumed = train(make("cut", resume=True))
    a, b = final_state(whole.run_dir, 8), final_state(resumed.run_dir, 8)
    assert float(a["loss_scale"]["scale"]) == whole.loss_scale
    chex.assert_trees_all_equal(a, b)


def test_partial_evaluation_spreads_its_batches_over_the_split():
    """``max_batches`` takes batches from the whole split (first and last included), not its
    first files; without it every batch counts."""
    from jaxaccel.loop import evaluate
    documents = [np.full(10, i + 1, dtype=np.int32) for i in range(20)]   # 20 one-row batches
    seen = []

    def eval_step(state, batch):
        seen.append(int(np.asarray(batch["inputs"])[0, 0]))
        return {"loss_sum": 0.0, "weight_sum": 1.0}

    evaluate(eval_step, None, documents, seq_len=16, batch_size=1, max_batches=3)
    assert seen[0] == 1 and seen[-1] == 20 and len(seen) == 3
    seen.clear()
    evaluate(eval_step, None, documents, seq_len=16, batch_size=1)
    assert sorted(seen) == list(range(1, 21))


def test_a_log_step_fetches_the_window_before_so_the_device_queue_never_drains(
        corpus_path, tmp_path, monkeypatch):
    """At log step k the loop writes the window that ended at the log step before (done on the
    device by then), not the one it has just dispatched; the rest is written at the end."""
    from jaxaccel import compiled
    from jaxaccel.loop import run as run_phase
    events = []
    log_window, call = run_phase.log_window, compiled.CompiledFn.__call__

    def logged(writer, step, *args):
        events.append(("log", step))
        return log_window(writer, step, *args)

    def dispatched(self, *args):
        if len(args) == 2 and "inputs" in args[1] and "targets" in args[1]:
            events.append(("step", None))
        return call(self, *args)

    monkeypatch.setattr(run_phase, "log_window", logged)
    monkeypatch.setattr(compiled.CompiledFn, "__call__", dispatched)
    train(small_config(corpus_path, tmp_path, eval_every=0, checkpoint_every=0, steps=8))
    order = [step if kind == "log" else "s" for kind, step in events]
    # steps (train and the final evaluation's) in order; each window written one log step late
    assert order[:10] == ["s", "s", "s", "s", 2, "s", "s", 4, "s", "s"], order
    assert [x for x in order if x != "s"] == [2, 4, 6, 8]
