"""Smoke test of experiments.depth at a scale of seconds: its rows, stages and plot, and its one
line on bad input. Structure, not figures."""

import json
import math

from experiments import depth


def test_depth_experiment_runs_every_row(corpus_path, tmp_path, capsys):
    out = tmp_path / "depth.json"
    code = depth.main([
        "--data", corpus_path, "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
        "--max-seq-len", "64", "--seq-len", "64", "--batch-size", "8", "--steps", "8",
        "--warmup-steps", "2", "--eval-every", "4", "--log-every", "2", "--eval-batches", "2",
        "--stochastic-depth-rates", "0.5", "--stacking-stages", "2", "--no-progress",
        "--run-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache"),
        "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {row["label"]: row for row in result["rows"]}
    assert list(rows) == ["baseline", "stochastic depth 0.5", "progressive stacking 2"]
    for row in rows.values():
        assert row["steps"] == 8 and math.isfinite(row["step_ms"]) and row["step_ms"] > 0
        assert math.isfinite(row["val_loss"]) and row["step_vs_baseline"] > 0
        assert [p["step"] for p in row["eval_curve"]] == [4, 8]     # one periodic, the final
        assert row["reached"] in (True, False)
    base, sd, stack = rows.values()
    assert base["step_vs_baseline"] == 1.0 and base["reached"] and base["reach_step"] <= 8
    assert base["stochastic_depth_kept"] == 1.0 and base["progressive_stages"] is None
    assert sd["stochastic_depth_kept"] < 1.0 and sd["flops_per_token"] < base["flops_per_token"]
    assert stack["progressive_stages"] == [[0, 1], [4, 2]]
    assert stack["flops_per_token"] < base["flops_per_token"]
    assert result["meta"]["baseline_val_loss"] == base["val_loss"]
    assert result["meta"]["final_eval_batches"] == 2 and result["meta"]["interrupted"] is None
    assert (tmp_path / "runs" / "depth.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "| row" in printed and "Targets:" in printed and "progressive stacking 2" in printed


def test_depth_experiment_rejects_stages_that_do_not_divide_the_depth(tmp_path, capsys):
    code = depth.main(["--n-layers", "2", "--stacking-stages", "3",
                       "--run-dir", str(tmp_path / "runs")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--stacking-stages" in err
    assert not (tmp_path / "runs").exists()
