import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccel.model.attention import dot_product_attention
from jaxaccel.core.errors import ConfigError
from tests.reference import reference_attention


@pytest.mark.parametrize("T,H,K,E", [(1, 2, 2, 8), (7, 4, 2, 16), (33, 4, 1, 8), (16, 2, 2, 64)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_segments", [True, False])
def test_xla_matches_float64_reference(T, H, K, E, causal, with_segments):
    rng = np.random.default_rng(T * 100 + H)
    q, k, v = (rng.standard_normal((2, T, n, E)).astype(np.float32) for n in (H, K, K))
    segment_ids = None
    if with_segments:
        segment_ids = np.sort(rng.integers(0, 3, (2, T)), axis=1).astype(np.int32)
    out = dot_product_attention(q, k, v, segment_ids=segment_ids, causal=causal)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference_attention(q, k, v, segment_ids, causal),
                               rtol=2e-5, atol=2e-5)


def test_bfloat16_inputs_give_bfloat16_output_close_to_reference():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 9, 2, 16)).astype(np.float32) for _ in range(3))
    out = dot_product_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               reference_attention(q, k, v, None, True), atol=0.06)


def test_gradients_match_reference_by_finite_differences():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 5, 2, 4)) for _ in range(3))
    seg = np.array([[1, 1, 2, 2, 2]], np.int32)
    with jax.enable_x64():
        f = lambda q, k, v: jnp.sum(jnp.sin(dot_product_attention(q, k, v, segment_ids=seg)))
        grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
        ref = lambda q, k, v: np.sum(np.sin(reference_attention(q, k, v, seg, True)))
        eps = 1e-6
        for arg, g in enumerate(grads):
            x = [q, k, v]
            idx = (0, 3, 1, 2)
            plus = [a.copy() for a in x]; plus[arg][idx] += eps
            minus = [a.copy() for a in x]; minus[arg][idx] -= eps
            numeric = (ref(*plus) - ref(*minus)) / (2 * eps)
            np.testing.assert_allclose(g[idx], numeric, rtol=1e-5, atol=1e-7)


def test_later_and_other_segment_tokens_do_not_leak():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 8, 2, 8)).astype(np.float32) for _ in range(3))
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0]], np.int32)
    base = dot_product_attention(q, k, v, segment_ids=seg)
    k2, v2 = k.copy(), v.copy()
    k2[:, 5:], v2[:, 5:] = 9.0, -9.0            # later tokens of segment 2 and padding
    k2[:, :3] += 5.0                            # every token of segment 1
    changed = dot_product_attention(q, k2, v2, segment_ids=seg)
    np.testing.assert_array_equal(base[:, 3:5], changed[:, 3:5])


def test_bad_shapes_and_implementations_raise_config_errors():
    q = jnp.zeros((1, 4, 3, 8))
    kv = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ConfigError, match="do not divide") as info:
        dot_product_attention(q, kv, kv)
    assert info.value.field == "gpt.n_kv_heads"
    from jaxaccel.run.config import describe_error
    assert describe_error(info.value).endswith("[--n-kv-heads / gpt.n_kv_heads]")
    with pytest.raises(ConfigError, match="expects \\[batch, seq, heads, head_dim\\]"):
        dot_product_attention(q[0], kv, kv)
    with pytest.raises(ConfigError, match="k and v must match each other and q in batch and "
                                          "head_dim"):
        dot_product_attention(q, kv, kv[..., :4])
    with pytest.raises(ConfigError, match="unknown attention implementation") as info:
        dot_product_attention(q, q, q, implementation="flash9000")
    assert info.value.field == "gpt.attention"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error off the GPU")
def test_cudnn_off_gpu_is_a_clear_error():
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU") as info:
        dot_product_attention(q, q, q, implementation="cudnn")
    assert info.value.field == "gpt.attention"


def test_auto_picks_per_shape_and_layout(monkeypatch):
    """auto: xla off NVIDIA GPUs and on ones older than sm80; on newer ones pallas for packed
    rows (segment ids) and up to AUTO_PALLAS_MAX_T tokens, cuDNN for longer unpacked rows."""
    from jaxaccel.model import attention
    assert attention.resolve_implementation("auto", 4096) == "xla"          # this CPU
    assert attention.resolve_implementation("cudnn", 16) == "cudnn"
    device = type("Device", (), {"compute_capability": "9.0"})()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    limit = attention.AUTO_PALLAS_MAX_T
    assert attention.resolve_implementation("auto", limit) == "pallas"
    assert attention.resolve_implementation("auto", limit + 1) == "cudnn"
    assert attention.resolve_implementation("auto", 16 * limit, segments=True) == "pallas"
    assert attention.resolve_implementation("auto", 16 * limit, head_dim=60) == "pallas"
    assert attention.resolve_implementation("auto", 16 * limit, head_dim=256) == "cudnn"
    device.compute_capability = "8.0"       # before Hopper, cuDNN's head dims end at 128
    assert attention.resolve_implementation("auto", 16 * limit, head_dim=256) == "pallas"
    assert attention.resolve_implementation("auto", 16 * limit, head_dim=128) == "cudnn"
    assert attention.resolve_implementation("auto", limit, head_dim=320) == "xla"
    device.compute_capability = "7.5"
    assert attention.resolve_implementation("auto", 16 * limit) == "xla"
