"""experiments.init_schemes: every scheme and learning rate, the reference rows, bad input."""

import json
import math
import os

import pytest

from experiments.init_schemes import main


def common(corpus_path, tmp_path):
    """A model of one layer (each scheme's scaling by depth: tests/test_techniques.py), four
    steps, one final validation batch."""
    return ["--data", corpus_path, "--d-model", "32", "--n-layers", "1", "--n-heads", "4",
            "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "4", "--steps", "4",
            "--final-eval-batches", "1", "--no-progress", "--cache-dir", str(tmp_path / "cache")]


def test_every_scheme_and_rate_with_the_reference(corpus_path, tmp_path, capsys):
    out = tmp_path / "init.json"
    assert main([*common(corpus_path, tmp_path), "--schemes", "rezero,tfixup",
                 "--learning-rates", "1e-2", "--reference-warmup", "2",
                 "--run-dir", str(tmp_path / "init"), "--json", str(out)]) == 0
    result = json.load(open(out))
    rows = [(r["label"], r["learning_rate"], r["warmup_steps"]) for r in result["rows"]]
    assert rows == [("rezero", 1e-2, 0), ("tfixup", 1e-2, 0), ("default + 2 warmup", 1e-2, 2)]
    for row in result["rows"]:
        assert row["steps"] == 4 and math.isfinite(row["unigram_bpb"])
        assert row["trained"] == (row["verdict"] == "")
        assert row["trained"] == (row["val_bpb"] <= 0.9 * row["unigram_bpb"])
    assert [s["label"] for s in result["meta"]["largest_stable"]] == \
        ["rezero", "tfixup", "default + 2 warmup"]
    assert os.path.getsize(tmp_path / "init" / "init_schemes.png") > 1000
    assert "Table 2" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--schemes", "default,fixup"], "unknown schemes ['fixup']"),
    (["--learning-rates", "1e-3,nan"], "not a comma-separated list of numbers"),
    (["--learning-rates", "-1"], "learning_rates: -1 is not positive"),
    (["--reference-warmup", "4"], "reference_warmup must be in [0, steps=4)"),
])
def test_bad_input_is_one_line_before_any_work(args, message, corpus_path, tmp_path, capsys):
    assert main([*common(corpus_path, tmp_path), "--run-dir", str(tmp_path / "bad"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "bad").exists()
