"""Smoke tests of the experiment modules at a scale of seconds: structure, not figures."""

import contextlib
import importlib.util
import io
import json

import jax
import pytest

from experiments import attention, optimizers, padding, precision, remat


def test_padding_experiment_trains_rows_matched_to_fixed_padding(corpus_path, tmp_path, capsys):
    """Fixed padding, the baseline, and bucketing, the strategy whose batch the experiment
    matches through a token budget and whose batches take several shapes, train: each compiles
    once per shape and not after its warm-up, and the table, plot and JSON compare them. What
    the experiment does for every strategy before training (each one's batch matched to fixed
    padding's, its shapes and padding) is the next test's, on all four; training in dynamic and
    pack batching (every shape compiled in warm-up, never after; pack's one shape and padding):
    test_loop.py's test_every_shape_compiles_in_warm_up_and_never_after. Every row evaluates
    the same validation batches (one evaluation program for both), and bucketing has two
    buckets (each shape is a compile)."""
    out = tmp_path / "padding.json"
    code = padding.main([
        "--data", corpus_path, "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
        "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "4", "--pad-multiple", "16",
        "--buckets", "2", "--strategies", "fixed,bucket", "--train-tokens", "200",
        "--final-eval-batches", "1", "--eval-batch-size", "4", "--no-progress", "--run-dir",
        str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {row["strategy"]: row for row in result["rows"]}
    assert list(rows) == ["fixed", "bucket"]
    for row in rows.values():
        for key in ("padding_efficiency", "shapes", "compiles", "compile_s", "real_tokens_per_s",
                    "wall_s", "val_loss", "speedup_vs_fixed"):
            assert row[key] is not None, key
        assert row["compiles"] == row["shapes"] and row["compiles_after_warmup"] == 0
    assert rows["fixed"]["speedup_vs_fixed"] == 1.0 and rows["fixed"]["shapes"] == 1
    assert rows["bucket"]["shapes"] > 1                             # a compile per shape
    assert rows["bucket"]["padding_efficiency"] > rows["fixed"]["padding_efficiency"]
    assert rows["bucket"]["batch"].endswith(" tokens")              # the matched token budget
    assert result["meta"]["seq_len"] == 32
    assert (tmp_path / "runs" / "padding.png").stat().st_size > 1000
    assert "| strategy" in capsys.readouterr().out


def test_padding_plan_only_reports_whole_epochs(corpus_path, tmp_path):
    """Every strategy (all four by default), its batch matched to fixed padding's real tokens
    (pack: fewer, fuller rows; bucket: a token budget), and a whole epoch's shapes and
    padding."""
    out = tmp_path / "plan.json"
    code = padding.main([
        "--data", corpus_path, "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "4",
        "--pad-multiple", "8", "--buckets", "3", "--plan-only", "--cache-dir",
        str(tmp_path / "cache"), "--json", str(out)])
    assert code == 0
    rows = {row["strategy"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["fixed", "dynamic", "bucket", "pack"]
    assert rows["fixed"]["batch"] == rows["dynamic"]["batch"] == "4 rows"
    assert rows["bucket"]["batch"].endswith(" tokens") and rows["pack"]["batch"] in ("2 rows",
                                                                                     "3 rows")
    assert rows["pack"]["epoch_padding_efficiency"] > rows["bucket"]["epoch_padding_efficiency"] \
        > rows["fixed"]["epoch_padding_efficiency"]
    assert rows["fixed"]["shapes"] == rows["pack"]["shapes"] == 1
    assert 1 < rows["bucket"]["shapes"] <= 3 and 1 < rows["dynamic"]["shapes"] <= 4
    assert all(row["loader_tokens_per_s"] > 0 for row in rows.values())


def test_optimizers_experiment_plans_every_row_and_runs_both_tables(corpus_path, tmp_path,
                                                                    capsys):
    """The plan of table 1 for three optimizers and table 2 for the default large-batch
    optimizers (adamw, lamb) under both scaling rules, each row's learning rate as its run
    resolves it; then both tables run on a subset that has each kind of row: a different
    optimizer's state (lion), and a scaling rule on the large batch (adamw, linear). A run
    under the sqrt rule reports its scaled learning rate in test_loop.py (pack batching's
    run: Lion scaled from 2 to 8 rows); each optimizer's own update is tested in
    test_optim.py. Every row evaluates the same validation batches (one evaluation program
    for all)."""
    from experiments.common import parse_config
    from jaxaccel.run.config import override
    from jaxaccel.step.optim import build_optimizer

    common = ["--data", corpus_path, "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
              "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "2", "--train-tokens",
              "320", "--warmup-steps", "4", "--large-batch-factor", "4", "--final-eval-batches",
              "1", "--eval-batch-size", "2", "--no-progress", "--cache-dir",
              str(tmp_path / "cache")]
    cfg = parse_config(optimizers.EXPERIMENT, [*common, "--optimizers", "adamw,lion,lamb",
                                               "--run-dir", str(tmp_path / "plan")])
    plan = optimizers.rows(cfg)
    assert [(r.fields["optimizer"], r.fields["batch_size"], r.fields["lr_scaling"])
            for r in plan] == [
        ("adamw", 2, "none"), ("lion", 2, "none"), ("lamb", 2, "none"),
        ("adamw", 8, "linear"), ("adamw", 8, "sqrt"), ("lamb", 8, "linear"), ("lamb", 8, "sqrt")]
    optimizers.check(cfg, plan)                 # every planned row's config and model are valid
    assert {r.settings["optimizer.warmup_steps"] for r in plan if r.fields["batch_size"] == 8} \
        == {1}                                  # the warmup covers the same tokens
    planned_lr = {}
    for r in plan:
        row_cfg = override(cfg, r.settings)
        assert row_cfg.data.batch_size == r.fields["batch_size"]
        planned_lr[r.fields["optimizer"], r.fields["batch_size"], r.fields["lr_scaling"]] = \
            build_optimizer(row_cfg.optimizer, batch_rows=row_cfg.data.batch_size,
                            total_steps=10)[2]["learning_rate"]
    for name in ("adamw", "lamb"):
        assert planned_lr[name, 8, "linear"] == pytest.approx(4 * planned_lr[name, 2, "none"])
        assert planned_lr[name, 8, "sqrt"] == pytest.approx(2 * planned_lr[name, 2, "none"])

    out = tmp_path / "optimizers.json"
    code = optimizers.main([
        *common, "--optimizers", "adamw,lion", "--large-batch-optimizers", "adamw",
        "--scalings", "linear", "--run-dir", str(tmp_path / "runs"), "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["optimizer"], r["batch_size"], r["lr_scaling"]) for r in rows] == [
        ("adamw", 2, "none"), ("lion", 2, "none"), ("adamw", 8, "linear")]
    for row in rows:
        for key in ("val_loss", "tokens_per_s", "state_bytes"):
            assert row[key] is not None and row[key] > 0, key
    by = {(r["optimizer"], r["lr_scaling"]): r for r in rows}
    assert by["lion", "none"]["state_bytes"] < 0.6 * by["adamw", "none"]["state_bytes"]
    assert by["adamw", "linear"]["learning_rate"] == pytest.approx(4 * by["adamw", "none"]["learning_rate"])
    assert by["adamw", "linear"]["learning_rate"] == pytest.approx(
        planned_lr["adamw", 8, "linear"])            # the run trains at the planned rate
    assert by["adamw", "linear"]["steps"] < by["adamw", "none"]["steps"]
    assert (tmp_path / "runs" / "optimizers.png").stat().st_size > 1000
    out_text = capsys.readouterr().out
    assert "Table 1" in out_text and "Table 2" in out_text


PRECISION_ARGS = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--max-seq-len", "32",
                  "--seq-len", "32", "--batch-size", "2", "--train-tokens", "320",
                  "--final-eval-batches", "1", "--no-progress"]


@pytest.fixture(scope="module")
def precision_run(corpus_path, tmp_path_factory):
    """One run of the experiment for the two tests below: fp32, bf16 and fp8 train and compare,
    then the underflow probe runs at the fp32 run's initial and trained parameters. A relative
    --run-dir, as users pass it. Its directory, JSON and printed text."""
    tmp_path = tmp_path_factory.mktemp("precision")
    out, text = tmp_path / "precision.json", io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(text):
        patch.chdir(tmp_path)
        code = precision.main([
            "--data", corpus_path, *PRECISION_ARGS, "--precisions", "fp32,bf16,fp8",
            "--probe-batch-size", "4", "--probe-accumulate", "1,1024", "--run-dir", "runs",
            "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    assert code == 0
    return tmp_path, json.loads(out.read_text()), text.getvalue()


def test_precision_experiment_plans_every_row_and_probes_the_fp32_run(corpus_path, tmp_path,
                                                                      precision_run):
    """Every row's settings as planned (policy, loss scaling, float32 matmul precision), each
    checked as a run checks it; then (the run above) the fp32 row trains and the underflow
    probe runs at its initial and trained parameters. The rows' comparison is the next
    test's."""
    from experiments.common import check_rows, parse_config

    cfg = parse_config(precision.EXPERIMENT, ["--data", corpus_path, "--run-dir",
                                              str(tmp_path / "plan")])
    plan = precision.rows(cfg)
    settings = {r.label: tuple(r.settings[k] for k in precision.FIXED) for r in plan}
    assert settings == {
        "fp32": ("fp32", "none", "highest"), "tf32": ("fp32", "none", "default"),
        "bf16": ("bf16", "none", "default"), "fp16": ("fp16", "dynamic", "default"),
        "fp16-noscale": ("fp16", "none", "default"), "fp8": ("fp8", "none", "default")}
    assert all(r.fields["matmul_precision"] == settings[r.label][2] for r in plan)
    check_rows(cfg, plan, {})

    run_root, result, text = precision_run
    fp32 = result["rows"][0]
    assert fp32["precision"] == "fp32" and fp32["policy"] == "fp32"
    assert fp32["matmul_precision"] == "highest" and fp32["speedup_vs_fp32"] == 1.0
    probe = {(p["params"], p["accumulate"], p["case"]): p
             for p in result["meta"]["underflow_probe"]}
    assert len(probe) == 2 * 2 * 2
    for params in ("initial", "trained"):
        big = probe[params, 1024, "no scaling"]
        scaled = probe[params, 1024, "loss scaling"]
        assert big["flushed_to_zero"] > 0.2 and scaled["flushed_to_zero"] < 0.01
        assert scaled["relative_error"] < 0.05 < big["relative_error"]
        assert scaled["scale"] > 1024
    assert (run_root / "runs" / "precision.png").stat().st_size > 1000
    assert "Underflow probe" in text


def test_precision_experiment_compares_the_rows_with_fp32_and_fp8_with_bf16(precision_run):
    """fp32, bf16 and fp8 train and compare (the run above): every row with fp32, fp8 with
    bf16. The other rows are the same runs under other settings (the plan above), each a run
    tested elsewhere: tf32 is fp32 under the default matmul precision, the setting every other
    test's run trains with; fp16 with dynamic loss scaling is test_loop.py's fp16 run (its
    scale grows); fp16-noscale is fp16 on no loss scale, which reports a scale of 1 as bf16
    does here."""
    _, result, text = precision_run
    rows = {r["precision"]: r for r in result["rows"]}
    assert list(rows) == ["fp32", "bf16", "fp8"]
    for row in rows.values():
        for key in ("step_s", "real_tokens_per_s", "memory_bytes", "val_loss", "skipped_steps",
                    "speedup_vs_fp32"):
            assert row[key] is not None, key
    assert rows["fp32"]["speedup_vs_fp32"] == 1.0 and rows["fp32"]["matmul_precision"] == "highest"
    assert rows["bf16"]["loss_scale"] == 1 and rows["bf16"]["policy"] == "bf16"
    assert rows["fp8"]["policy"] == "fp8" and "emulated" in rows["fp8"]["fp8"]
    assert rows["fp8"]["speedup_vs_bf16"] > 0 and rows["bf16"]["speedup_vs_bf16"] is None
    assert abs(rows["fp8"]["val_loss_vs_bf16"]) < 0.05
    assert "| precision" in text


def test_remat_experiment_measures_every_row(tmp_path, capsys):
    """Both layouts of both policies, of one block with SGD (the quickest steps to compile):
    the rows' figures do not depend on the depth or the optimizer."""
    out = tmp_path / "remat.json"
    code = remat.main([
        "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--max-seq-len", "32",
        "--optimizer", "sgd", "--seq-len", "32", "--batch-size", "1", "--timed-steps", "1",
        "--policies", "none,full",
        "--max-batch-limit", "1", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["policy"], r["scan_layers"]) for r in rows] == [
        ("none", False), ("full", False), ("none", True), ("full", True)]
    for row in rows:
        for key in ("temp_bytes", "total_bytes", "flops", "compile_s", "step_s", "max_batch",
                    "speedup_vs_none", "temp_vs_none", "first_loss"):
            assert row[key] is not None, key
        assert row["max_batch"] == (1 if row["total_bytes"] <= rows[0]["total_bytes"] else 0)
        assert row["first_loss"] == pytest.approx(rows[0]["first_loss"], rel=1e-6)
    assert rows[0]["max_batch"] == 1 and rows[0]["temp_vs_none"] == 1.0
    assert rows[1]["temp_bytes"] < rows[0]["temp_bytes"]
    assert rows[1]["flops"] > rows[0]["flops"]
    assert result["meta"]["memory_budget"] == rows[0]["total_bytes"]
    assert result["meta"]["n_layers"] == 1 and result["meta"]["unrolled_over_scanned_compile_s"]
    assert "| remat" in capsys.readouterr().out


def test_attention_experiment_times_rows_and_reports_skips(tmp_path, capsys):
    out = tmp_path / "attention.json"
    code = attention.main([
        "--seq-lens", "24", "--head-dims", "32", "--heads", "2", "--kv-heads", "1",
        "--batch", "2", "--impls", ",".join(attention.IMPLS), "--causal", "causal",
        "--layouts", "dense,packed", "--packed-docs", "1.5",
        "--warmup", "0", "--iters", "1", "--max-t-limit", "24", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {(r["impl"], r["layout"], r["causal"]): r for r in result["rows"]}
    assert len(rows) == len(attention.IMPLS) * 2
    docs = result["meta"]["packed_batch"]["docs_per_row"]["24"]
    assert docs >= 1.5
    for (impl, layout, causal), row in rows.items():
        assert set(row) >= {"impl", "T", "D", "causal", "fwd_tflops", "fwdbwd_tflops", "max_T"}
        assert row["docs_per_row"] == (docs if layout == "packed" else None)
        if impl in ("xla", "pallas"):
            assert row["status"] == "ok" and row["fwd_tflops"] > 0 and row["fwdbwd_tflops"] > 0
            assert row["max_T"] == (24 if layout == "dense" else None)
            if layout == "packed":
                dense = rows[(impl, "dense", causal)]
                assert row["packed_vs_dense"] == dense["fwdbwd_ms"] / row["fwdbwd_ms"]
        elif impl == "jax_reference":
            assert row["status"] == "skipped: the reference kernel has no grouped-query attention"
        elif impl.startswith("tokamax") and importlib.util.find_spec("tokamax") is None:
            assert row["status"].startswith("skipped: tokamax is not installed")
        elif jax.default_backend() != "gpu":
            assert row["status"].startswith("skipped: ") and "NVIDIA GPU" in row["status"]
    assert all(v["stopped"] == "limit" for v in result["meta"]["max_t_search"].values())
    assert result["meta"]["interpret"] == (jax.default_backend() != "gpu")
    assert "| impl" in capsys.readouterr().out
    # Bad input, one line each: a length, a layout, a packed batch the corpus cannot give.
    for bad, flag in ((["--seq-lens", "0"], "--seq-lens"), (["--layouts", "ragged"], "--layouts"),
                      (["--seq-lens", "24", "--packed-docs", "30"], "--packed-docs")):
        assert attention.main(bad) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and flag in err, err


def test_attention_tune_checks_candidates_and_writes_the_table_the_kernel_reads(
        tmp_path, monkeypatch, capsys):
    from jaxaccel.model.kernels import tuning

    table = tmp_path / "tuned.json"
    other = "NVIDIA H100 80GB HBM3"
    tuning.write_entry(table, other, {64: tuning.TRITON[64]}, {"date": "2026-11-22"})
    from jaxaccel.model.kernels import autotune
    real_score = autotune.score

    def score(shapes, params, **kwargs):     # a dQ candidate with 16-row tiles computes wrong
        seconds, err = real_score(shapes, params, **kwargs)
        return seconds, 1.0 if params.dq.block_q == 16 and kwargs["checked"] else err

    monkeypatch.setattr(autotune, "score", score)
    rows_path = tmp_path / "rows.json"
    code = attention.main([
        "--tune", "--tune-seq-lens", "24", "--head-dims", "16", "--heads", "2", "--kv-heads",
        "1", "--batch", "1", "--causal", "causal", "--tune-blocks", "16", "--dtype", "float32",
        "--warmup", "0", "--iters", "1", "--tuning-file", str(table), "--json", str(rows_path)])
    assert code == 0
    rows = json.loads(rows_path.read_text())["rows"]
    # The built-in stage (32 x 32 in the interpreter) and the swept 16 x 16, in every pass.
    assert [(r["pass"], r["block_q"], r["block_k"]) for r in rows] == [
        (p, b, b) for p in tuning.PASSES for b in (32, 16)]
    for r in rows:
        if r["pass"] == "dq" and r["block_q"] == 16:
            assert r["status"] == "rejected: relative error above 0.0001" and not r["best"]
        else:
            assert r["status"] == "ok" and r["rel_err"] < 1e-4 and r["ms"] > 0
    winners = {r["pass"]: (r["block_q"], r["block_k"]) for r in rows if r["best"]}
    assert list(winners) == list(tuning.PASSES) and winners["dq"] == (32, 32)
    # The kernel reads the winners for this device; other devices' rows are kept.
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    got = tuning.flash_params(16, 24, interpret=True)
    assert {p: (s.block_q, s.block_k) for p, s in zip(tuning.PASSES, got.stages())} == winners
    assert tuning.tuned_rows(other)[64] == tuning.TRITON[64]
    assert "| pass" in capsys.readouterr().out
    devices = json.loads(table.read_text())["devices"]
    assert devices[other]["tuned_by"]["64"]["date"] == "2026-11-22"
    mine = devices[jax.devices()[0].device_kind]["tuned_by"]["16"]
    assert mine["passes"] == list(tuning.PASSES) and mine["command"].startswith("python -m")
    # A sweep stopped in its second pass keeps its first in the table at once.
    from experiments.common import Interrupted

    def stop_in_dkv(shapes, params, **kwargs):
        if kwargs["backward"]:
            raise Interrupted("SIGTERM")
        return real_score(shapes, params, **kwargs)

    monkeypatch.setattr(autotune, "score", stop_in_dkv)
    cut = tmp_path / "cut.json"
    assert attention.main([
        "--tune", "--tune-seq-lens", "24", "--head-dims", "16", "--heads", "2", "--batch", "1",
        "--causal", "causal", "--tune-blocks", "16", "--dtype", "float32", "--warmup", "0",
        "--iters", "1", "--tuning-file", str(cut)]) == 143
    kept = json.loads(cut.read_text())["devices"][jax.devices()[0].device_kind]
    assert kept["tuned_by"]["16"]["passes"] == ["forward"] and list(kept["head_dims"]) == ["16"]
    capsys.readouterr()
    # Mosaic GPU candidates, on Hopper GPUs only: 64 or 128 own rows (keys in dK/dV).
    exp = attention.AttentionSettings(tune_blocks="32,64,128", tune_warps="4", tune_stages="2")
    for name in tuning.PASSES:
        base = getattr(tuning.TRITON[64], name)
        grid = attention.tune_grid(exp)
        mosaic = [s for s in grid.candidates(name, base, interpret=False, kind=other)
                  if s.backend == "mosaic_gpu"]
        assert len(mosaic) == 4, name
        for s in mosaic:
            tuning.check_params(tuning.TRITON[64].replace(**{name: s}))
        assert all(s.backend == "triton" for s in grid.candidates(
            name, base, interpret=False, kind="NVIDIA A100-SXM4-80GB"))
    # Off the GPU the interpreter's table never goes where GPUs read theirs: one line, no work.
    if jax.default_backend() != "gpu":
        assert attention.main(["--tune"]) == 2
        assert "--tuning-file" in capsys.readouterr().err
