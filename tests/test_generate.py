"""Generation: the cached decode gives the training forward pass's logits, sampling's rules, and
experiments.sample end to end with its bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.sample import main
from jaxaccel import generate as gen
from jaxaccel.model import ModelConfig, init_params, make_apply, make_decode
from jaxaccel.tokenizer import ByteTokenizer


def forward(cfg, params, ids_BT):
    B, T = ids_BT.shape
    batch = {"inputs": ids_BT, "positions": jnp.broadcast_to(jnp.arange(T), (B, T)),
             "segment_ids": jnp.ones((B, T), jnp.int32)}
    return make_apply(cfg)(params, batch)


OPTIONS = {       # every model option in one of three models (each compiles its own decode)
    "plain": {},
    "gqa-scan-tied-gelu": {"n_kv_heads": 2, "scan_layers": True, "tie_embeddings": True,
                           "mlp": "gelu"},
    "gates-adapters-fp8-sparse-train-only": {
        "init": "rezero", "adapter_dim": 4, "fp8": True, "sparsity": "2:4",
        "stochastic_depth": 0.5, "token_keep": 0.5, "dropout": 0.1},
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_cached_decode_gives_the_forward_logits(options):
    """Prefill over a prompt, then one cached token at a time: every position's logits equal
    the training forward pass over the whole sequence (evaluation mode)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, max_seq_len=16,
                      **options)
    params = init_params(cfg, jax.random.PRNGKey(0))
    if options.get("init") == "rezero":       # gates at 0 would hide the branches
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: a + 0.5 if "alpha" in jax.tree_util.keystr(path) else a, params)
    ids_BT = jax.random.randint(jax.random.PRNGKey(1), (2, 11), 0, 64)
    expected_BTV = forward(cfg, params, ids_BT)
    decode = jax.jit(make_decode(cfg))
    P = 5
    logits_BPV, cache = jax.jit(gen.make_prefill(cfg, 11))(params, ids_BT[:, :P])
    got = [logits_BPV]
    for t in range(P, 11):
        positions_B1 = jnp.full((2, 1), t, jnp.int32)
        logits_B1V, cache = decode(params, ids_BT[:, t:t + 1], positions_B1, cache, t)
        got.append(logits_B1V)
    np.testing.assert_allclose(jnp.concatenate(got, 1), expected_BTV, atol=2e-5, rtol=2e-5)


def test_greedy_generation_follows_the_forward_argmax():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                      max_seq_len=32)
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompt_BT = jax.random.randint(jax.random.PRNGKey(1), (3, 4), 0, 64)
    new_BN = gen.generate(params, cfg, prompt_BT, max_new_tokens=12)
    logits_BTV = forward(cfg, params, jnp.concatenate([prompt_BT, new_BN], 1))
    np.testing.assert_array_equal(new_BN, jnp.argmax(logits_BTV[:, 3:-1], -1))


def test_sampling_rules():
    logits_BV = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4, 5.0, 0.0]] * 4000))
    key = jax.random.PRNGKey(0)
    greedy = gen.sample(logits_BV, key, temperature=0.0, top_k=6, valid_ids=4)
    assert (greedy == 3).all()                      # id 4 is beyond the tokenizer's ids
    top2 = gen.sample(logits_BV, key, temperature=1.0, top_k=2, valid_ids=4)
    assert set(np.unique(top2)) == {2, 3}
    assert abs(float((top2 == 3).mean()) - 4 / 7) < 0.03       # renormalised over the top 2
    assert (gen.sample(logits_BV, key, temperature=1.0, top_k=1) == 4).all()
    np.testing.assert_array_equal(top2, gen.sample(logits_BV, key, temperature=1.0, top_k=2,
                                                   valid_ids=4))


@pytest.fixture(scope="module")
def trained_run(corpus_path, tmp_path_factory):
    from jaxaccel.loop import train
    from tests.test_loop import small_config
    tmp = tmp_path_factory.mktemp("sample")
    return train(small_config(corpus_path, tmp, "base", steps=2, eval_every=0)).run_dir


def test_sample_command(trained_run, tmp_path, capsys):
    out = tmp_path / "sample.json"
    args = ["--run-dir", trained_run, "--prompt", "def f(", "--max-new-tokens", "12",
            "--num-samples", "2", "--seed", "3", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "--- sample 1 (step 2 of" in text and "decode tok/s" in text
    result = json.load(open(out))
    row = result["rows"][0]
    assert row["prompt_tokens"] == 7 and row["new_tokens"] == 12 and row["decode_tok_s"] > 0
    assert row["prompt_logits_max_diff"] <= 1e-5
    assert len(result["meta"]["texts"]) == 2
    assert main([*args, "--json", str(tmp_path / "again.json")]) == 0
    assert json.load(open(tmp_path / "again.json"))["meta"]["texts"] == result["meta"]["texts"]


@pytest.mark.parametrize("args, message", [
    ([], "no run to sample from"),
    (["--run-dir", "/nonexistent/run"], "does not exist"),
    (["--max-new-tokens", "40"], "exceeds the model's context of 32"),
    (["--prompt", "x" * 40], "the prompt is 41 tokens"),
    (["--temperature", "inf"], "temperature"),
    (["--top-k", "0"], "top_k"),
    (["--json", "/nonexistent/dir/s.json"], "create it first"),
])
def test_sample_bad_input_is_one_line(args, message, trained_run, capsys):
    run = [] if args and args[0] == "--run-dir" or not args else ["--run-dir", trained_run]
    assert main([*run, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message in err, err


def test_cut_at_eos_and_valid_ids():
    tok = ByteTokenizer()
    assert gen.valid_ids_of(tok) == 259
    np.testing.assert_array_equal(gen.cut_at_eos([5, 6, 2, 7], 2), [5, 6])
    np.testing.assert_array_equal(gen.cut_at_eos([5, 6], 2), [5, 6])
