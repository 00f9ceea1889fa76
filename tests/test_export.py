"""Export: the Llama layout read back by an independent NumPy Llama, the native layout's round
trip, the run's tokenizer as Hugging Face files, a failed check, and the command's refusals."""

import json
import os

import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file

from experiments.export import main
from jaxaccel.outputs import export as ex
from jaxaccel.data import hf_tokenizer
from jaxaccel.run.config import override
from jaxaccel.outputs.generate import load_run
from jaxaccel.run.loop import train
from jaxaccel.core.tokenizer import from_run as tokenizer_from_run
from tests.test_loop import small_config

LLAMA_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json"]


class Runs:
    """Trained runs by name, each trained when a test first asks for it (so that a test pays
    only for the runs it reads): a Llama-shaped one (grouped-query, two scanned layers, 2:4
    masks to fold), one with a tied head, which Llama's layout refuses (both on bytes), and one
    on a SentencePiece model without PAD (ours after its pieces); the last two with one layer,
    as what is checked of them (the native layout, the tokenizer files) does not depend on
    the depth."""

    SETTINGS = {"llama": {"gpt.n_kv_heads": 2, "remat.scan_layers": True,
                          "sparsity.pattern": "2:4"},
                "tied": {"gpt.tie_embeddings": True, "gpt.n_layers": 1},
                "sp": {"gpt.n_layers": 1}}

    def __init__(self, corpus_path, tmp):
        self.corpus_path, self.tmp, self.made = corpus_path, tmp, {}

    def __getitem__(self, name: str) -> str:
        if name not in self.made:
            settings = dict(self.SETTINGS[name])
            if name == "sp":
                settings.update({"data.tokenizer": self.sentencepiece_model(),
                                 "data.cache_dir": str(self.tmp / "sp_cache")})
            cfg = override(small_config(self.corpus_path, self.tmp, name, steps=2,
                                        eval_every=0), settings)
            self.made[name] = train(cfg).run_dir
        return self.made[name]

    def sentencepiece_model(self) -> str:
        spm = pytest.importorskip("sentencepiece")
        texts = [json.loads(line)["text"] for line in open(self.corpus_path)]
        spm.SentencePieceTrainer.train(sentence_iterator=iter(texts),
                                       model_prefix=str(self.tmp / "sp"), vocab_size=60,
                                       hard_vocab_limit=False, minloglevel=2)
        return str(self.tmp / "sp.model")


@pytest.fixture(scope="module")
def runs(corpus_path, tmp_path_factory):
    return Runs(corpus_path, tmp_path_factory.mktemp("export"))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    return err


def test_llama_export_matches_an_independent_llama_forward(runs, tmp_path):
    out = tmp_path / "llama"
    result = ex.export(runs["llama"], str(out))
    assert (result.format, result.step, result.out_dir) == ("llama", 2, str(out))
    assert 0 <= result.max_logit_diff < 1e-4
    config = json.load(open(out / "config.json"))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) \
        == (4, 2, 8)
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) \
        == (32, 128, 2)
    assert (config["rms_norm_eps"], config["rope_theta"], config["hidden_act"]) \
        == (1e-6, 10_000.0, "silu")
    assert not config["tie_word_embeddings"] and config["bos_token_id"] == 1
    tensors = load_file(out / "model.safetensors")
    assert len(tensors) == 3 + 9 * 2 == result.tensors
    assert result.bytes == os.path.getsize(out / "model.safetensors")
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)   # [out, in]
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (32, 128)
    assert tensors["lm_head.weight"].shape == (config["vocab_size"], 32)
    with safe_open(out / "model.safetensors", "np") as f:
        assert f.metadata()["format"] == "pt"               # transformers refuses anything else
    # Layer 1 of the stacked blocks, its 2:4 mask folded in, transposed to [out, in].
    cfg, model, _ = load_run(runs["llama"])
    gate = model.blocks.layers.mlp.w_gate           # the scanned stack's Sparse wrapper
    folded = np.where(gate.mask[...][1], gate.kernel[...][1], 0).T
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.gate_proj.weight"], folded)
    assert np.mean(folded == 0) == 0.5
    # The NumPy Llama is a real check: a swapped gate/up breaks it.
    ids = np.arange(3, 19)
    good = ex.llama_forward(tensors, config, ids)
    swapped = dict(tensors)
    swapped["model.layers.0.mlp.gate_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"]
    swapped["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.gate_proj.weight"]
    assert np.max(np.abs(ex.llama_forward(swapped, config, ids) - good)) > 1e-3
    assert sorted(os.listdir(out)) == LLAMA_FILES                          # no temp files


def test_a_failed_check_is_one_line_and_keeps_the_files(runs, tmp_path, capsys, monkeypatch):
    original = ex.llama_tensors

    def gate_and_up_swapped(model):
        tensors = original(model)
        p = "model.layers.0.mlp."
        tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"] = \
            tensors[p + "up_proj.weight"], tensors[p + "gate_proj.weight"]
        return tensors

    monkeypatch.setattr(ex, "llama_tensors", gate_and_up_swapped)
    out = tmp_path / "bad"
    assert main(["--run-dir", runs["llama"], "--out", str(out)]) == 1
    assert "export check failed: logits" in one_error_line(capsys)
    assert sorted(os.listdir(out)) == LLAMA_FILES


def test_native_export_when_llama_does_not_fit(runs, tmp_path, capsys):
    out = tmp_path / "tied"
    assert main(["--run-dir", runs["tied"], "--out", str(out), "--format", "llama"]) == 2
    err = one_error_line(capsys)
    assert "tie_embeddings=True" in err and "format native" in err, err
    assert not out.exists()
    assert main(["--run-dir", runs["tied"], "--out", str(out), "--json",
                 str(tmp_path / "e.json")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and "as native" in printed[0] and str(out) in printed[0]
    row = json.load(open(tmp_path / "e.json"))["rows"][0]
    assert row["format"] == "native" and row["max_logit_diff"] == 0.0
    config = json.load(open(out / "config.json"))
    assert config["format"] == "jaxaccel" and config["step"] == 2
    assert config["train_config"]["gpt"]["tie_embeddings"]     # the run's settings: its model
    assert config["tokenizer"]["vocab_size"] == 259 and config["tokenizer"]["eos_token_id"] == 2
    # The round trip: every leaf under its dotted name, bitwise, and nothing else.
    tensors = load_file(out / "model.safetensors")
    expected = ex.flatten(nnx.state(load_run(runs["tied"])[1]))
    assert sorted(tensors) == sorted(expected) and "head.kernel" not in tensors
    assert all(np.array_equal(tensors[k], v) and tensors[k].dtype == v.dtype
               for k, v in expected.items())
    assert tensors["blocks.layers.0.attn.wq.kernel"].shape == (32, 32)
    assert main(["--run-dir", runs["tied"], "--out", str(out), "--overwrite"]) == 0


@pytest.mark.parametrize("args, message", [
    (["--out", "X"], "run_dir is missing"),
    (["--run-dir", "/nonexistent/run", "--out", "X"], "does not exist"),
    (["--run-dir", "RUN", "--out", "FULL"], "is not empty"),
    (["--run-dir", "FULL", "--out", "X"], "has no config.yaml"),
])
def test_export_bad_input_is_one_line(args, message, runs, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    names = {"RUN": runs["llama"], "X": str(tmp_path / "x"), "FULL": str(tmp_path / "full")}
    assert main([names.get(a, a) for a in args]) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "x").exists()
    assert os.listdir(tmp_path / "full") == ["keep.txt"]


@pytest.mark.parametrize("run", ["llama", "sp"])
def test_the_tokenizer_files_match_the_config_and_encode_as_trained(run, runs, tmp_path):
    """tokenizer.json read by ``tokenizers`` as transformers reads it: BOS prepended as training
    and experiments.sample framed, ids and text as ours; its special tokens at config.json's ids
    (a SentencePiece run's PAD after the .model's pieces included)."""
    out = tmp_path / run
    ex.export(runs[run], str(out))
    tok = tokenizer_from_run(runs[run])
    config = json.load(open(out / "config.json"))
    tokenizer_config = json.load(open(out / hf_tokenizer.TOKENIZER_CONFIG))
    generation = json.load(open(out / hf_tokenizer.GENERATION_CONFIG))
    hf = hf_tokenizer.load(str(out / hf_tokenizer.TOKENIZER_JSON), tokenizer_config)
    for role in ("bos", "eos", "pad"):
        token_id = config[f"{role}_token_id"]
        assert token_id == getattr(tok, f"{role}_id") == generation[f"{role}_token_id"]
        assert hf.token_to_id(tokenizer_config[f"{role}_token"]) == token_id, role
        assert config["jaxaccel"]["tokenizer"][f"{role}_token_id"] == token_id
    assert generation["suppress_tokens"] == list(range(tok.vocab_size, config["vocab_size"]))
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]
    for text in ("def f(x):\n    return  self", "x = 日本 🚀", ""):
        framed = tok.encode(text, eos=False).tolist()
        assert hf.encode(text).ids == framed and framed[0] == config["bos_token_id"]
        assert hf.decode(framed, skip_special_tokens=True) == tok.decode(framed)
    if run == "sp":
        assert tok.kind == "sentencepiece" and tok.pad_id == tok.base_size == tok.vocab_size - 1
        assert (out / "tokenizer.model").read_bytes() == open(tok.path, "rb").read()
        assert sorted(os.listdir(out)) == sorted([*LLAMA_FILES, "tokenizer.model"])
    else:
        assert tokenizer_config["bos_token"] == "<|bos|>" and config["vocab_size"] == 320


def test_native_export_has_the_tokenizer_files_too(runs, tmp_path):
    out = tmp_path / "native"
    ex.export(runs["tied"], str(out))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    config = json.load(open(out / "config.json"))["tokenizer"]
    tokenizer_config = json.load(open(out / hf_tokenizer.TOKENIZER_CONFIG))
    hf = hf_tokenizer.load(str(out / hf_tokenizer.TOKENIZER_JSON), tokenizer_config)
    assert hf.token_to_id(tokenizer_config["eos_token"]) == config["eos_token_id"] == 2


def test_a_tokenizer_that_encodes_otherwise_fails_the_check(runs, tmp_path, capsys,
                                                            monkeypatch):
    original = hf_tokenizer.tokenizer_json

    def without_bos(tok):
        return {**original(tok), "post_processor": None}

    monkeypatch.setattr(hf_tokenizer, "tokenizer_json", without_bos)
    out = tmp_path / "bad"
    assert main(["--run-dir", runs["llama"], "--out", str(out)]) == 1
    err = one_error_line(capsys)
    assert "export check failed" in err and "tokenizer.json differs" in err, err
    assert sorted(os.listdir(out)) == LLAMA_FILES


@pytest.mark.parametrize("values, why", [
    ({}, None),
    ({"gpt.mlp": "gelu"}, "mlp=gelu (Llama's MLP is SwiGLU)"),
    ({"init.scheme": "rezero"},
     "init=rezero removes the blocks' RMSNorms and gates their branches"),
    ({"init.scheme": "tfixup"}, "init=tfixup removes the blocks' RMSNorms"),
    ({"adapters.dim": 8}, "adapter_dim=8 (Llama has no adapters)"),
    ({"precision.policy": "fp8"}, "precision.policy=fp8 quantises its matmuls"),
    ({"lora.rank": 4, "sparsity.pattern": "2:4"}, None),     # both fold into the weights
])
def test_what_bars_the_llama_layout_is_the_first_blocker(values, why):
    """The GPT's own shape first, then each technique's ``llama_blocker`` in the records'
    order: one reason and its fix, or None."""
    from jaxaccel.outputs.export import blocker
    from jaxaccel.run.config import build
    found = blocker(build(values=values))
    assert (found is None) if why is None else found[0].startswith(why), found
