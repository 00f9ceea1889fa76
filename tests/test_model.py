import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxaccel.core.errors import ConfigError
from jaxaccel.model.gpt import PRESETS, GPTConfig, GPTSettings, preset
from jaxaccel.model.contract import ModelConfig, build, count_params, make_apply

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


def matmul_params(cfg: GPTConfig) -> int:
    """Weights of the GPT that take part in a matmul per token: all but the embedding lookup (a
    tied head multiplies by the embedding matrix, so it counts once)."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    mlp = d * cfg.d_ff * (3 if cfg.mlp == "swiglu" else 2)
    return cfg.n_layers * (attn + mlp) + d * cfg.vocab_size


def small_model(seed, **fields):
    """The tiny preset at SMALL's shape with ``fields`` changed, built as ``--model tiny`` is
    (``jaxaccel.model.contract.build``), and its GPTConfig."""
    shape = {**SMALL, **fields}
    vocab, context = shape.pop("vocab_size"), shape.pop("max_seq_len")
    model = build(ModelConfig(name="tiny", max_seq_len=context, vocab_size=vocab),
                  GPTSettings(**shape), jax.random.PRNGKey(seed))
    return model, model.cfg


def apply_of(model):
    graphdef, state = nnx.split(model)
    return make_apply(graphdef), state


def batch_of(inputs, segment_ids=None):
    inputs = np.asarray(inputs, np.int32)
    segment_ids = np.ones_like(inputs) if segment_ids is None else np.asarray(segment_ids)
    positions = np.zeros_like(inputs)
    for b in range(inputs.shape[0]):
        for t in range(1, inputs.shape[1]):
            same = segment_ids[b, t] == segment_ids[b, t - 1]
            positions[b, t] = positions[b, t - 1] + 1 if same else 0
    return {"inputs": inputs, "segment_ids": np.asarray(segment_ids, np.int32),
            "positions": positions}


@pytest.mark.parametrize("mlp,tie,kv", [("swiglu", False, 4), ("gelu", True, 2), ("swiglu", True, 1)])
def test_shapes_dtypes_and_parameter_count(mlp, tie, kv):
    model, cfg = small_model(0, mlp=mlp, tie_embeddings=tie, n_kv_heads=kv)
    apply, state = apply_of(model)
    params = nnx.to_pure_dict(nnx.filter_state(state, nnx.Param))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert ("head" in params) == (not tie)
    assert params["blocks"]["layers"][0]["attn"]["wk"]["kernel"].shape == (32, kv * 8)
    embed = cfg.vocab_size * cfg.d_model
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    assert count_params(state) == matmul_params(cfg) + norms + (0 if tie else embed)
    logits = jax.jit(apply)(state, batch_of(np.ones((2, 16))))
    assert logits.shape == (2, 16, 64) and logits.dtype == jnp.float32


def test_causal_and_segment_masking_at_model_level():
    apply, params = apply_of(small_model(1, n_kv_heads=2)[0])
    apply = jax.jit(apply)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 64, (1, 12))
    seg = np.array([[1] * 5 + [2] * 5 + [0] * 2])
    base = apply(params, batch_of(tokens, seg))
    later = tokens.copy(); later[0, 8] = (later[0, 8] + 1) % 64
    out = apply(params, batch_of(later, seg))
    np.testing.assert_array_equal(base[0, :8], out[0, :8])          # earlier tokens unchanged
    other = tokens.copy(); other[0, 1] = (other[0, 1] + 7) % 64
    out = apply(params, batch_of(other, seg))
    np.testing.assert_array_equal(base[0, 5:10], out[0, 5:10])      # segment 2 ignores segment 1
    assert not np.array_equal(base[0, 1:5], out[0, 1:5])


def test_packed_documents_match_separate_documents():
    apply, params = apply_of(small_model(2)[0])
    apply = jax.jit(apply)
    a, b = [5, 6, 7, 8, 9], [10, 11, 12]
    packed = apply(params, batch_of([a + b], [[1] * 5 + [2] * 3]))
    alone_b = apply(params, batch_of([b]))
    np.testing.assert_allclose(packed[0, 5:], alone_b[0], rtol=1e-5, atol=1e-5)


def test_presets_and_overrides():
    small = PRESETS["small"]
    assert (small.d_model, small.n_layers, small.n_heads, small.max_seq_len) == (768, 12, 12, 1024)
    assert 80e6 < matmul_params(small) < 90e6   # GPT-2 124M minus its 38.6M-entry embedding
    cfg = preset("tiny", n_heads=8, d_model=128)
    assert cfg.n_kv_heads == 8 and cfg.d_ff == 384


@pytest.mark.parametrize("overrides,match", [
    (dict(n_heads=3), "n_heads=3 does not divide d_model"),
    (dict(n_kv_heads=3), "n_kv_heads=3 does not divide n_heads"),
    (dict(mlp="relu"), "unknown mlp"),
    (dict(n_layers=0), "n_layers must be positive"),
])
def test_inconsistent_shapes_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        preset("tiny", **overrides)
