"""experiments.speedup: time to quality, the verdicts, the choice of the best combination, and
a minute-scale run of every row."""

import dataclasses
import json
import os

import pytest

from experiments import speedup
from jaxaccel.run.config import build, flatten, parse, to_dict
from jaxaccel.core.errors import ConfigError
from jaxaccel.step.optim import DEFAULTS

# Rows reach this target at their first evaluations: the tests check the wiring, not learning.
EASY = ["--target-bpb", "7.9", "--eval-every", "2"]
# Every experiment of this file trains on these settings, so that a program one compiled (a
# step is compiled for its shapes, learning rate and schedule) is the next one's, from the
# run-wide compilation cache: the baseline compiles once for the file, and the rounds tests'
# rows (the pack row's program, the two-layer stage of pack + stack) are served by it and by
# the padding part. A constant schedule leaves the number of steps (--train-tokens) out of the
# programs; two layers, which the depth rows need, compile about as fast as one.
SHARED = ["--scale", "cpu", "--cpu-devices", "2", "--max-seq-len", "128", "--seq-len", "128",
          "--batch-size", "4", "--pad-multiple", "64", "--buckets", "2", "--warmup-steps", "2",
          "--schedule", "constant", "--learning-rate", "3e-3", "--log-every", "2",
          "--final-eval-batches", "2"]
GPT = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2"]


@pytest.fixture(scope="module", autouse=True)
def one_row_process():
    """The experiments of this module take turns in one warm row process (``speedup.ROWS``):
    each experiment's ``finish``, which closes it, is left to the module's end, so that only
    the first pays for the process's imports and JAX's start (2-3 s each). At the end it is
    closed as ``finish`` closes it, and none is left."""
    finish = speedup.EXPERIMENT.finish
    speedup.EXPERIMENT.finish = None
    try:
        yield
    finally:
        speedup.EXPERIMENT.finish = finish
        finish(None, None)
    assert speedup.ROWS.child is None


def _row(name, speedup_, verdict="faster"):
    return {"name": name, "group": speedup.BY_NAME[name].group, "status": "ran",
            "speedup": speedup_, "spread": 0.01, "verdict": verdict,
            "settings": dict(speedup.BY_NAME[name].settings)}


def test_best_takes_the_soonest_row_per_group_that_every_round_found_faster():
    rows = {r["name"]: r for r in [
        _row("baseline", 1.0, None),
        _row("dynamic", 1.10), _row("bucket", 1.40, "cannot tell"), _row("pack", 1.30),
        _row("bf16", 1.02), _row("fp16", 0.90, "slower"),
        _row("remat-full", 0.80, "slower"), _row("remat-dots", 1.05),
        _row("lion", 1.2), _row("lamb", 1.3), _row("accumulate", 1.2),
        _row("fsdp", 1.2), _row("dp", 1.3), _row("sparse-2:4", 3.0),
        _row("token-drop", None, "not reached"),
    ]}
    rows["dp"]["status"] = "failed: out of memory"
    picks = speedup.choose_best(rows, margin=0.03)
    # bucket's gain is not in every round; bf16 is under the margin; dp failed; sparsity is
    # never combined; token dropping never got there.
    assert [name for name, _ in picks] == ["pack", "remat-dots", "accumulate", "fsdp", "lamb"]
    assert [n for n, _ in speedup.choose_best(rows, margin=0.25)] == ["pack", "lamb"]
    # importance sampling draws fixed batches: not with a padding row
    rows["importance"] = _row("importance", 1.5)
    assert "importance" not in [n for n, _ in speedup.choose_best(rows, 0.03)]
    del rows["pack"], rows["bucket"], rows["dynamic"]
    assert [n for n, _ in speedup.choose_best(rows, 0.03)][-2:] == ["lamb", "importance"]


def test_the_report_line_of_a_row_says_how_much_sooner_only_when_it_arrived():
    base = {"real_tokens_per_s": 100.0, "memory_bytes": 2**21}
    common = {"status": "ran", "group": "precision", "real_tokens_per_s": 50.0,
              "memory_bytes": 2**20, "loss_scale": 1.0, "skipped_steps": 0,
              "target": {"bpb": 3.7}, "round_speedups": [1.5, 1.7]}
    arrived = speedup.explain({**common, "name": "bf16", "description": "bf16",
                               "reached": True, "time_to_target_s": 4.0, "steps_to_target": 10,
                               "tokens_to_target": 1000, "speedup": 1.6, "spread": 0.1,
                               "verdict": "faster", "rounds": [
                                   {"steps": 9, "real_tokens": 900},
                                   {"steps": 11, "real_tokens": 1100}]}, base)
    assert "reached 3.7 bits/byte in 4.0 s of training (9 / 11 steps, 900 / 1,100 real " \
        "tokens)" in arrived        # each round's seed
    assert "1.60x +- 0.10 sooner (faster) than the baseline" in arrived
    missed = speedup.explain({**common, "name": "fp16", "description": "fp16",
                              "reached": False, "speedup": None, "spread": None,
                              "verdict": "not reached"}, base)
    assert "did not reach the target in every round;" in missed
    assert "than the baseline" not in missed and "-50%" in missed
    same = speedup.explain({**common, "name": "fp16", "description": "fp16", "reached": True,
                            "time_to_target_s": 4.0, "speedup": 1.6, "spread": 0.1,
                            "rounds": [{"steps": 9, "real_tokens": 900}] * 2}, base)
    assert "(9 steps, 900 real tokens)" in same


def test_the_time_of_all_rows_is_estimated_unless_all_rows_ran():
    some = [{"name": n, "status": "ran", "process_s": 30.0} for n in ("baseline", "pack")]
    assert speedup.all_rows_estimate(some) == (
        f"--rows all ({len(speedup.TECHNIQUES)} rows) would take about "
        f"{30 * (len(speedup.TECHNIQUES) + 1) / 60:.0f} minutes at this run's 30 s per row "
        f"(an estimate)")
    every = [{"name": t.name, "status": "skipped: needs a GPU" if t.name == "flash" else "ran",
              "process_s": 30.0} for t in speedup.TECHNIQUES]
    assert speedup.all_rows_estimate(every) == "that is --rows all (flash did not run here)"


def test_combine_merges_settings_and_rounds_the_batch_for_sharding():
    settings = {"pack": {"data.batching": "pack", "data.batch_size": 3,
                         "data.tokens_per_batch": None},
                "fsdp": {"mesh.strategy": "fsdp", "mesh.num_devices": None},
                "fp16": {"precision.policy": "fp16"}}
    combined = speedup.combine(settings, ["pack", "fp16", "fsdp"], device_count=2)
    assert combined == {"data.batching": "pack", "data.batch_size": 4,
                        "data.tokens_per_batch": None, "precision.policy": "fp16",
                        "mesh.strategy": "fsdp", "mesh.num_devices": None}
    settings.update(pack={"data.batching": "pack", "data.batch_size": 5},
                    accumulate={"optimizer.accumulate": 2})
    assert speedup.combine(settings, ["pack", "fsdp"], 2)["data.batch_size"] == 6
    assert speedup.combine(settings, ["pack", "accumulate", "fsdp"], 2)["data.batch_size"] == 8
    assert speedup.combine(settings, ["pack", "accumulate"], 2)["data.batch_size"] == 6
    with pytest.raises(ConfigError, match="two padding rows"):
        speedup.combine({"pack": {}, "bucket": {}}, ["pack", "bucket"], 1)
    with pytest.raises(ConfigError, match="cannot combine 'baseline'"):
        speedup.combine({"baseline": {}}, ["baseline"], 1)


def test_a_row_config_file_reproduces_its_config(tmp_path):
    from jaxaccel.run.config import write_config
    experiment = build(speedup.SpeedupConfig, {"gpt.d_model": 64, "data.seq_len": 128,
                                               "run.progress": False})
    cfg = speedup.train_config(
        experiment, {"data.batching": "bucket", "data.batch_size": None,
                     "data.tokens_per_batch": 1000, "precision.policy": "fp16",
                     "precision.loss_scale": "dynamic", "mesh.num_devices": None},
        run_dir="runs/x")
    assert cfg.data.batching == "bucket" and cfg.precision.policy == "fp16"
    assert cfg.mesh.num_devices is None and cfg.gpt.d_model == 64
    assert cfg.gpt.attention == "xla" and cfg.remat.policy == "none"    # the baseline's
    write_config(cfg, str(tmp_path))
    assert parse(["--config", str(tmp_path / "config.yaml")]) == cfg


def test_bad_rows_and_best_are_one_line_errors(tmp_path, capsys):
    assert speedup.main(["--rows", "baseline,warp", "--run-dir", str(tmp_path)]) == 2
    assert "unknown rows ['warp']" in capsys.readouterr().err
    assert speedup.main(["--batch-size", "6", "--row-accumulate", "4",
                         "--run-dir", str(tmp_path)]) == 2
    assert "row_accumulate=4" in capsys.readouterr().err
    # --best without a best row would be dropped: refused, naming both flags
    assert speedup.main(["--rows", "baseline,pack", "--best", "pack",
                         "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no best row" in err[0] and "--best" in err[0], err


def test_a_verdict_needs_every_round_on_one_side_of_one():
    """A row is faster or slower only when each round's ratio says so; a busy machine that
    shifts one round's ratio across 1.0 turns the verdict into "cannot tell", never into the
    opposite one; one round decides nothing."""
    assert speedup.verdict([1.30, 1.12]) == "faster"
    assert speedup.verdict([0.80, 0.95]) == "slower"
    assert speedup.verdict([1.30, 0.97]) == "cannot tell"
    assert speedup.verdict([1.5]) == "cannot tell"
    # with a margin, a round within it of 1.0 decides nothing: remat-dots was 1.02x-1.11x
    # faster in three runs of make run and 0.98x, 0.99x in both rounds of a fourth
    assert speedup.verdict([0.98, 0.99], 0.03) == "cannot tell"
    assert speedup.verdict([1.07, 1.02], 0.03) == "cannot tell"
    assert speedup.verdict([1.07, 1.03], 0.03) == "faster"
    assert speedup.verdict([0.9, 1 / 1.03], 0.03) == "slower"
    assert speedup.verdict([1.5, 1.2], 0.0) == "faster" and speedup.verdict([1.0, 1.0]) == \
        "cannot tell"
    # a competing process slows whichever row trains in its window: the quiet verdict either
    # holds or blurs, and is never reversed
    quiet = [1.25, 1.20, 1.22]
    for slowed in range(3):
        for factor in (0.5, 0.8, 1.25, 2.0):
            loaded = [r * factor if i == slowed else r for i, r in enumerate(quiet)]
            assert speedup.verdict(loaded) in ("faster", "cannot tell")
    base = {"status": "ran", "rounds": [{"train_s": 20.0, "reached": True}] * 2}
    row = {"status": "ran", "rounds": [{"train_s": 10.0, "reached": True},
                                       {"train_s": 25.0, "reached": True}]}
    speedup.compare(row, base)      # 2x sooner in one round, 0.8x in the other
    assert row["verdict"] == "cannot tell" and row["speedup"] == pytest.approx(1.4)
    assert row["round_speedups"] == pytest.approx([2.0, 0.8])
    never = {"status": "ran", "rounds": [{"train_s": 40.0, "reached": False}] * 2}
    speedup.compare(never, base)
    assert never["speedup"] is None and never["verdict"] == "not reached"
    speedup.compare(base, base)
    assert base["verdict"] is None and base["speedup"] == 1


def test_a_row_that_gave_up_is_not_trained_again():
    """A row that gave up in a round cannot reach the target in every round, so its verdict is
    decided: the harness trains it no more (its result said ``last_round``), the others go on,
    and the report says so."""
    from experiments import common
    measured = []

    def measure(run):
        measured.append((run.row.label, run.round))
        gave_up = run.row.label == "slow" and run.round == 0
        record = {"train_s": 9.0 if gave_up else 5.0, "reached": not gave_up, "steps": 10,
                  "compile_s": 1.0, "real_tokens": 100, "real_tokens_per_s": 20.0,
                  "process_s": 11.0}
        return {"status": "ran", "round": record, "last_round": gave_up}

    exp = dataclasses.replace(speedup.EXPERIMENT, measure=measure, rounds=lambda cfg: 3)
    rows = []
    common.run_plan(exp, None, [common.Row("quick"), common.Row("slow")], None, None, rows)
    assert measured == [("quick", 0), ("slow", 0), ("quick", 1), ("quick", 2)]
    quick, slow = rows
    assert len(quick["rounds"]) == 3 and quick["gave_up_in_round"] is None
    assert len(slow["rounds"]) == 1 and slow["gave_up_in_round"] == 1
    assert "last_round" not in slow and not slow["reached"]
    speedup.compare(slow, quick)
    assert slow["verdict"] == "not reached"
    base = {"real_tokens_per_s": 1.0, "memory_bytes": 1}
    line = speedup.explain({**slow, "name": "bf16", "description": "bf16", "group": "x",
                            "real_tokens_per_s": 0.3, "memory_bytes": 1}, base)
    assert "gave up in round 1 and was not trained again" in line


# The first experiment of the file: its baseline (which misses the target) compiles the
# baseline's programs into the run-wide cache for every experiment after it.
def test_the_target_is_the_unigram_entropy_less_the_gap_and_a_missed_one_is_one_line(
        corpus_path, tmp_path, capsys):
    from jaxaccel.data.corpus import load_corpus
    cfg = build(speedup.SpeedupConfig, {"data.path": corpus_path})
    corpus = load_corpus(corpus_path)
    resolved = speedup.resolve_target(cfg, corpus)
    assert resolved.run.target_bpb == pytest.approx(corpus.unigram_bits_per_byte() - 1.0,
                                                     abs=1e-4)
    with pytest.raises(ConfigError, match="target_gap"):
        speedup.resolve_target(build(speedup.SpeedupConfig, {"experiment.target_gap": 99.0}),
                               corpus)
    code = speedup.main([
        *SHARED, *GPT, "--rows", "pack", "--rounds", "1", "--data", corpus_path,
        "--train-tokens", "800", "--target-bpb", "0.5", "--eval-every", "2", "--cache-dir",
        str(tmp_path / "cache"), "--fresh-processes", "--run-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "did not reach the target 0.5" in err[0], err
    assert "--target-gap" in err[0] and not (tmp_path / "runs" / "pack").exists()


# Every row of --rows all, in parts that each run the whole experiment (the baseline, a few rows
# and its report) at a minute scale, two simulated CPU devices for the sharding rows, two layers
# for the depth rows.
ROW_PARTS = {
    "padding": ("dynamic", "bucket", "pack"),
    "precision": ("bf16", "fp16", "flash", "fp8"),
    "remat": tuple(f"remat-{policy}" for policy in ("full", "dots", "attention", "mlp",
                                                     "offload")),
    "layers": ("token-drop", "sparse-2:4", "stochastic-depth", "stack"),
    "optimizers": ("importance", "lion", "lamb", "accumulate"),
    "sharding": ("dp", "fsdp", "best"),
}


def test_the_parts_hold_every_row_once():
    parts = [name for names in ROW_PARTS.values() for name in names]
    assert sorted(parts) == sorted(speedup.parse_rows("all")[1:])         # all but baseline
    assert speedup.parse_rows("all") == [t.name for t in speedup.TECHNIQUES]


def run_rows(part, corpus_path, tmp_path, capsys):
    """The experiment with the baseline and ``ROW_PARTS[part]``: its result and printed text,
    after the checks that hold for every part."""
    out, run_dir = tmp_path / "speedup.json", tmp_path / "runs"
    code = speedup.main([
        *SHARED, *GPT, "--data", corpus_path, "--train-tokens", "1500", "--rounds", "1",
        "--rows", ",".join(ROW_PARTS[part]), *EASY, "--cache-dir", str(tmp_path / "cache"),
        "--run-dir", str(run_dir), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == [t.name for t in speedup.TECHNIQUES
                          if t.name == "baseline" or t.name in ROW_PARTS[part]]
    assert result["meta"]["target_bpb"] == 7.9 and result["meta"]["rounds"] == 1
    ran = {name: r for name, r in rows.items() if name not in ("flash", "fp8")}
    for name, r in ran.items():
        assert r["status"] == "ran", (name, r["status"])
        for key in ("name", "real_tokens_per_s", "padding_efficiency", "memory_bytes",
                    "compiles", "compile_s", "val_bpb", "target"):
            assert r[key] is not None, (name, key)
        assert "mfu" in r and r["target"]["step"] >= 2
        if r["reached"]:        # the time limit is 2x the baseline's, a fraction of a second
            assert r["with_compile_s"] > r["time_to_target_s"] > 0 and r["steps_to_target"]
            assert r["verdict"] in (None, "cannot tell")      # one round decides nothing
        else:
            assert r["verdict"] == "not reached" and r["time_to_target_s"] is None
    base = rows["baseline"]
    assert base["speedup"] == 1 and base["batching"] == "fixed" and base["reached"]
    assert base["mesh"] == {"stage": 1, "data": 1, "fsdp": 1, "tensor": 1}
    assert base["precision"] == "fp32"
    assert len({r["val_tokens"] for r in ran.values()}) == 1    # the same validation batches
    assert result["meta"]["scale"] == "cpu" and result["meta"]["device_count"] == 2
    assert result["meta"]["targets"][0].startswith(
        "CPU target" if "best" in rows else "no best combination ran")
    report = (run_dir / "report.md").read_text()
    assert "| row" in report and report.count("\n- **") == len(rows)
    for plot in ("time_to_target.png", "tokens_per_s.png", "memory.png", "loss_curves.png"):
        assert (run_dir / plot).stat().st_size > 1000, plot
    # loss_curves.png draws every row's curve, so no row draws its own (run.loss_plot).
    row_dirs = [r["run_dir"] for r in rows.values() if r["status"] == "ran"]
    assert row_dirs and not any(os.path.exists(os.path.join(d, "loss.png")) for d in row_dirs)
    printed = capsys.readouterr().out
    assert "| row" in printed
    return rows, result, printed


def test_the_padding_rows_run_with_their_strategy(corpus_path, tmp_path, capsys):
    rows, _, _ = run_rows("padding", corpus_path, tmp_path, capsys)
    base = rows["baseline"]
    assert rows["dynamic"]["batching"] == "dynamic" and rows["dynamic"]["shapes"] > 1
    assert 1 < rows["bucket"]["shapes"] <= 2
    assert rows["pack"]["shapes"] == 1
    for name in ("bucket", "pack"):
        assert rows[name]["padding_efficiency"] > base["padding_efficiency"], name
    assert base["learning_rate"] == rows["pack"]["learning_rate"] == 3e-3   # --learning-rate
    assert rows["pack"]["command"] == (f"python -m experiments.train --config "
                                       f"{rows['pack']['run_dir']}/config.yaml")


def test_the_precision_rows_compute_in_their_dtype(corpus_path, tmp_path, capsys):
    """The compute dtype, and fp16's dynamic loss scale at work; flash and fp8 need a GPU."""
    rows, _, _ = run_rows("precision", corpus_path, tmp_path, capsys)
    base = rows["baseline"]
    assert rows["bf16"]["precision"] == "bf16" and rows["bf16"]["temp_bytes"] < base["temp_bytes"]
    assert rows["fp16"]["precision"] == "fp16" and rows["fp16"]["loss_scale"] > 1
    assert rows["flash"]["status"] == "skipped: needs a GPU"
    assert rows["fp8"]["status"].startswith("skipped: needs a GPU with FP8 tensor cores")


def test_every_remat_row_keeps_fewer_temporaries(corpus_path, tmp_path, capsys):
    rows, _, _ = run_rows("remat", corpus_path, tmp_path, capsys)
    for policy in ("full", "dots", "attention", "mlp", "offload"):
        row = rows[f"remat-{policy}"]
        assert row["remat"] == policy and row["temp_bytes"] < rows["baseline"]["temp_bytes"], \
            policy


def test_the_layer_and_depth_rows_run_with_their_technique(corpus_path, tmp_path, capsys):
    """Sparsity, token dropping (in the last of two layers), stochastic depth's rate, and the
    stack row: one layer, two after half the baseline's steps to the target (if it had not
    reached it by then)."""
    rows, _, _ = run_rows("layers", corpus_path, tmp_path, capsys)
    base = rows["baseline"]
    assert rows["sparse-2:4"]["settings"]["sparsity.pattern"] == "2:4"
    assert rows["sparse-2:4"]["sparsity"] == "2:4" and rows["sparse-2:4"]["sparsity_density"] == 0.5
    assert rows["token-drop"]["settings"]["token_drop.keep"] == 0.5
    assert rows["token-drop"]["settings"]["token_drop.layers"] == "1:2"    # the last of 2
    assert rows["token-drop"]["token_keep"] == 0.5
    assert rows["token-drop"]["flops_per_token"] < base["flops_per_token"]
    assert rows["stochastic-depth"]["stochastic_depth"] == 0.2
    assert rows["stack"]["settings"]["stacking.stages"] == 2
    grown = max(1, round(0.5 * base["steps_to_target"]))
    assert rows["stack"]["stages"][0] == [0, 1]
    assert rows["stack"]["stages"][1:] in ([[grown, 2]], []) and \
        (rows["stack"]["stages"][1:] or rows["stack"]["steps"] <= grown)


def test_the_optimizer_rows_take_their_own_defaults(corpus_path, tmp_path, capsys):
    """--learning-rate (the cpu preset's: 1.5e-3) is the AdamW rows'; an optimizer row takes
    its own defaults. Lion keeps one moment instead of two; accumulation fewer temporaries."""
    rows, _, _ = run_rows("optimizers", corpus_path, tmp_path, capsys)
    base = rows["baseline"]
    assert rows["lion"]["optimizer_state_bytes"] / base["optimizer_state_bytes"] == \
        pytest.approx(0.5, abs=1e-3)   # one moment instead of two (and a few counters)
    assert rows["lamb"]["optimizer"] == "lamb" and rows["lamb"]["val_bpb"] != base["val_bpb"]
    assert speedup.preset(["--scale", "cpu"])["optimizer.learning_rate"] == 1.5e-3
    assert base["learning_rate"] == rows["accumulate"]["learning_rate"] == 3e-3
    for name in ("lion", "lamb"):
        assert rows[name]["learning_rate"] == pytest.approx(DEFAULTS[name].learning_rate), name
        assert rows[name]["weight_decay"] == pytest.approx(DEFAULTS[name].weight_decay), name
    assert rows["accumulate"]["accumulate"] == 2
    assert rows["accumulate"]["temp_bytes"] < base["temp_bytes"]
    assert rows["importance"]["settings"]["data.sampling"] == "loss"


def test_the_sharding_rows_and_the_best_row(corpus_path, tmp_path, capsys):
    """dp and fsdp over both devices; the best row ran with the settings of the rows it names."""
    rows, result, printed = run_rows("sharding", corpus_path, tmp_path, capsys)
    base = rows["baseline"]
    assert rows["dp"]["mesh"]["data"] == 2 and rows["fsdp"]["mesh"]["fsdp"] == 2
    assert rows["fsdp"]["param_opt_bytes_per_device"] < base["param_opt_bytes_per_device"]
    best = rows["best"]
    combined = speedup.combine({n: rows[n]["settings"] for n in result["meta"]["best"]},
                               result["meta"]["best"], 2)
    batch_keys = ("data.batch_size", "data.tokens_per_batch")
    assert {k: v for k, v in best["settings"].items() if k not in batch_keys} == \
        {k: v for k, v in combined.items() if k not in batch_keys}
    summary_keys = {"data.batching": "batching", "precision.policy": "precision",
                    "remat.policy": "remat", "optimizer.name": "optimizer",
                    "mesh.strategy": "sharding"}
    for name in result["meta"]["best"]:
        for key, value in rows[name]["settings"].items():
            if key in summary_keys:
                assert best[summary_keys[key]] == value, (name, key)
    assert "best = " in printed


def test_the_warm_row_process_answers_each_row_and_outlives_a_row_that_kills_it(
        corpus_path, tmp_path):
    """Rows run one after another in one process (``RowProcess``), each with its exit code and
    its own stderr, its output appended to its log; a row that ends the process is its exit
    code, and the next row starts a new one."""
    rows, env = speedup.RowProcess(), speedup.row_environment(1)
    log = tmp_path / "row.log"
    log.write_text("python -m experiments.train ...\n")
    try:
        assert rows.run(["--steps", "0"], str(log), env) == (
            2, "error: steps must be at least 1, got 0 [--steps / run.steps]\n")
        first = rows.child.pid
        assert rows.run(["--help"], str(log), env)[0] == 0 and rows.child.pid == first
        assert log.read_text().startswith("python -m experiments.train ...\nusage:")
        dies = tmp_path / "dies.py"
        dies.write_text("import os\n\n\ndef make(*args, **kwargs):\n    os._exit(3)\n")
        code, _ = rows.run(["--model", f"{dies}:make", "--data", corpus_path, "--steps", "1",
                            "--run-dir", str(tmp_path / "run"), "--cache-dir",
                            str(tmp_path / "cache")], str(log), env)
        assert code == 3 and rows.child is None
        assert rows.run(["--steps", "0"], str(log), env)[0] == 2 and rows.child.pid != first
    finally:
        rows.close()
    assert rows.child is None


NO_STACK = """
from flax import nnx


class NoStack(nnx.Module):
    def __init__(self, vocab_size, max_seq_len, *, rngs):
        self.emb = nnx.Embed(vocab_size, 16, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(16, vocab_size, rngs=rngs)

    def __call__(self, inputs, positions=None, segment_ids=None):
        x = self.emb(inputs)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make(vocab_size, max_seq_len, *, rngs):
    return NoStack(vocab_size, max_seq_len, rngs=rngs)
"""


def test_a_model_of_ones_own_skips_the_rows_it_cannot_run_with_the_reason(tmp_path):
    """Each row's model, checked as a run checks it before any work: a model whose blocks are no
    nn.Stack runs the rows that need none, and every block or layer technique is skipped with
    the one line a run would fail with (its flag named)."""
    path = tmp_path / "nostack.py"
    path.write_text(NO_STACK)
    cfg = build(speedup.SpeedupConfig, {"model.name": f"{path}:make", "data.seq_len": 64,
                                        "data.batch_size": 4})
    rows = {t.name: dict(t.settings) for t in speedup.TECHNIQUES if t.name != "best"}
    assert speedup.skip_reason(speedup.BY_NAME["flash"], {"platform": "gpu"}, cfg.model.name) \
        .startswith("sets gpt.attention, a field of jaxaccel's GPT presets")
    config = speedup.train_config(cfg, {}, None)
    assert config.gpt.attention is None and config.remat.policy == "none"  # no GPT field set
    answer = speedup.check_models({"config": flatten(to_dict(config)), "device_count": 2,
                                   "rows": {n: v for n, v in rows.items() if n != "flash"}})
    assert answer["depth"] is None
    reasons = {name: row["reason"] for name, row in answer["rows"].items()}
    runnable = ("baseline", "dynamic", "bucket", "pack", "bf16", "fp16", "importance", "lion",
                "lamb", "accumulate", "dp", "fsdp")
    assert [n for n, why in reasons.items() if why is None] == list(runnable)
    for name in ("remat-full", "remat-attention", "token-drop", "stochastic-depth", "stack"):
        assert "has no jaxaccel.model.nn.Stack" in reasons[name] and "\n" not in reasons[name], name
    assert reasons["token-drop"].endswith("[--token-keep / token_drop.keep]")
    assert "[--sparsity-targets / sparsity.targets]" in reasons["sparse-2:4"]
    assert "[--fp8-targets / fp8.targets]" in reasons["fp8"]


def test_the_stack_row_needs_a_depth_it_can_halve():
    assert speedup.depth_reason({"stacking.stages": 2}, 2) is None
    assert speedup.depth_reason({}, 3) is None and speedup.depth_reason({"stacking.stages": 2},
                                                                        None) is None
    odd = speedup.depth_reason({"stacking.stages": 2}, 3)
    assert "n_layers=3" in odd and odd.endswith("[--progressive-stack / stacking.stages]"), odd
    answer = speedup.check_models({"config": flatten(to_dict(speedup.train_config(build(
        speedup.SpeedupConfig, {"gpt.n_layers": 3}), {}, None))), "device_count": 1,
        "rows": {"stack": {"stacking.stages": 2}}})
    assert answer["rows"]["stack"]["reason"] == odd


def test_a_model_of_ones_own_trains_its_rows(corpus_path, tmp_path, capsys):
    """--model FILE.py:FUNCTION end to end: the cpu preset's GPT fields are left out, the row
    that sets one (flash) is skipped, the token-drop row drops in the last of its 2 layers."""
    from jaxaccel.run.config import read_config_file
    tiny_lm = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "tiny_lm.py")
    out, run_dir = tmp_path / "speedup.json", tmp_path / "runs"
    code = speedup.main([
        "--model", f"{tiny_lm}:make", "--model-args", "width: 32", "--rows",
        "baseline,flash,token-drop", *SHARED, "--data", corpus_path, "--train-tokens", "1000",
        "--rounds", "1", *EASY, "--cache-dir", str(tmp_path / "cache"), "--run-dir",
        str(run_dir), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert result["meta"]["model"] == f"{tiny_lm}:make"
    assert rows["flash"]["status"].startswith("skipped: sets gpt.attention")
    assert rows["baseline"]["status"] == rows["token-drop"]["status"] == "ran"
    assert rows["baseline"]["attention"] is None and rows["baseline"]["remat"] == "none"
    assert rows["token-drop"]["settings"]["token_drop.layers"] == "1:2"
    assert rows["token-drop"]["token_keep"] == 0.5
    assert rows["token-drop"]["flops_per_token"] < rows["baseline"]["flops_per_token"]
    written = read_config_file(str(run_dir / "baseline" / "round-1" / "config.yaml"))
    assert written["model.name"] == f"{tiny_lm}:make" and written["model.args"] == "width: 32"
    assert all(v is None for k, v in written.items() if k.startswith("gpt."))
    # A factory that does not load: one line before any row.
    capsys.readouterr()
    assert speedup.main(["--model", f"{tiny_lm}:nope", "--data", corpus_path, "--cache-dir",
                         str(tmp_path / "cache"), "--run-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no function 'nope'" in err[0] and "--model" in err[0], err
    assert not (tmp_path / "bad").exists()


def test_a_bucket_budget_matched_under_a_batch_multiple_stays_valid(corpus_path):
    """The bucket row's token budget, re-matched for a combination whose rows must be a
    multiple of 4 (2 devices x 2 microbatches), still holds 4 rows of the longest bucket."""
    from experiments.common import matched_batch
    from jaxaccel.data.corpus import load_corpus
    from jaxaccel.data.batching import DataStream
    cfg = build(values={"data.path": corpus_path, "model.max_seq_len": 128, "data.seq_len": 128,
                        "data.batch_size": 4, "data.pad_multiple": 32, "data.buckets": 3})
    documents = load_corpus(corpus_path).train
    budget = matched_batch(documents, cfg, "bucket", multiple=4)["data.tokens_per_batch"]
    assert budget >= 4 * 128
    DataStream(documents, strategy="bucket", seq_len=128, tokens_per_batch=budget,
               pad_multiple=32, num_buckets=3, data_parallel=4)
    # Without a multiple the budget is bisected to the real tokens per batch of fixed padding's.
    target = DataStream(documents, strategy="fixed", seq_len=128,
                        batch_size=4).stats["real_tokens_per_batch"]
    budget = matched_batch(documents, cfg, "bucket")["data.tokens_per_batch"]

    def real(budget):
        return DataStream(documents, strategy="bucket", seq_len=128, tokens_per_batch=budget,
                          pad_multiple=32, num_buckets=3).stats["real_tokens_per_batch"]

    assert abs(real(budget) - target) <= min(abs(real(b) - target)
                                             for b in range(128, 4 * 4 * 128, 16))


def test_rows_train_afresh_each_round_and_the_best_row_with_the_baseline_again(
        corpus_path, tmp_path, capsys):
    """--rounds 2: every row trains to the target twice, afresh, the rows taking turns; a
    speedup is the median over the rounds of the reference's training seconds to the target
    over the row's in the same round, its spread their half-range; the best row's reference
    is the baseline trained again beside it (--quiet 0: whatever the baseline's rounds varied),
    which learns as the baseline did."""
    out, run_dir = tmp_path / "speedup.json", tmp_path / "runs"
    code = speedup.main([
        *SHARED, *GPT, "--rows", "baseline,best", "--best", "pack", "--rounds", "2", "--quiet",
        "0", "--data", corpus_path, "--train-tokens", "3000", "--time-cap", "1000", *EASY,
        "--cache-dir", str(tmp_path / "cache"), "--profile", "1:2", "--run-dir", str(run_dir),
        "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["baseline", "best"] and result["meta"]["rounds"] == 2
    for name in ("baseline", "best"):       # --profile traced step 1, in the first round
        assert (run_dir / name / "round-1" / "profile").is_dir(), name
        assert not (run_dir / name / "round-2" / "profile").exists(), name
        for round_dir in (run_dir / name).glob("round-*"):      # a row's weights are not kept
            assert not list((round_dir / "checkpoints").glob("*")), round_dir
    base, best = rows["baseline"], rows["best"]
    again = best["baseline_again"]
    for row in (base, best, again):
        assert row["status"] == "ran" and len(row["rounds"]) == 2
        first, second = row["rounds"]
        assert first["reached"] and second["reached"]
        assert max(first["steps"], second["steps"]) < 30    # ended at the target
        assert first["run_dir"].endswith("round-1") and second["run_dir"].endswith("round-2")
        assert row["time_to_target_s"] == pytest.approx(
            (first["train_s"] + second["train_s"]) / 2)
    for index in range(2):      # round k: every row from seed k - 1, the baseline again alike
        for name in ("baseline", "best", "baseline-again"):
            config = (run_dir / name / f"round-{index + 1}" / "config.yaml").read_text()
            assert f"  seed: {index}\n" in config, (name, config)
        assert again["rounds"][index]["steps"] == base["rounds"][index]["steps"]
        assert again["rounds"][index]["val_bpb"] == base["rounds"][index]["val_bpb"]
    assert base["steps_to_target"] == (base["rounds"][0]["steps"] + base["rounds"][1]["steps"]) / 2
    ratios = [a["train_s"] / b["train_s"] for b, a in zip(best["rounds"], again["rounds"])]
    assert best["round_speedups"] == pytest.approx(ratios)
    assert best["speedup"] == pytest.approx(sum(ratios) / 2)
    assert best["spread"] == pytest.approx(abs(ratios[0] - ratios[1]) / 2)
    assert best["settings"]["data.batching"] == "pack"
    assert best["verdict"] == speedup.verdict(ratios)
    summary = json.loads((run_dir / "best" / "round-2" / "summary.json").read_text())
    assert summary["target"]["reached"] and summary["target"]["bpb"] == 7.9
    printed = capsys.readouterr().out
    assert "round 2/2  best" in printed and "to the target 2 times" in printed
    assert "3 rows x 2 round(s) should take about" in printed     # said after round 1's baseline
    assert f"its steps to the target were {base['rounds'][0]['steps']} / " \
        f"{base['rounds'][1]['steps']}" in printed
    report = (run_dir / "report.md").read_text()
    assert "time to quality" in report and "the experiment took" in report


def test_on_a_quiet_machine_the_best_row_is_set_against_the_baseline_rounds(
        corpus_path, tmp_path, capsys):
    """When the baseline's rounds varied by no more than --quiet, the baseline is not trained
    again: the best row's speedup per round is the baseline's seconds in that round over its
    own, and its time cap comes from them; the report says so."""
    out, run_dir = tmp_path / "speedup.json", tmp_path / "runs"
    code = speedup.main([
        *SHARED, *GPT, "--rows", "baseline,best", "--best", "pack,stack", "--rounds", "2",
        "--quiet", "1", "--same-seed", "--data", corpus_path, "--train-tokens", "3000",
        "--time-cap", "1000", *EASY, "--cache-dir", str(tmp_path / "cache"), "--run-dir",
        str(run_dir), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    base, best = rows["baseline"], rows["best"]
    assert "baseline_again" not in best and not (run_dir / "baseline-again").exists()
    assert result["meta"]["best_quiet"] and not result["meta"]["best_rounds"]
    seconds = [r["train_s"] for r in base["rounds"]]
    assert best["baseline_train_s"] == seconds
    ratios = [b / r["train_s"] for b, r in zip(seconds, best["rounds"])]
    assert best["round_speedups"] == pytest.approx(ratios)
    steps = [r["steps"] for r in base["rounds"]]
    for index, b in enumerate(seconds):     # the cap: --time-cap times that round's baseline
        config = (run_dir / "best" / f"round-{index + 1}" / "config.yaml").read_text()
        assert f"target_seconds: {round(1000 * b, 3)}" in config, config
        # stacking grows after half the steps that round's baseline took to the target
        assert f"at: '{max(1, round(0.5 * steps[index]))}'" in config, config
        assert "  seed: 0\n" in config, config         # --same-seed
    assert "not trained again" in capsys.readouterr().out
