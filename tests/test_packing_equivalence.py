"""Packing changes the layout, never the mathematics: the same losses and gradients."""

import jax
import numpy as np

from jaxaccel.data import batches
from jaxaccel.model import ModelConfig, init_params, make_apply
from jaxaccel.train import weighted_cross_entropy

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def loss_sum_and_grad(params, batch_list):
    apply_fn = make_apply(CFG)

    def total(params):
        sums = [weighted_cross_entropy(apply_fn(params, b), b["targets"], b["weights"])[0]
                for b in batch_list]
        return sum(sums)

    return jax.value_and_grad(total)(params)


def test_packed_loss_and_gradient_equal_documents_one_by_one():
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 64, n).astype(np.int32) for n in (5, 17, 30, 9, 2, 41, 12, 23)]
    params = init_params(CFG, jax.random.PRNGKey(0))
    packed = list(batches(docs, strategy="pack", seq_len=64, batch_size=2, seed=3))
    assert len(packed) < len(docs)                                   # rows really hold several
    assert max(int(b["segment_ids"].max()) for b in packed) >= 3
    alone = list(batches(docs, strategy="fixed", seq_len=64, batch_size=1, shuffle=False))
    loss_packed, grad_packed = loss_sum_and_grad(params, packed)
    loss_alone, grad_alone = loss_sum_and_grad(params, alone)
    np.testing.assert_allclose(loss_packed, loss_alone, rtol=1e-5)
    for g_p, g_a in zip(jax.tree.leaves(grad_packed), jax.tree.leaves(grad_alone)):
        scale = float(np.abs(g_a).max())
        np.testing.assert_allclose(g_p, g_a, rtol=1e-5, atol=1e-5 * scale)
