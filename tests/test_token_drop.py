"""Token dropping (``jaxaccel.token_drop``): keep 1 is the plain model bit for bit, the kept tokens
run the middle layers as the kept subset alone would, the dropped ones pass them unchanged, the
running loss buffer follows its rule and is not trained, the FLOPs accounting matches XLA's, bad
settings are one line, and ``experiments.token_drop`` runs."""

import dataclasses
import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import token_drop as experiment
from experiments.train import main as train_main
from jaxaccel import buffers, grads, lora
from jaxaccel import token_drop as td
from jaxaccel.errors import ConfigError
from jaxaccel.model import flops_per_token, init_params, make_apply, model_parts, preset
from jaxaccel.state import init_state
from jaxaccel.train import lm_train_step

T = 32


def small(**fields):
    return preset("tiny", **{"d_model": 32, "n_layers": 4, "n_heads": 2, "max_seq_len": T,
                             **fields})


def batch(rows=4, seed=0):
    """Two documents per row, the second ending before the row does (padding after it)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 300, (rows, T)).astype(np.int32)
    segment_ids = np.zeros((rows, T), np.int32)
    positions = np.zeros((rows, T), np.int32)
    for r in range(rows):
        split, end = int(rng.integers(6, 16)), int(rng.integers(24, T + 1))
        segment_ids[r, :split], segment_ids[r, split:end] = 1, 2
        positions[r, :split], positions[r, split:end] = np.arange(split), np.arange(end - split)
    real = segment_ids > 0
    return {"inputs": jnp.asarray(ids * real), "targets": jnp.asarray(np.roll(ids, -1, 1) * real),
            "weights": jnp.asarray(real, jnp.float32), "segment_ids": jnp.asarray(segment_ids),
            "positions": jnp.asarray(positions)}


def train_step(cfg, accumulate=1):
    """A jitted train step of ``cfg`` as the loop builds it, and its initial state."""
    optimizer, trainable = optax.adam(1e-2), lora.trainable(cfg)
    step = jax.jit(lm_train_step(make_apply(cfg), optimizer, accumulate=accumulate,
                                 trainable=trainable, update_buffers=buffers.updater(cfg)))
    state = init_state(init_params(cfg, jax.random.PRNGKey(0)), optimizer, 0,
                       trainable=trainable)
    return step, state


def test_keep_one_is_the_plain_model_bitwise():
    """keep 1 (with a drop range and the loss score set) trains bit for bit as the plain model:
    the same logits with a key, the same gradients and updates through the train step."""
    plain, off = small(), small(token_keep=1.0, token_drop_layers="1:3", token_drop_score="loss")
    params = init_params(off, jax.random.PRNGKey(0))
    chex.assert_trees_all_equal(params, init_params(plain, jax.random.PRNGKey(0)))
    key = jax.random.PRNGKey(5)
    logits = make_apply(plain)(params, batch(), key)
    chex.assert_trees_all_equal(make_apply(off)(params, batch(), key), logits)
    (step_off, state_off), (step_plain, state_plain) = train_step(off), train_step(plain)
    for i in range(2):
        state_off, metrics_off = step_off(state_off, batch(seed=i))
        state_plain, metrics_plain = step_plain(state_plain, batch(seed=i))
        chex.assert_trees_all_equal(metrics_off, metrics_plain)     # loss, grad norm, ...
    chex.assert_trees_all_equal(state_off, state_plain)
    # Dropping tokens changes training, not evaluation: without a key every token runs.
    on = small(token_keep=0.5)
    assert not jnp.allclose(make_apply(on)(params, batch(), key), logits, atol=1e-3)
    chex.assert_trees_all_equal(make_apply(on)(params, batch()), logits)   # plain ignores keys


def test_keeping_every_token_through_the_drop_path_is_the_identity():
    """The gather, the layers and the scatter with K = T: the selection is every position in
    order, so a position-dependent computation comes out bit for bit."""
    b = batch()
    x_BTD = jax.random.normal(jax.random.PRNGKey(1), (4, T, 8))
    sin_BTR = jnp.sin(b["positions"][..., None] * jnp.arange(1, 4.0))

    def layers(x, args):
        sin, segment_ids = args
        return jnp.cumsum(x, axis=1) * sin[..., :1] + segment_ids[..., None]

    args = (sin_BTR, b["segment_ids"])
    out = td.run_dropped(layers, x_BTD, args, jax.random.PRNGKey(2), small())   # keep 1: K = T
    chex.assert_trees_all_equal(out, layers(x_BTD, args))


def _blocks_of(params, cfg, layers, scan):
    """A plain model of ``len(layers)`` blocks holding ``params``' blocks ``layers``."""
    part_cfg = dataclasses.replace(cfg, n_layers=len(layers), token_keep=1.0,
                                   token_drop_layers=None)
    part = init_params(part_cfg, jax.random.PRNGKey(9))
    blocks = params["blocks"]
    part["blocks"] = (jax.tree.map(lambda a: a[layers[0]:layers[-1] + 1], blocks) if scan
                      else {i: blocks[layer] for i, layer in enumerate(layers)})
    return lambda x_BTD, b: model_parts(part_cfg).blocks(part, x_BTD, b)


@pytest.mark.parametrize("scan", [False, True])
def test_kept_tokens_run_as_the_kept_subset_and_dropped_ones_pass_unchanged(scan):
    """Layers 1:3 of 3 at keep 0.5: the kept tokens' outputs are what the two last blocks give
    on the kept subset alone (its positions and segments, causal in its order), the dropped
    tokens' are the first block's output, unchanged; padding is dropped first."""
    cfg = small(n_layers=3, token_keep=0.5, token_drop_layers="1:3", scan_layers=scan)
    params = init_params(cfg, jax.random.PRNGKey(0))
    b, key = batch(), jax.random.PRNGKey(7)
    x_BTD = jax.random.normal(jax.random.PRNGKey(1), (4, T, cfg.d_model))
    out_BTD = model_parts(cfg).blocks(params, x_BTD, b, key)

    first_BTD = _blocks_of(params, cfg, [0], scan)(x_BTD, b)
    kept = td.kept_tokens(T, 0.5)
    index_BK = td.select(jax.random.fold_in(key, td.SELECT_KEY), b["segment_ids"], kept)
    assert index_BK.shape == (4, 16) and bool(jnp.all(jnp.diff(index_BK, axis=1) > 0))
    take = lambda a: jnp.take_along_axis(a, index_BK.reshape(*index_BK.shape, *(1,) * (a.ndim - 2)),
                                         axis=1)
    assert bool(jnp.all(take(b["segment_ids"]) > 0))          # at least 24 real tokens a row
    subset = {"positions": take(b["positions"]), "segment_ids": take(b["segment_ids"])}
    middle_BKD = _blocks_of(params, cfg, [1, 2], scan)(take(first_BTD), subset)
    np.testing.assert_allclose(take(out_BTD), middle_BKD, rtol=0, atol=1e-6)
    dropped_BT = jnp.ones((4, T), bool).at[jnp.arange(4)[:, None], index_BK].set(False)
    chex.assert_trees_all_equal(jnp.where(dropped_BT[..., None], out_BTD, 0.0),
                                jnp.where(dropped_BT[..., None], first_BTD, 0.0))
    assert not jnp.allclose(take(out_BTD), take(first_BTD), atol=1e-3)   # the kept ones moved


def test_selection_counts_scores_and_padding():
    assert [td.kept_tokens(t, k) for t, k in [(256, 0.5), (256, 0.75), (100, 0.5), (16, 0.01),
                                              (16, 0.99), (5, 0.5), (64, 1.0)]] == \
        [128, 192, 48, 8, 16, 2, 64]
    assert td.layer_range(small(n_layers=12)) == (3, 9) and td.layer_range(small()) == (1, 3)
    assert td.layer_range(small(n_layers=3)) == (1, 2)
    assert td.dropped_layers(small(n_layers=2, token_keep=0.5)) == 0     # no middle layers
    segment_ids = jnp.asarray([[1] * 10 + [0] * 6, [1] * 4 + [2] * 2 + [0] * 10])
    # Random: padding only when the real tokens are fewer than K; each real token equally likely.
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    picks = jax.vmap(lambda k: td.select(k, segment_ids, 8))(keys)            # [N, 2, 8]
    assert bool(jnp.all(jnp.take_along_axis(jnp.broadcast_to(segment_ids, (4000, 2, 16)), picks,
                                            axis=2)[:, 0] > 0))
    assert bool(jnp.all(picks[:, 1, :6] == jnp.arange(6)))     # all 6 real tokens, then padding
    counts = jnp.zeros(16).at[picks[:, 0].reshape(-1)].add(1.0) / 4000
    np.testing.assert_allclose(counts[:10], 0.8, atol=0.04)
    assert float(counts[10:].sum()) == 0.0
    # Loss: drawn with weights the running loss of the target id: the hard ones kept more often,
    # the easy ones sometimes, padding never.
    token_loss_V = jnp.ones(8).at[5].set(4.0)
    targets = jnp.asarray([[1, 5, 2, 5, 1, 5, 2, 1, 5, 1, 0, 0, 0, 0, 0, 0]] * 2)
    picks = jax.vmap(lambda k: td.select(k, segment_ids, 4, targets, token_loss_V))(keys)
    counts = jnp.zeros(16).at[picks[:, 0].reshape(-1)].add(1.0) / 4000
    hard = targets[0, :10] == 5
    assert float(counts[:10][hard].min()) > 0.6 and 0.05 < float(counts[:10][~hard].max()) < 0.3
    assert float(counts[10:].sum()) == 0.0 and bool(jnp.all(jnp.diff(picks, axis=2) > 0))


def test_loss_buffer_is_a_running_mean_per_target_id_and_is_not_trained():
    """One step over two microbatches: the buffer moves towards each target id's mean loss in
    the step's forward passes (summed over the microbatches) by 1 - DECAY, ids not seen keep
    their value, and the optimizer holds no state for it."""
    cfg = small(token_keep=0.5, token_drop_score="loss")
    step, state = train_step(cfg, accumulate=2)
    assert not any("token_drop" in jax.tree_util.keystr(path) for path, _ in
                   jax.tree_util.tree_flatten_with_path(state.opt_state)[0])
    before = state.params["token_drop"]["token_loss"]
    np.testing.assert_allclose(before, math.log(cfg.vocab_size))
    b = batch(rows=8)
    new, metrics = step(state, b)
    assert "buffer_stats" not in metrics
    # The step's losses, recomputed: microbatch i takes rows i::2 and key fold_in(key, i).
    key = jax.random.fold_in(state.rng, state.step)
    sums, counts = np.zeros(cfg.vocab_size), np.zeros(cfg.vocab_size)
    for i in range(2):
        part = jax.tree.map(lambda a: a[i::2], b)
        logits = make_apply(cfg)(state.params, part, jax.random.fold_in(key, i))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, part["targets"])
        for loss, target, w in zip(np.ravel(losses), np.ravel(part["targets"]),
                                   np.ravel(part["weights"])):
            if w > 0:
                sums[target] += loss
                counts[target] += 1
    seen = counts > 0
    expected = np.where(seen, td.DECAY * np.asarray(before) + (1 - td.DECAY) * sums /
                        np.maximum(counts, 1), np.asarray(before))
    after = np.asarray(new.params["token_drop"]["token_loss"])
    np.testing.assert_allclose(after, expected, rtol=1e-5)
    assert seen.sum() > 50 and (after[~seen] == np.asarray(before)[~seen]).all()
    # The weights did train.
    assert not np.allclose(new.params["head"]["kernel"], state.params["head"]["kernel"])
    trained, frozen = grads.partition(new.params, lora.trainable(cfg))
    assert list(frozen) == ["token_drop"] and "token_drop" not in trained


def test_dropped_compute_matches_the_flops_accounting():
    """XLA's cost analysis of the compiled train step falls by the share flops_per_token
    predicts (unrolled layers: a scan's body is counted once)."""
    def compiled_flops(cfg):
        step, state = train_step(cfg)
        return step.lower(state, batch()).compile().cost_analysis()["flops"]

    plain, dropped = small(), small(token_keep=0.5)
    predicted = flops_per_token(dropped, T) / flops_per_token(plain, T)
    # Layers 1 and 2 at K/T = 1/2: half of their 6 x 16384 matmul FLOPs (q, k, v, o 4 x 32 x 32,
    # SwiGLU 3 x 32 x 128) and 3/4 of their 12 d T attention FLOPs saved.
    saved = 2 * (6 * 16384 * 0.5 + 12 * 32 * T * 0.75)
    assert predicted == pytest.approx(1 - saved / flops_per_token(plain, T))
    assert compiled_flops(dropped) / compiled_flops(plain) == pytest.approx(predicted, abs=0.05)


@pytest.mark.parametrize("fields, message", [
    (dict(token_keep=0.0), "token_keep must be in (0, 1]"),
    (dict(token_keep=1.5), "token_keep must be in (0, 1]"),
    (dict(token_keep=float("nan")), "token_keep must be in (0, 1]"),
    (dict(token_drop_layers="2"), "token_drop_layers must be START:END"),
    (dict(token_drop_layers="a:b"), "token_drop_layers must be START:END"),
    (dict(token_drop_layers="3:2"), "token_drop_layers must be START:END"),
    (dict(token_drop_layers="1:5"), "n_layers=4"),
    (dict(token_drop_score="big"), "unknown token_drop_score 'big'"),
])
def test_bad_settings_are_one_clear_error(fields, message):
    with pytest.raises(ConfigError) as error:
        small(**fields)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert error.value.field.startswith("model.token_")


def test_bad_settings_on_the_command_line_are_one_line(tmp_path, capsys):
    for main, args, flag in [
            (train_main, ["--token-keep", "nan"], "--token-keep"),
            (train_main, ["--token-drop-layers", "0:9"], "--token-drop-layers"),
            (experiment.main, ["--keeps", "0.5,1.5"], "--keeps"),
            (experiment.main, ["--scores", "random,best"], "--scores"),
            (experiment.main, ["--timed-steps", "0"], "--timed-steps")]:
        assert main([*args, "--run-dir", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0], err
    assert not (tmp_path / "runs").exists()


def test_token_drop_experiment_runs_every_row(corpus_path, tmp_path, capsys):
    out = tmp_path / "token_drop.json"
    code = experiment.main([
        "--data", corpus_path, "--d-model", "32", "--n-layers", "4", "--n-heads", "2",
        "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "8", "--steps", "4",
        "--warmup-steps", "1", "--log-every", "2", "--final-eval-batches", "2",
        "--keeps", "0.5", "--scores", "loss", "--timed-rounds", "2", "--timed-steps", "1",
        "--no-progress", "--run-dir", str(tmp_path / "runs"),
        "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {row["label"]: row for row in result["rows"]}
    assert list(rows) == ["keep 1", "keep 0.5 loss"]
    base = rows["keep 1"]
    assert base["speedup"] == 1.0 and base["flops_saved"] == 0.0 and base["kept"] == 32
    for row in rows.values():
        assert row["steps"] == 4 and math.isfinite(row["val_loss"])
        assert row["step_ms"] > 0 and row["train_step_ms"] > 0
        assert row["compiles_after_warmup"] == 0
    row = rows["keep 0.5 loss"]
    assert row["kept"] == 16 and row["drop_layers"] == "1:3" and row["score"] == "loss"
    assert row["flops_saved"] == pytest.approx(
        1 - flops_per_token(small(token_keep=0.5), 32) / flops_per_token(small(), 32))
    assert row["val_loss"] != base["val_loss"]
    assert result["meta"]["token_drop_layers"] == "1:3" and len(result["meta"]["targets"]) == 1
    assert result["meta"]["step_time"].startswith("median of 2 round-robin rounds")
    assert (tmp_path / "runs" / "token_drop.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "| row" in printed and "Targets:" in printed and "keep 0.5 loss" in printed
