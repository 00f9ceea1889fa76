"""The embedding lookup: a one-hot matmul for small vocabularies, equal to the gather in values
and gradients, and with no scatter in its backward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccel import embedding
from jaxaccel.model import ACTIVATION_AXES


def skewed_ids(key, shape, vocab):
    """Ids like text's: a few ids take most positions (every scatter-add collides on them)."""
    common = jax.random.randint(key, shape, 0, 4)
    rare = jax.random.randint(jax.random.fold_in(key, 1), shape, 0, vocab)
    return jnp.where(jax.random.uniform(jax.random.fold_in(key, 2), shape) < 0.7, common, rare)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_hot_lookup_equals_the_gather(dtype):
    key = jax.random.PRNGKey(0)
    table_VD = jax.random.normal(key, (320, 48), jnp.float32).astype(dtype)
    ids_BT = skewed_ids(key, (4, 64), 320)
    assert embedding.method(320) == "one_hot"
    got = embedding.lookup(table_VD, ids_BT, ACTIVATION_AXES)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(embedding.gather_lookup(table_VD, ids_BT),
                                             np.float32))

    def loss(lookup):
        def f(table_VD):
            x_BTD = lookup(table_VD).astype(jnp.float32)
            return jnp.sum(jnp.sin(x_BTD) * jnp.arange(48))
        return f
    g_one_hot = jax.grad(loss(lambda t: embedding.lookup(t, ids_BT, ACTIVATION_AXES)))(table_VD)
    g_gather = jax.grad(loss(lambda t: embedding.gather_lookup(t, ids_BT)))(table_VD)
    if dtype == jnp.float32:
        np.testing.assert_allclose(g_one_hot, g_gather, rtol=1e-5, atol=1e-5)
        return
    # bf16: the rows many tokens share sum ~90 gradients. The scatter adds them in bf16; the
    # one-hot matmul accumulates in float32 and rounds once. Against the float32 gradient of the
    # same bf16 table, the one-hot is within 1 % of the largest entry and no worse than the gather.
    exact = jax.grad(loss(lambda t: embedding.gather_lookup(t, ids_BT)))(
        table_VD.astype(jnp.float32))
    scale = float(jnp.abs(exact).max())

    def error(g):
        return float(jnp.abs(g.astype(jnp.float32) - exact).max()) / scale
    assert error(g_one_hot) < 0.01 and error(g_one_hot) <= error(g_gather), \
        (error(g_one_hot), error(g_gather))


def test_the_backward_has_no_scatter_and_large_vocabularies_gather():
    table_VD = jnp.ones((320, 16))
    ids_BT = jnp.zeros((2, 8), jnp.int32)
    grad = jax.jit(jax.grad(lambda t: embedding.lookup(t, ids_BT, ACTIVATION_AXES).sum()))
    assert "scatter" not in grad.lower(table_VD).as_text()
    gather_grad = jax.jit(jax.grad(lambda t: embedding.gather_lookup(t, ids_BT).sum()))
    assert "scatter" in gather_grad.lower(table_VD).as_text()       # what the one-hot avoids
    big_VD = jax.random.normal(jax.random.PRNGKey(0), (embedding.ONE_HOT_MAX_VOCAB + 1, 8))
    assert embedding.method(big_VD.shape[0]) == "sorted_sum"
    ids = jnp.array([[0, 5, embedding.ONE_HOT_MAX_VOCAB]])
    np.testing.assert_array_equal(embedding.lookup(big_VD, ids, ACTIVATION_AXES), big_VD[ids])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_vocabularies_sum_their_gradient_rows_sorted(dtype):
    """Above ONE_HOT_MAX_VOCAB: the gather's values; the table gradient summed per id by a
    segmented scan over the sorted tokens (each id's rows added once, in float32), equal to the
    scatter's in float32, closer to the exact one in bfloat16, and written without a scatter-add
    (a scatter whose rows are all distinct)."""
    V, D = 4099, 24
    key = jax.random.PRNGKey(3)
    table_VD = jax.random.normal(key, (V, D), jnp.float32).astype(dtype)
    ids_BT = skewed_ids(key, (4, 96), V).at[0, :3].set(V - 1)      # the last id too
    got = embedding.lookup(table_VD, ids_BT, ACTIVATION_AXES)
    np.testing.assert_array_equal(got, embedding.gather_lookup(table_VD, ids_BT))

    def grad(lookup, table):
        return jax.grad(lambda t: jnp.sum(jnp.sin(lookup(t).astype(jnp.float32))
                                          * jnp.arange(D)))(table)

    sorted_grad = grad(lambda t: embedding.lookup(t, ids_BT, ACTIVATION_AXES), table_VD)
    assert sorted_grad.dtype == dtype
    exact = grad(lambda t: embedding.gather_lookup(t, ids_BT), table_VD.astype(jnp.float32))
    scale = float(jnp.abs(exact).max())
    error = float(jnp.abs(sorted_grad.astype(jnp.float32) - exact).max()) / scale
    if dtype == jnp.float32:
        assert error < 1e-6, error
    else:
        scatter = grad(lambda t: embedding.gather_lookup(t, ids_BT), table_VD)
        scatter_error = float(jnp.abs(scatter.astype(jnp.float32) - exact).max()) / scale
        assert error < 0.01 and error <= scatter_error, (error, scatter_error)
    absent = np.setdiff1d(np.arange(V), np.asarray(ids_BT))
    assert not np.asarray(sorted_grad, np.float32)[absent].any()
    text = jax.jit(lambda t: grad(lambda u: embedding.lookup(u, ids_BT, ACTIVATION_AXES),
                                  t)).lower(table_VD).as_text()
    assert "scatter" in text and "unique_indices = true" in text, "a scatter-add"
