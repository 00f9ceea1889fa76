"""Export: the Llama layout read back by an independent NumPy Llama, the native layout, and the
command's refusals."""

import dataclasses
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from experiments.export import main
from jaxaccel import export as ex
from jaxaccel.loop import train
from tests.test_loop import small_config


@pytest.fixture(scope="module")
def runs(corpus_path, tmp_path_factory):
    """Two trained runs: a grouped-query Llama-shaped model, and one with a tied head."""
    tmp = tmp_path_factory.mktemp("export")
    made = {}
    for name, model in (("gqa", {"n_kv_heads": 2}), ("tied", {"tie_embeddings": True})):
        cfg = small_config(corpus_path, tmp, name, steps=2, eval_every=0)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
        made[name] = train(cfg).run_dir
    return made


def test_llama_export_matches_an_independent_llama_forward(runs, tmp_path):
    out = tmp_path / "llama"
    result = ex.export(runs["gqa"], str(out), "auto")
    assert result.format == "llama" and result.step == 2
    assert result.max_logit_diff < 1e-4
    config = json.load(open(out / "config.json"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["hidden_size"] == 32 and config["num_hidden_layers"] == 2
    tensors = load_file(out / "model.safetensors")
    assert len(tensors) == 3 + 9 * 2 and result.tensors == len(tensors)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)   # [out, in]
    assert tensors["lm_head.weight"].shape == (config["vocab_size"], 32)
    # The NumPy Llama is a real check: a swapped gate/up (or a transposed weight) breaks it.
    ids = np.arange(3, 19)
    good = ex.llama_forward(tensors, config, ids)
    swapped = dict(tensors)
    swapped["model.layers.0.mlp.gate_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"]
    swapped["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.gate_proj.weight"]
    assert np.max(np.abs(ex.llama_forward(swapped, config, ids) - good)) > 1e-3
    assert not any(name.endswith(".partial") for name in os.listdir(out))


def test_native_export_when_llama_does_not_fit(runs, tmp_path, capsys):
    out = tmp_path / "tied"
    assert main(["--run-dir", runs["tied"], "--out", str(out), "--format", "llama"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "tied" in err and \
        "--format native" in err, err
    assert not out.exists()
    assert main(["--run-dir", runs["tied"], "--out", str(out), "--json",
                 str(tmp_path / "e.json")]) == 0
    row = json.load(open(tmp_path / "e.json"))["rows"][0]
    assert row["format"] == "native" and row["max_logit_diff"] == 0.0
    config = json.load(open(out / "config.json"))
    assert config["model"]["tie_embeddings"] and config["tokenizer"]["name"] == "bytes"
    assert "head.kernel" not in load_file(out / "model.safetensors")


@pytest.mark.parametrize("args, message", [
    (["--out", "X"], "run_dir is missing"),
    (["--run-dir", "/nonexistent/run", "--out", "X"], "does not exist"),
    (["--run-dir", "RUN", "--out", "FULL"], "is not empty"),
    (["--run-dir", "FULL", "--out", "X"], "has no config.yaml"),
])
def test_export_bad_input_is_one_line(args, message, runs, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    names = {"RUN": runs["gqa"], "X": str(tmp_path / "x"), "FULL": str(tmp_path / "full")}
    assert main([names.get(a, a) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message in err, err
    assert not (tmp_path / "x").exists()
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
