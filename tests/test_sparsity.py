"""N:M structured sparsity (jaxaccel.techniques.sparsity): the masks, the masked forward pass,
SR-STE's
gradient, the schedule of mask updates through the train step, the savings and bad settings."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxaccel.model import nn
from jaxaccel.techniques import sparsity, surgery, registry as techniques
from jaxaccel.run.config import build, check_ranges
from jaxaccel.core.errors import ConfigError
from jaxaccel.run.loop import train_step_of
from jaxaccel.run.loop.finish import flops_per_token
from jaxaccel.step.state import init_state
from tests.test_techniques import apply_of, batch, build_model, copy_of, small


def projections(model):
    """The (kernel, mask) pairs of the sparse layers, in path order."""
    return [(np.asarray(layer.kernel[...]), np.asarray(layer.mask[...]))
            for _, layer in surgery.wrappers(model, sparsity.Sparse)]


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (3, 8)])
def test_masks_keep_the_n_largest_of_every_m_inputs(n, m):
    w = jax.random.normal(jax.random.PRNGKey(n * m), (16, 6))
    w = w.at[0:4, 0].set(0.5)                                    # ties go to the earlier inputs
    mask = np.asarray(sparsity.nm_mask(w, n, m))
    groups = np.abs(np.asarray(w)).reshape(16 // m, m, 6)
    order = np.argsort(-groups, axis=1, kind="stable")           # descending, stable on ties
    expected = np.zeros_like(groups, bool)
    np.put_along_axis(expected, order[:, :n], True, axis=1)
    np.testing.assert_array_equal(mask, expected.reshape(16, 6))
    assert np.all(mask.reshape(16 // m, m, 6).sum(axis=1) == n)


def test_the_forward_pass_uses_the_masked_weights():
    cfg = small({"sparsity.pattern": "2:4"})
    model = build_model(cfg)
    pairs = projections(model)
    assert len(pairs) == 2 * 7                  # every linear layer of the blocks (the default)
    for kernel, mask in pairs:
        assert mask.dtype == bool and mask.shape == kernel.shape
        assert np.all(mask.reshape(-1, 4, mask.shape[1]).sum(axis=1) == 2)
    # The embedding and the head stay dense; the masks are buffers, not weights.
    assert all(path[0] == "blocks" for path, _ in surgery.wrappers(model, sparsity.Sparse))
    assert all(isinstance(v, nn.Buffer) and not isinstance(v, nnx.Param) for v in jax.tree.leaves(
        nnx.state(model, sparsity.Mask), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    # The dense model holding the masked kernels computes the same logits.
    dense = copy_of(model)
    surgery.unwrap(dense)
    assert not surgery.wrappers(dense, sparsity.Sparse)
    np.testing.assert_allclose(apply_of(cfg)(nnx.state(model), batch()),
                               apply_of(small())(nnx.state(dense), batch()), rtol=1e-6,
                               atol=1e-6)


def test_sr_ste_gradient_is_straight_through_plus_decay_on_the_pruned_weights():
    w = jax.random.normal(jax.random.PRNGKey(0), (8, 3))
    mask = sparsity.nm_mask(w, 2, 4)
    target = jax.random.normal(jax.random.PRNGKey(1), (8, 3))

    def loss(weight):
        return jnp.sum(weight * target)                  # d loss / d weight = target

    grad = jax.grad(lambda w: loss(sparsity.sparse_weight(w, mask, 0.1)))(w)
    np.testing.assert_allclose(grad, target + np.where(mask, 0.0, 0.1 * np.asarray(w)), rtol=1e-6)
    plain = jax.grad(lambda w: loss(sparsity.sparse_weight(w, mask, 0.0)))(w)
    np.testing.assert_allclose(plain, target)            # pruned weights still get the gradient


@pytest.mark.parametrize("scan", [False, True])
def test_masks_update_on_schedule_and_are_not_trained(scan):
    cfg = small({"sparsity.pattern": "2:4", "sparsity.every": 2, "remat.scan_layers": scan})
    optimizer = optax.sgd(0.5)                       # big steps, so masks change
    model = build_model(cfg)
    graphdef, params = nnx.split(model)
    trainable = nn.trainable(params)
    state = init_state(params, optimizer, 0, trainable=trainable)
    assert not [p for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
                if "mask" in jax.tree_util.keystr(p)]
    step = jax.jit(train_step_of(cfg, model, optimizer))       # as the loop builds it
    changed = []
    for i in range(4):
        before = projections(nnx.merge(graphdef, state.params))
        state, metrics = step(state, batch(seed=i))
        after = projections(nnx.merge(graphdef, state.params))
        for (_, old_mask), (kernel, mask) in zip(before, after):
            if i % 2 == 0:                            # steps 0, 2: masks kept
                np.testing.assert_array_equal(mask, old_mask)
            else:                                     # steps 1, 3: recomputed from the kernel
                np.testing.assert_array_equal(mask, sparsity.nm_mask(kernel, 2, 4))
                changed.append(bool(np.any(mask != old_mask)))
    assert any(changed)
    assert sparsity.density(state.params) == pytest.approx(0.5)


def checked(values):
    """``small(values)`` checked as a run checks it before any work (its ranges, the
    techniques together, the model built abstractly)."""
    cfg = small(values)
    check_ranges(cfg)
    techniques.check(cfg)
    techniques.abstract(cfg)
    return cfg


def test_savings_and_bad_settings():
    cfg = small({"sparsity.pattern": "2:4"})
    model = build_model(cfg)
    per_token = flops_per_token(cfg, model)
    saved = sparsity.savings(nnx.state(model), "2:4", per_token)
    sparse = sum(kernel.size for kernel, _ in projections(model))
    assert saved["sparse_params"] == sparse == 2 * (4 * 64 * 64 + 3 * 64 * 192)
    assert saved["flops_share"] == pytest.approx(3 * sparse / per_token)
    assert 0 < saved["flops_share"] < 0.5              # the head and attention stay dense
    assert saved["flops_share_fwd_dgrad"] == pytest.approx(2 / 3 * saved["flops_share"])
    assert saved["weight_bytes_share"] == pytest.approx(1 - 0.5 * (1 + 2 / 16))
    assert sparsity.density(nnx.state(model)) == pytest.approx(0.5)
    for text in ("4:4", "0:4", "2", "a:b", "2:4:8"):
        with pytest.raises(ConfigError, match="N:M with 0 < N < M") as info:
            checked({"sparsity.pattern": text})
        assert info.value.field == "sparsity.pattern"
    with pytest.raises(ConfigError, match="groups 3 input features, but a targeted layer has 64"):
        checked({"sparsity.pattern": "2:3"})
    for field, value in (("sparsity.every", 0), ("sparsity.decay", float("nan"))):
        with pytest.raises(ConfigError) as info:
            checked({"sparsity.pattern": "2:4", field: value})
        assert info.value.field == field
    with pytest.raises(ConfigError, match="sparsity does not run with the pipeline"):
        build(values={"sparsity.pattern": "2:4", "mesh.strategy": "pp",
                      "remat.scan_layers": True}).validate()


def test_the_experiment_compares_patterns_with_dense(corpus_path, tmp_path, capsys):
    """Dense and 2:4 rows, on one layer (what is checked of the rows holds at any depth; the
    savings' own figures: test_savings_and_bad_settings); then a bad pattern is one line."""
    from experiments.sparsity import main
    out = tmp_path / "sparsity.json"
    common = ["--data", corpus_path, "--d-model", "32", "--n-layers", "1", "--n-heads", "4",
              "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "4", "--steps", "4",
              "--final-eval-batches", "1", "--no-progress", "--sparsity-every", "2",
              "--cache-dir", str(tmp_path / "cache")]
    assert main([*common, "--patterns", "2:4", "--run-dir", str(tmp_path / "s"),
                 "--json", str(out)]) == 0
    rows = json.load(open(out))["rows"]
    assert [r["pattern"] for r in rows] == ["dense", "2:4"]
    dense, sparse = rows
    assert dense["density"] is None and sparse["density"] == pytest.approx(0.5)
    assert dense["val_vs_dense"] == 0 and np.isfinite(sparse["val_vs_dense"])
    assert sparse["val_bpb"] != dense["val_bpb"]
    assert 0 < sparse["flops_share_fwd_dgrad"] < sparse["flops_share"] < 0.5
    assert "no N:M sparse kernel" in capsys.readouterr().out
    assert main([*common, "--patterns", "2:4,3:3", "--run-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "N:M with 0 < N < M" in err[0]
    assert not (tmp_path / "bad").exists()
