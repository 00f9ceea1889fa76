"""The training loop end to end on a small JSONL corpus: summary, resume, signals, bad input.

A ``train()`` call costs seconds of tracing and compiling, so most tests read runs trained once
for the module: ``whole`` (the small config, 20 steps), ``unsaved`` (the same without
checkpoints) and ``strategy_runs`` (pack and bucket batching, whole, cut and resumed). A test
that trains a run of its own keeps the programs of one of them where it can (the run-wide
compilation cache then serves them)."""

import json
import os
import shlex
import shutil
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
from jaxaccel.run.config import build, override, parse
from jaxaccel.core.errors import ConfigError
from jaxaccel.run.loop import train
from jaxaccel.step.optim import DEFAULTS

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


def like(cfg, run_dir, **values):
    """``cfg`` writing into ``run_dir``, with ``values`` by field path: the same programs as a
    run of ``cfg``, which the compilation cache then serves."""
    return override(cfg, {"run.run_dir": str(run_dir), **values})


def records_of(run_dir, kind):
    """The steps of the ``kind`` records ("train", "eval") in the run's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="module")
def whole(corpus_path, tmp_path_factory):
    """(config, summary) of one uninterrupted run of the small config with one layer (what the
    tests read does not depend on the depth): 20 steps, evaluated every 4, logged every 2, a
    checkpoint every 8. The summary, target, resume, no-checkpoint, checkpoint-problem,
    accumulation and log-step tests read it or train its config again."""
    cfg = small_config(corpus_path, tmp_path_factory.mktemp("whole"), steps=20,
                       checkpoint_every=8, n_layers=1)
    return cfg, train(cfg)


@pytest.fixture(scope="module")
def unsaved(whole, tmp_path_factory):
    """The whole run again without checkpoints (run.save_checkpoints off) and with a target it
    cannot reach (0.01 bits per byte): the no-checkpoint test and the target test read it."""
    cfg, _ = whole
    return train(like(cfg, tmp_path_factory.mktemp("unsaved"),
                      **{"run.save_checkpoints": False, "run.target_bpb": 0.01}))


def test_summary_metrics_and_artifacts(whole):
    cfg, summary = whole
    assert summary.real_tokens_per_s > 0 and summary.wall_s > 0 and summary.unigram_bpb > 0
    assert summary.steps == 20 and summary.compiles == 1 and summary.interrupted is None
    assert 0 < summary.padding_efficiency <= 1 and summary.real_tokens_per_s > 0
    assert np.isfinite(summary.val_bpb) and summary.val_tokens > 0
    run_dir = summary.run_dir
    # The resolved config and the command line: --config repeats the run.
    assert parse(["--config", os.path.join(run_dir, "config.yaml")]) == cfg
    assert open(os.path.join(run_dir, "command.txt")).read() == shlex.join(sys.orig_argv) + "\n"
    assert records_of(run_dir, "train") == list(range(2, 21, 2))
    assert records_of(run_dir, "eval") == [4, 8, 12, 16, 20]
    assert os.path.getsize(os.path.join(run_dir, "loss.png")) > 1000
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["16", "20"]


def test_a_target_ends_the_run_at_the_first_evaluation_that_reaches_it(whole, unsaved,
                                                                        tmp_path):
    """run.target_bpb (time to quality): the run ends at the first periodic evaluation at or
    below the target, reports where, and evaluates those batches once; an unreachable target
    trains to the end and says it was not reached (the ``unsaved`` run's); with
    run.target_seconds the run gives up at the first evaluation after them."""
    cfg, full = whole
    evals = [json.loads(line) for line in open(os.path.join(full.run_dir, "metrics.jsonl"))
             if '"eval"' in line]
    # the target: between the 2nd and the 3rd periodic evaluation's bits per byte (steps 8, 12)
    second, third = evals[1]["bpb"], evals[2]["bpb"]
    assert third < second
    target = (second + third) / 2
    summary = train(like(cfg, tmp_path / "target",
                         **{"run.target_bpb": target, "run.final_eval_batches": 2}))
    assert summary.target["reached"] and summary.target["step"] == 12 == summary.steps
    assert summary.target["val_bpb"] == pytest.approx(third) == summary.val_bpb
    assert summary.stopped_at is None and summary.interrupted is None
    assert summary.total_steps == 20 and 0 < summary.target["train_s"] <= summary.train_s
    assert records_of(summary.run_dir, "eval") == [4, 8, 12]
    assert not unsaved.target["reached"] and unsaved.steps == unsaved.target["step"] == 20
    gave_up = train(like(cfg, tmp_path / "gave-up",
                         **{"run.target_bpb": 0.01, "run.target_seconds": 1e-9}))
    assert gave_up.target["step"] == 4 == gave_up.steps and not gave_up.target["reached"]
    assert gave_up.target["gave_up_after_s"] > 0 and gave_up.stopped_at is None
    with pytest.raises(ConfigError, match="eval_every"):
        override(cfg, {"run.target_bpb": 1.0, "run.eval_every": 0}).validate()


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(whole, tmp_path):
    # 20 steps cut at 19: the summary's train bits per byte covers the last tenth (steps 19 and
    # 20), so the resumed run needs step 19's loss, logged by neither run (log_every 2) but kept
    # in the checkpoint.
    # The cut is --stop-at's pause (should_stop, a signal's path, is cut in the strategy runs).
    cfg, whole_run = whole
    cut_cfg = like(cfg, tmp_path / "cut")
    cut = train(override(cut_cfg, {"run.stop_at": "19"}))
    assert cut.interrupted is None and cut.stopped_at == cut.steps == 19
    assert cut.total_steps == 20 and np.isnan(cut.val_bpb) and cut.diverged_at_step is None
    # the checkpoint keeps the last tenth's losses, steps 18 and 19, step 19's once (it was
    # kept twice when the stop fell between log steps)
    from jaxaccel.run.checkpoint import Checkpointer
    kept = Checkpointer(os.path.join(cut.run_dir, "checkpoints")).check_meta(19)["recent_history"]
    assert len(kept) == 2 and kept[0] != kept[1], kept
    config = parse(["--config", os.path.join(cut.run_dir, "config.yaml")])
    assert config.run.stop_at is None       # the pause is not written into the run's config
    with pytest.raises(ConfigError, match="stop_at 1/2 is step 10, but the run resumes from "
                                          "step 19"):
        train(override(cut_cfg, {"run.resume": True, "run.stop_at": "1/2"}))
    resumed = train(override(cut_cfg, {"run.resume": True}))
    assert resumed.steps == 20 and resumed.steps_this_run == 1
    a, b = final_state(whole_run.run_dir, 20), final_state(resumed.run_dir, 20)
    assert len(jax.tree.leaves(a)) > 10
    chex.assert_trees_all_equal(a, b)
    assert resumed.val_bpb == whole_run.val_bpb
    assert resumed.train_bpb == whole_run.train_bpb


# A run SIGTERM stops: the command's flags (many steps, so that the signal comes first).
SIGNALLED = ["--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--max-seq-len", "32",
             "--seq-len", "32", "--batch-size", "4", "--steps", "100000", "--log-every", "1",
             "--eval-every", "0", "--checkpoint-every", "0", "--no-progress"]


def test_sigterm_without_checkpoints_exits_saying_the_run_cannot_be_continued(
        corpus_path, tmp_path, capsys, monkeypatch):
    """SIGTERM with --no-save-checkpoints: the step finishes, no checkpoint is written, and the
    line says the run cannot be continued; exit 143. Here the signal is raised in this process
    after the first step (a real process's exit is the next test's, which reads these programs
    from the compilation cache)."""
    from jaxaccel.step import compiled
    call, sent = compiled.StateStep.on_leaves, []

    def signal_after_the_first_step(self, *args):
        out = call(self, *args)
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGTERM)
        return out

    monkeypatch.setattr(compiled.StateStep, "on_leaves", signal_after_the_first_step)
    run_dir = tmp_path / "signalled"
    code = main([*SIGNALLED, "--data", corpus_path, "--run-dir", str(run_dir),
                 "--cache-dir", str(tmp_path / "cache"), "--no-save-checkpoints"])
    err = capsys.readouterr().err
    assert sent and code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err
    assert "no checkpoint written" in err and "--resume" not in err
    assert os.listdir(run_dir / "checkpoints") == []
    assert (run_dir / "metrics.jsonl").stat().st_size > 0


def test_sigterm_saves_a_checkpoint_and_exits(corpus_path, tmp_path):
    """SIGTERM to a real process: the step finishes, a checkpoint is saved, exit 143, and the
    line says how to continue (--resume)."""
    run_dir = tmp_path / "signalled"
    cmd = [sys.executable, "-m", "experiments.train", *SIGNALLED, "--data", corpus_path,
           "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache")]
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
    assert "--resume" in err
    steps = os.listdir(run_dir / "checkpoints")
    assert len(steps) == 1 and int(steps[0]) >= 1


def test_without_checkpoints_a_run_saves_none_and_trains_the_same(whole, unsaved):
    """run.save_checkpoints off (the ``unsaved`` run): no checkpoint, periodic or final; the
    same losses as the whole run's, which saved them."""
    _, saved = whole
    assert os.listdir(os.path.join(unsaved.run_dir, "checkpoints")) == []
    assert os.listdir(os.path.join(saved.run_dir, "checkpoints"))
    assert unsaved.steps == saved.steps == 20 and unsaved.val_loss == saved.val_loss


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


def test_checkpoint_problems_on_resume_are_errors(whole, tmp_path, capsys):
    """On a copy of the whole run's directory: a new run into it, a resume with another
    setting, a resume from a folder without checkpoints and a resume from a damaged checkpoint
    are each one error line and exit code 2."""
    _, summary = whole
    run_dir = tmp_path / "r"
    shutil.copytree(summary.run_dir, run_dir)
    base = ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)]
    code, err = run_cli(base, capsys)
    assert code == 2 and "already holds checkpoints; set resume" in err[0]
    assert err[0].endswith("[--resume / run.resume]")
    # another seed: a setting the checkpoint records that changes no compiled program
    code, err = run_cli(base + ["--resume", "--seed", "1"], capsys)
    assert code == 2 and len(err) == 1 and "written with other settings: run.seed=0" in err[0]
    code, err = run_cli([*base, "--resume", "--run-dir", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "no checkpoint in" in err[0]
    state_dir = run_dir / "checkpoints" / "20" / "state"
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


# The strategy runs' settings besides batching (one layer each), each run checking more than its
# batching: pack trains a token budget (run.train_tokens, about 5 batches) instead of run.steps
# (8), with Lion, its moment in bfloat16, the learning rate scaled from a batch of 2 to 8 rows,
# and 2 microbatches; bucket batches by a token budget per batch (2 buckets), of BPE ids, in fp16
# with a dynamic loss scale that starts at 4 and grows after every 2 finite steps.
STRATEGIES = {
    "pack": dict(n_layers=1, train_tokens=8 * 32 * 5, optimizer="lion", batch_size=8,
                 lr_scaling="sqrt", base_batch_size=2, accumulate=2,
                 optimizer_state_dtype="bfloat16"),
    "bucket": dict(n_layers=1, buckets=2, pad_multiple=8, batch_size=None, tokens_per_batch=96,
                   tokenizer="bpe:300", precision="fp16", loss_scale_init=4.0,
                   loss_scale_growth_interval=2),
}


@pytest.fixture(scope="module")
def strategy_runs(corpus_path, tmp_path_factory):
    """``runs(strategy, name)`` for pack and bucket batching (``STRATEGIES``): "whole", an
    uninterrupted run; "cut", the same run stopped after step 3 (``should_stop``, a signal's
    path; mid-epoch); "resumed", the cut run resumed to the end. Each is trained once for the
    module, when a test first asks for it (the cut and the resumed run together)."""
    folders, done = {}, {}

    def make(strategy, name, **kw):
        if strategy not in folders:
            folders[strategy] = tmp_path_factory.mktemp(strategy)
        return small_config(corpus_path, folders[strategy], name, batching=strategy,
                            checkpoint_every=0, **STRATEGIES[strategy], **kw)

    def runs(strategy, name):
        if (strategy, name) not in done:
            if name == "whole":
                done[strategy, name] = train(make(strategy, "whole"))
            else:
                done[strategy, "cut"] = train(make(strategy, "cut"),
                                              should_stop=lambda step: step == 3)
                done[strategy, "resumed"] = train(make(strategy, "cut", resume=True))
        return done[strategy, name]

    return runs


@pytest.mark.parametrize("strategy", ["dynamic", "bucket", "pack"])
def test_every_shape_compiles_in_warm_up_and_never_after(strategy, strategy_runs, whole,
                                                         tmp_path):
    """Every batch shape of the strategy is compiled before the first step, none after (the
    runs evaluate every 4 steps too). The dynamic run is the whole run's config in dynamic
    batching (its programs for full-length rows are the whole run's)."""
    if strategy in STRATEGIES:
        summary = strategy_runs(strategy, "whole")
    else:
        cfg, _ = whole
        summary = train(like(cfg, tmp_path / "dynamic", **{
            "data.batching": "dynamic", "data.pad_multiple": 16, "run.checkpoint_every": 0}))
    assert summary.compiles == len(summary.shapes) >= 1
    assert summary.compiles_after_warmup == 0
    if strategy == "pack":
        assert summary.shapes == [[8, 32]]
        assert summary.padding_efficiency > 0.9
    else:
        assert len(summary.shapes) >= 2
    assert summary.data_wait_s >= 0 and np.isfinite(summary.val_bpb)


@pytest.mark.parametrize("strategy", ["pack", "bucket"])
def test_resume_is_bitwise_with_other_strategies(strategy, strategy_runs):
    """A pack or bucket run cut after step 3 and resumed ends bitwise as the whole run."""
    whole, cut, resumed = (strategy_runs(strategy, name) for name in ("whole", "cut", "resumed"))
    assert cut.steps == 3 and resumed.steps == whole.steps
    chex.assert_trees_all_equal(final_state(whole.run_dir, whole.steps),
                                final_state(resumed.run_dir, whole.steps))


def test_train_tokens_sets_the_number_of_steps(strategy_runs):
    """run.train_tokens (the pack runs': 5 batches of 8 x 32) sets the steps, not run.steps."""
    summary = strategy_runs("pack", "whole")
    assert 5 <= summary.steps <= 6
    assert summary.real_tokens >= 0.9 * 8 * 32 * 5


def test_optimizer_flags_reach_the_run(strategy_runs):
    """The pack runs' optimizer settings (``STRATEGIES``) are the run's."""
    summary = strategy_runs("pack", "whole")
    lion = DEFAULTS["lion"]
    assert summary.learning_rate == pytest.approx(lion.learning_rate * 2.0)
    assert summary.weight_decay == lion.weight_decay
    assert summary.optimizer == "lion" and summary.accumulate == 2
    # Lion keeps one moment: in bfloat16 it takes half the parameters' float32 bytes.
    assert summary.optimizer_state_bytes == pytest.approx(summary.params * 2, rel=0.01)
    assert np.isfinite(summary.val_bpb)
    records = [json.loads(line) for line in open(os.path.join(summary.run_dir, "metrics.jsonl"))]
    assert all(r["update_norm"] > 0 for r in records if r["kind"] == "train")


def test_accumulation_trains_like_the_whole_batch(whole, tmp_path):
    """--accumulate 4 runs the same updates as the whole batch: the final losses agree (with
    AdamW, which would magnify a difference, against the whole run), and the step's
    temporaries are smaller."""
    cfg, whole_run = whole
    split = train(like(cfg, tmp_path / "split", **{
        "optimizer.accumulate": 4, "run.eval_every": 0, "run.checkpoint_every": 0}))
    assert split.val_loss == pytest.approx(whole_run.val_loss, rel=1e-5)
    assert split.step_memory_bytes["temp"] < whole_run.step_memory_bytes["temp"]


def test_fp16_resume_restores_the_loss_scale_bitwise(strategy_runs):
    """The dynamic loss scale is part of the checkpoint: the bucket runs (fp16, ``STRATEGIES``)
    cut and resumed end equal to the uninterrupted one, scale and growth counter included."""
    whole, cut, resumed = (strategy_runs("bucket", name) for name in ("whole", "cut", "resumed"))
    assert whole.steps == 8
    assert whole.precision == "fp16" and whole.loss_scale == 4.0 * 2**4   # grew 4 times
    cut_state = final_state(cut.run_dir, 3)
    assert int(cut_state["loss_scale"]["growth_tracker"]) == 1
    a, b = final_state(whole.run_dir, 8), final_state(resumed.run_dir, 8)
    assert float(a["loss_scale"]["scale"]) == whole.loss_scale
    chex.assert_trees_all_equal(a, b)


def test_partial_evaluation_spreads_its_batches_over_the_split():
    """``max_batches`` takes batches from the whole split (first and last included), not its
    first files; without it every batch counts."""
    from jaxaccel.run.loop import evaluate
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


def test_a_checkpoint_is_due_by_steps_or_by_minutes_since_the_last(monkeypatch):
    from jaxaccel.run.loop import run as run_phase
    from jaxaccel.run.config import RunConfig
    monkeypatch.setattr(run_phase.time, "monotonic", lambda: 1000.0)
    due = run_phase.checkpoint_due
    by_time = RunConfig(checkpoint_every=0, checkpoint_minutes=10)
    assert not due(by_time, 7, saved_at=1000.0 - 599)
    assert due(by_time, 7, saved_at=1000.0 - 600)
    by_steps = RunConfig(checkpoint_every=5, checkpoint_minutes=0)
    assert [s for s in range(1, 13) if due(by_steps, s, saved_at=0.0)] == [5, 10]
    both = RunConfig(checkpoint_every=5, checkpoint_minutes=10)
    assert due(both, 5, saved_at=1000.0) and due(both, 6, saved_at=0.0)
    assert not due(both, 6, saved_at=1000.0)
    assert RunConfig().checkpoint_every == 0 and RunConfig().checkpoint_minutes == 10


def test_a_log_step_fetches_the_window_before_so_the_device_queue_never_drains(
        whole, tmp_path, monkeypatch):
    """At log step k the loop writes the window that ended at the log step before (done on the
    device by then), not the one it has just dispatched; the rest is written at the end."""
    from jaxaccel.step import compiled
    from jaxaccel.run.loop import run as run_phase
    events = []
    log_window, call = run_phase.log_window, compiled.StateStep.on_leaves
    evaluate = compiled.CompiledFn.__call__

    def logged(writer, step, *args):
        events.append(("log", step))
        return log_window(writer, step, *args)

    def dispatched(self, *args):
        events.append(("step", None))
        return call(self, *args)

    def evaluated(self, *args):
        events.append(("step", None))
        return evaluate(self, *args)

    monkeypatch.setattr(run_phase, "log_window", logged)
    monkeypatch.setattr(compiled.StateStep, "on_leaves", dispatched)
    monkeypatch.setattr(compiled.CompiledFn, "__call__", evaluated)
    cfg, _ = whole          # its 20 steps logged every 2, without evaluations and checkpoints
    train(like(cfg, tmp_path / "run", **{"run.eval_every": 0, "run.checkpoint_every": 0}))
    order = [step if kind == "log" else "s" for kind, step in events]
    # steps (train and the final evaluation's) in order; each window written one log step late
    assert order[:10] == ["s", "s", "s", "s", 2, "s", "s", 4, "s", "s"], order
    assert [x for x in order if x != "s"] == list(range(2, 21, 2))
