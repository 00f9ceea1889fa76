"""experiments.overhead and experiments.bare: the loop against a bare script of the same step."""

import json
import subprocess
import sys

from experiments.overhead import main
from experiments.train import main as train_main

TINY = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32",
        "--batch-size", "4"]


def test_the_bare_script_trains_the_loops_step_on_the_same_batches(corpus_path, tmp_path):
    """Same model, initialisation, optimizer and batches: the third step's loss agrees."""
    cache = ["--data", corpus_path, "--cache-dir", str(tmp_path / "cache")]
    run_dir = tmp_path / "run"
    assert train_main([*TINY, *cache, "--steps", "3", "--log-every", "1", "--eval-every", "0",
                       "--final-eval-batches", "1", "--no-loss-plot", "--no-progress",
                       "--run-dir", str(run_dir)]) == 0
    losses = [r["loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl"))
              if r["kind"] == "train"]
    out = subprocess.run([sys.executable, "-m", "experiments.bare", *TINY, *cache, "--steps", "3",
                          "--max-seq-len", "256", "--warmup-steps", "50"],
                         capture_output=True, text=True, check=True).stdout
    bare = json.loads(out.strip().splitlines()[-1])
    assert bare["steps"] == 2 and bare["command_to_first_step"] > 0
    assert abs(bare["loss"] - losses[2]) <= 1e-4 * abs(losses[2]), (bare["loss"], losses)


def test_the_benchmark_measures_both_and_judges_the_targets(corpus_path, tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert main(["--shapes", "tiny", "--rounds", "1", "--steps", "24", "--data", corpus_path,
                 "--cache-dir", str(tmp_path / "cache"), "--json", str(out)]) == 0
    result = json.load(open(out))
    (row,) = result["rows"]
    assert row["shape"] == "tiny" and row["rounds"] == 1 and row["target"] == 0.90
    for key in ("loop", "bare", "alone", "start", "bare_start"):
        assert row[key] > 0, key
    assert row["loop_share"] == row["loop"] / row["bare"]
    assert row["start_ratio"] == row["start"] / row["bare_start"]
    assert result["meta"]["help_s"] > 0
    printed = capsys.readouterr().out
    assert "tiny: loop/bare" in printed and "experiments.train --help" in printed


def test_an_unknown_shape_is_one_error_line(capsys):
    assert main(["--shapes", "tiny,huge"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "huge" in err[0] and "--shapes" in err[0]
