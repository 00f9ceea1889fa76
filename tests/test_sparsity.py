"""N:M structured sparsity (jaxaccel.sparsity): the masks, the masked forward pass, SR-STE's
gradient, the schedule of mask updates through the train step, the savings and bad settings."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxaccel import buffers, lora, sparsity
from jaxaccel.config import build
from jaxaccel.errors import ConfigError
from jaxaccel.model import flops_per_token, init_params, make_apply
from jaxaccel.state import init_state
from jaxaccel.train import lm_train_step
from tests.test_techniques import batch, small


def projections(params, scan=False):
    """The (kernel, nm_mask) pairs of the blocks' projections."""
    pairs = []
    blocks = [params["blocks"]] if scan else params["blocks"].values()
    for block in blocks:
        for part in ("attn", "mlp"):
            for layer in block[part].values():
                pairs.append((layer["kernel"], layer["nm_mask"]))
    return pairs


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
    cfg = small(sparsity="2:4")
    params = init_params(cfg, jax.random.PRNGKey(0))
    for kernel, mask in projections(params):
        assert np.all(np.asarray(mask).reshape(-1, 4, mask.shape[1]).sum(axis=1) == 2)
    assert "nm_mask" not in str(jax.tree_util.tree_structure(params["embed"]))
    dense_cfg = small()
    masked = jax.tree_util.tree_map_with_path(lambda p, x: x, params)
    for block in masked["blocks"].values():
        for part in ("attn", "mlp"):
            for name, layer in block[part].items():
                block[part][name] = {"kernel": layer["kernel"] * layer["nm_mask"]}
    np.testing.assert_allclose(make_apply(cfg)(params, batch()),
                               make_apply(dense_cfg)(masked, batch()), rtol=1e-6, atol=1e-6)


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
    cfg = small(sparsity="2:4", sparsity_every=2, scan_layers=scan)
    optimizer = optax.sgd(0.5)                       # big steps, so masks change
    trainable = lora.trainable(cfg)
    state = init_state(init_params(cfg, jax.random.PRNGKey(0)), optimizer, 0, trainable=trainable)
    assert "nm_mask" not in str(jax.tree_util.tree_structure(state.opt_state))
    step = jax.jit(lm_train_step(make_apply(cfg), optimizer, trainable=trainable,
                                 update_buffers=buffers.updater(cfg)))
    changed = []
    for i in range(4):
        before = projections(state.params, scan)
        state, metrics = step(state, batch(seed=i))
        after = projections(state.params, scan)
        for (_, old_mask), (kernel, mask) in zip(before, after):
            if i % 2 == 0:                            # steps 0, 2: masks kept
                np.testing.assert_array_equal(mask, old_mask)
            else:                                     # steps 1, 3: recomputed from the kernel
                np.testing.assert_array_equal(mask, sparsity.nm_mask(kernel, 2, 4))
                changed.append(bool(np.any(mask != old_mask)))
    assert any(changed)
    assert sparsity.density(state.params) == pytest.approx(0.5)


def test_savings_and_bad_settings():
    cfg = small(sparsity="2:4")
    saved = sparsity.savings(cfg, 32)
    sparse = sparsity.sparse_params(cfg)
    assert saved["flops_share"] == pytest.approx(3 * sparse / flops_per_token(cfg, 32))
    assert saved["flops_share_fwd_dgrad"] == pytest.approx(2 / 3 * saved["flops_share"])
    assert saved["weight_bytes_share"] == pytest.approx(1 - 0.5 * (1 + 2 / 16))
    for text in ("4:4", "0:4", "2", "a:b", "2:4:8"):
        with pytest.raises(ConfigError, match="N:M with 0 < N < M"):
            small(sparsity=text)
    with pytest.raises(ConfigError, match="not a multiple of 3"):
        small(sparsity="2:3")
    with pytest.raises(ConfigError, match="sparsity_every"):
        small(sparsity="2:4", sparsity_every=0)
    with pytest.raises(ConfigError, match="sparsity_decay"):
        small(sparsity="2:4", sparsity_decay=float("nan"))
    with pytest.raises(ConfigError, match="sparsity does not run with the pipeline"):
        build(values={"model.sparsity": "2:4", "mesh.strategy": "pp",
                      "model.scan_layers": True}).validate()


def test_the_experiment_compares_patterns_with_dense(corpus_path, tmp_path, capsys):
    from experiments.sparsity import main
    out = tmp_path / "sparsity.json"
    common = ["--data", corpus_path, "--d-model", "32", "--n-layers", "2", "--n-heads", "4",
              "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "4", "--steps", "4",
              "--final-eval-batches", "2", "--no-progress", "--sparsity-every", "2",
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
