"""Packing changes the layout, never the mathematics: the same losses and gradients."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxaccel.techniques import registry as techniques
from jaxaccel.run.config import TrainConfig, build
from jaxaccel.data.batching import batches
from jaxaccel.model.contract import make_apply
from jaxaccel.step.train import weighted_cross_entropy


def config(**values):
    """The tiny preset at 2 x 32, two key/value heads, context 64, vocabulary 64."""
    cfg = build(TrainConfig, {"gpt.d_model": 32, "gpt.n_layers": 2, "gpt.n_heads": 4,
                              "gpt.n_kv_heads": 2, "model.max_seq_len": 64, **values})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=64))


CFG = config()


def init_params(cfg, key):
    """``(graphdef, state)`` of ``cfg``'s model, every technique applied."""
    return nnx.split(techniques.build(cfg, key))


def loss_sum_and_grad(model, batch_list):
    """The loss summed over the batches and its gradient: each batch's, jitted (one compile per
    batch shape), added up."""
    graphdef, params = model
    apply_fn = make_apply(graphdef)

    @jax.jit
    def one(params, b):
        return jax.value_and_grad(lambda p: weighted_cross_entropy(
            apply_fn(p, b), b["targets"], b["weights"])[0])(params)

    results = [one(params, b) for b in batch_list]
    return (sum(loss for loss, _ in results),
            jax.tree.map(lambda *g: sum(g), *[g for _, g in results]))


def test_packed_loss_and_gradient_equal_documents_one_by_one():
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 64, n).astype(np.int32) for n in (5, 17, 30, 9, 2, 41, 12, 23)]
    model = init_params(CFG, jax.random.PRNGKey(0))
    packed = list(batches(docs, strategy="pack", seq_len=64, batch_size=2, seed=3))
    assert len(packed) < len(docs)                                   # rows really hold several
    assert max(int(b["segment_ids"].max()) for b in packed) >= 3
    alone = list(batches(docs, strategy="fixed", seq_len=64, batch_size=1, shuffle=False))
    loss_packed, grad_packed = loss_sum_and_grad(model, packed)
    loss_alone, grad_alone = loss_sum_and_grad(model, alone)
    np.testing.assert_allclose(loss_packed, loss_alone, rtol=1e-5)
    for g_p, g_a in zip(jax.tree.leaves(grad_packed), jax.tree.leaves(grad_alone)):
        scale = float(np.abs(g_a).max())
        np.testing.assert_allclose(g_p, g_a, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("strategy,extra", [
    # rows skipped, None passed on
    ("fixed", {"stochastic_depth.rate": 0.5, "remat.scan_layers": True}),
    ("bucket", {}),
])
def test_rows_of_one_document_train_the_same_without_a_segment_mask(strategy, extra):
    """Every batching but pack lays one document per row from column 0, so causal attention
    with no segment mask (``segment_attention=False``, what the loop uses for them) gives the
    same loss and gradients as the masked one: the padding comes after every real token."""
    cfg = config(**extra)
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, 64, n).astype(np.int32) for n in (5, 17, 30, 9, 2, 41, 12, 23, 70)]
    batch = next(iter(batches(docs, strategy=strategy, seq_len=48, batch_size=8,
                              shuffle=False, **({"num_buckets": 2} if strategy == "bucket"
                                                else {}))))
    assert (batch["segment_ids"] == 0).any() and batch["segment_ids"].max() == 1
    batch = {k: jax.numpy.asarray(v) for k, v in batch.items()}
    graphdef, params = init_params(cfg, jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(7)

    def loss_and_grad(segment_attention):
        apply_fn = make_apply(graphdef, segment_attention=segment_attention)
        loss = lambda p: weighted_cross_entropy(apply_fn(p, batch, key), batch["targets"],
                                                batch["weights"])[0]
        jaxpr = str(jax.make_jaxpr(loss)(params))
        return jax.jit(jax.value_and_grad(loss))(params), jaxpr

    (loss_masked, grad_masked), _ = loss_and_grad(True)
    (loss_causal, grad_causal), jaxpr = loss_and_grad(False)
    B, T = batch["segment_ids"].shape
    assert f"bool[{B},{T},{T}]" not in jaxpr and f"bool[{B},1,{T},{T}]" not in jaxpr
    np.testing.assert_allclose(loss_causal, loss_masked, rtol=1e-6)
    for g_c, g_m in zip(jax.tree.leaves(grad_causal), jax.tree.leaves(grad_masked)):
        np.testing.assert_allclose(g_c, g_m, rtol=1e-5, atol=1e-6 * float(np.abs(g_m).max()))
