"""The embedding lookups: a one-hot matmul (small vocabularies on GPUs) and a gather with a
sorted segment-sum backward (large ones), equal to the gather in values and gradients, with no
scatter-add in their backward passes; the plain gather on a CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccel.model import embedding
from jaxaccel.model.gpt import ACTIVATION_AXES


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
    assert embedding.method(320, "gpu") == "one_hot" and embedding.method(320, "cpu") == "gather"
    assert embedding.method(320, "cpu", jnp.bfloat16) == "sorted_sum"   # sums in float32
    got = embedding.lookup(table_VD, ids_BT, ACTIVATION_AXES, "one_hot")
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(embedding.gather_lookup(table_VD, ids_BT),
                                             np.float32))

    def loss(lookup):
        def f(table_VD):
            x_BTD = lookup(table_VD).astype(jnp.float32)
            return jnp.sum(jnp.sin(x_BTD) * jnp.arange(48))
        return f
    one_hot = lambda t: embedding.lookup(t, ids_BT, ACTIVATION_AXES, "one_hot")  # noqa: E731
    g_one_hot = jax.grad(loss(one_hot))(table_VD)
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
    grad = jax.jit(jax.grad(lambda t: embedding.lookup(t, ids_BT, ACTIVATION_AXES,
                                                       "one_hot").sum()))
    assert "scatter" not in grad.lower(table_VD).as_text()
    gather_grad = jax.jit(jax.grad(lambda t: embedding.gather_lookup(t, ids_BT).sum()))
    assert "scatter" in gather_grad.lower(table_VD).as_text()       # what the one-hot avoids
    big_VD = jax.random.normal(jax.random.PRNGKey(0), (embedding.ONE_HOT_MAX_VOCAB + 1, 8))
    assert embedding.method(big_VD.shape[0], "gpu") == "sorted_sum"
    ids = jnp.array([[0, 5, embedding.ONE_HOT_MAX_VOCAB]])
    for how in embedding.METHODS:       # auto is the gather here, a float32 table on the CPU
        np.testing.assert_array_equal(embedding.lookup(big_VD, ids, ACTIVATION_AXES, how),
                                      big_VD[ids])
    with pytest.raises(ValueError, match="unknown embedding method 'scatter'"):
        embedding.lookup(big_VD, ids, ACTIVATION_AXES, "scatter")


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
    got = embedding.lookup(table_VD, ids_BT, ACTIVATION_AXES, "sorted_sum")
    np.testing.assert_array_equal(got, embedding.gather_lookup(table_VD, ids_BT))

    def grad(lookup, table):        # jitted: one compile, not one per operation
        return jax.jit(jax.grad(lambda t: jnp.sum(jnp.sin(lookup(t).astype(jnp.float32))
                                                  * jnp.arange(D))))(table)

    sorted_grad = grad(lambda t: embedding.lookup(t, ids_BT, ACTIVATION_AXES, "sorted_sum"),
                       table_VD)
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
    text = jax.jit(lambda t: grad(lambda u: embedding.lookup(u, ids_BT, ACTIVATION_AXES,
                                                             "sorted_sum"),
                                  t)).lower(table_VD).as_text()
    assert "scatter" in text and "unique_indices = true" in text, "a scatter-add"


def test_the_benchmark_times_every_method_and_checks_its_gradient(tmp_path, capsys):
    """``experiments.embedding``: a row per vocabulary, id distribution and method, each output
    equal to the gather's and each gradient near a float64 scatter's; vocabularies the byte ids
    do not fit are skipped with the reason."""
    import json

    from experiments import embedding as benchmark

    path = tmp_path / "embedding.json"
    assert benchmark.main(["--vocabs", "48,320", "--d-model", "8", "--batch", "2", "--seq-len",
                           "32", "--iters", "1", "--warmup", "0", "--dtype", "float32",
                           "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 2 * 3 * 3
    timed = [r for r in rows if r["status"] == "ok"]
    assert {(r["V"], r["ids"]) for r in timed} == {(48, "uniform"), (48, "zipf"),
                                                   (320, "uniform"), (320, "zipf"),
                                                   (320, "bytes")}
    assert all(r["grad_error"] < 1e-6 and r["ms"] > 0 for r in timed)
    assert {r["status"] for r in rows if r not in timed} == {"skipped: bytes ids need V >= 320"}
    assert [r["method"] for r in timed if r["auto"] == "*"] == ["gather"] * 5     # on the CPU
    assert "V=320 bytes: fastest" in capsys.readouterr().out
