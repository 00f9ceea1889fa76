"""Generation: the cached decode gives the training forward pass's logits, a model without a
cache samples by recomputing the prefix, sampling's rules, and experiments.sample end to end
with its bad input."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.sample import main
from jaxaccel.techniques import fp8, init, registry as techniques
from jaxaccel.outputs import generate as gen
from jaxaccel.run.config import TrainConfig
from jaxaccel.model.contract import ModelConfig, load_factory, make_apply, sequence_batch
from jaxaccel.core.tokenizer import ByteTokenizer


def forward(model, ids_BT):
    """The training forward pass's logits (jitted, as a step runs it: one compile)."""
    return jax.jit(make_apply(nnx.graphdef(model)))(nnx.state(model), sequence_batch(ids_BT))


def build(options: dict, *, vocab_size=64, max_seq_len=16, **shape):
    """jaxaccel's GPT with every technique ``options`` names (``section.field`` settings; ``fp8``
    wraps its block matmuls in FP8 while the rest stays float32), in evaluation mode."""
    options = dict(options)
    with_fp8 = options.pop("fp8", False)
    cfg = TrainConfig()
    sections = {}
    for path, value in options.items():
        section, _, name = path.partition(".")
        sections.setdefault(section, {})[name] = value
    cfg = dataclasses.replace(cfg, model=ModelConfig("tiny", None, max_seq_len, vocab_size),
                              **{section: dataclasses.replace(getattr(cfg, section), **fields)
                                 for section, fields in sections.items()})
    cfg = dataclasses.replace(cfg, gpt=dataclasses.replace(cfg.gpt, **shape))
    model = techniques.build(cfg, jax.random.PRNGKey(0))
    if with_fp8:
        fp8.apply(model, cfg.fp8)
    model.eval()
    return model


OPTIONS = {       # every model option in one of three models (each compiles its own decode)
    "plain": {},
    "gqa-scan-tied-gelu": {"gpt.n_kv_heads": 2, "remat.scan_layers": True,
                           "gpt.tie_embeddings": True, "gpt.mlp": "gelu"},
    "gates-adapters-fp8-sparse-train-only": {
        "init.scheme": "rezero", "adapters.dim": 4, "fp8": True, "sparsity.pattern": "2:4",
        "stochastic_depth.rate": 0.5, "token_drop.keep": 0.5, "gpt.dropout": 0.1},
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_cached_decode_gives_the_forward_logits(options):
    """Prefill over a prompt, then one cached token at a time: every position's logits equal
    the training forward pass over the whole sequence (evaluation mode)."""
    model = build(options, d_model=32, n_layers=3, n_heads=4)
    assert gen.cached(model)
    for _, gate in nnx.iter_graph(model):       # gates at 0 would hide the branches
        if isinstance(gate, init.Gated):
            gate.gate[...] = gate.gate[...] + 0.5
    state = nnx.state(model)
    ids_BT = jax.random.randint(jax.random.PRNGKey(1), (2, 11), 0, 64)
    expected_BTV = forward(model, ids_BT)
    _, step = gen.make_decode(model)
    decode = jax.jit(step)
    P = 5
    logits_BPV, cache = gen.make_prefill(model, 11)(state, ids_BT[:, :P])
    got = [logits_BPV]
    for t in range(P, 11):
        logits_B1V, cache = decode(state, ids_BT[:, t:t + 1], cache, t)
        got.append(logits_B1V)
    np.testing.assert_allclose(jnp.concatenate(got, 1), expected_BTV, atol=2e-5, rtol=2e-5)


def test_greedy_generation_follows_the_forward_argmax():
    model = build({}, vocab_size=64, max_seq_len=32, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=1)
    prompt_BT = jax.random.randint(jax.random.PRNGKey(1), (3, 4), 0, 64)
    new_BN = gen.generate(model, prompt_BT, max_new_tokens=12)
    logits_BTV = forward(model, jnp.concatenate([prompt_BT, new_BN], 1))
    np.testing.assert_array_equal(new_BN, jnp.argmax(logits_BTV[:, 3:-1], -1))


def test_a_model_without_a_cache_samples_by_recomputing_the_prefix():
    """A model of one's own with no ``init_cache``/``decode`` (examples/tiny_lm.py): each new
    token is the forward pass's argmax over the ids so far, and sampling is seeded."""
    model = load_factory("examples/tiny_lm.py:make")(64, 32, rngs=nnx.Rngs(0), width=32)
    model.eval()
    assert not gen.cached(model)
    prompt_BT = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 64)
    new_BN = gen.generate(model, prompt_BT, max_new_tokens=9, context=32)
    logits_BTV = forward(model, jnp.concatenate([prompt_BT, new_BN], 1))
    np.testing.assert_array_equal(new_BN, jnp.argmax(logits_BTV[:, 4:-1], -1))
    key = jax.random.PRNGKey(3)
    sampled = [gen.generate(model, prompt_BT, max_new_tokens=9, temperature=1.0, top_k=8,
                            key=key) for _ in range(2)]
    np.testing.assert_array_equal(*sampled)


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
    """A small run (the config of test_finetune_experiment.py's base run: in one pytest run
    they compile the same programs)."""
    from jaxaccel.run.loop import train
    from tests.test_loop import small_config
    tmp = tmp_path_factory.mktemp("sample")
    return train(small_config(corpus_path, tmp, "base", steps=4, eval_every=0,
                              n_layers=1)).run_dir


def test_sample_command(trained_run, tmp_path, capsys):
    out = tmp_path / "sample.json"
    args = ["--run-dir", trained_run, "--prompt", "def f(", "--max-new-tokens", "12",
            "--num-samples", "2", "--seed", "3", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "--- sample 1 (step 4 of" in text and "decode tok/s" in text
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
