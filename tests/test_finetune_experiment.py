"""experiments.finetune: every row from one trained run, LoRA merged and read back, bad input."""

import json
import os

import pytest
import yaml

from experiments.finetune import main
from jaxaccel.run.loop import train
from tests.test_loop import small_config


@pytest.fixture(scope="module")
def base_run(corpus_path, tmp_path_factory):
    """The base: one layer (test_generate.py's sample run has this config: in one pytest run
    they compile the same programs)."""
    tmp = tmp_path_factory.mktemp("base")
    return train(small_config(corpus_path, tmp, "base", steps=4, eval_every=0,
                              n_layers=1)).run_dir


def common(corpus_path, tmp_path):
    return ["--data", corpus_path, "--seq-len", "32", "--batch-size", "4", "--steps", "3",
            "--no-progress", "--final-eval-batches", "1", "--lora-rank", "2",
            "--adapter-dim", "4", "--cache-dir", str(tmp_path / "cache")]


def test_every_row_from_one_run(base_run, corpus_path, tmp_path, capsys):
    out = tmp_path / "finetune.json"
    assert main([*common(corpus_path, tmp_path), "--from", base_run, "--run-dir",
                 str(tmp_path / "ft"), "--json", str(out)]) == 0
    rows = {r["row"]: r for r in json.load(open(out))["rows"]}
    assert list(rows) == ["base", "full", "lora", "adapters"]
    full, lora, adapters = rows["full"], rows["lora"], rows["adapters"]
    assert full["trainable_params"] == full["params"] and full["state_share"] == 1.0
    assert lora["trainable_params"] == 1 * 2 * 2 * 32 * 2          # layers, q+v, A+B
    assert adapters["trainable_params"] == 1 * 2 * 2 * 32 * 4       # layers, branches, down+up
    for row in (lora, adapters):
        assert row["state_share"] < 0.1 and row["vs_full"] is not None
    # The merged export, read back from disk, gives the LoRA model's validation loss.
    assert lora["merged_val_loss"] == pytest.approx(lora["val_loss"], rel=1e-5)
    assert os.path.isfile(os.path.join(lora["merged_dir"], "config.yaml"))
    merged = yaml.safe_load(open(os.path.join(lora["merged_dir"], "config.yaml")))
    assert merged["lora"]["rank"] == 0 and merged["adapters"]["dim"] == 0
    assert os.path.getsize(tmp_path / "ft" / "finetune.png") > 1000
    assert "LoRA r2 q,v" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--lora-rank", "0"], "lora_rank must be at least 1 for the lora row"),
    (["--lora-rank", "33"], "lora_rank=33 exceeds the width 32 of a targeted layer"),
    (["--lora-targets", "q,z"], "'z' matches none of the model's linear layers"),
    (["--rows", "full,lora2"], "unknown rows ['lora2']"),
    (["--from", "/no/such/run"], "is not a run directory"),
    # the base's model replaced a given one silently
    (["--d-model", "64"], "trained with gpt.d_model=32, and this run gives 64"),
    (["--model", "small"], "trained with model.name='tiny', and this run gives 'small'"),
])
def test_bad_input_is_one_line_before_any_work(args, message, base_run, corpus_path, tmp_path,
                                               capsys):
    run_dir = tmp_path / "bad"
    argv = [*common(corpus_path, tmp_path), "--from", base_run, "--run-dir", str(run_dir), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not run_dir.exists()
