"""Token dropping (``jaxaccel.techniques.token_drop``): keep 1 is the plain model bit for bit, the
kept tokens
run the middle layers as the kept subset alone would, the dropped ones pass them unchanged, the
running loss buffer follows its rule and is not trained, the FLOPs accounting matches XLA's, bad
settings are one line, and ``experiments.token_drop`` runs. (Token dropping through progressive
stacking is checked on tests/test_techniques.py's progressive run.)"""

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.train import main as train_main
from jaxaccel.step import grads
from jaxaccel.model import nn
from jaxaccel.techniques import registry as techniques
from jaxaccel.techniques import token_drop as td
from jaxaccel.run.config import build, check_ranges
from jaxaccel.core.errors import ConfigError
from jaxaccel.run.loop import train_step_of
from jaxaccel.run.loop.finish import flops_per_token
from jaxaccel.model.contract import make_apply
from jaxaccel.step.state import init_state
from tests.test_techniques import run_blocks

T = 32


def small(values=None, /, **gpt):
    """A small GPT's TrainConfig, ``values`` by field path; packed rows (the model gets segment
    ids: the batches below hold two documents a row) of T tokens, 4 a batch."""
    return build(values={"gpt.d_model": 32, "gpt.n_layers": 4, "gpt.n_heads": 2,
                         "model.max_seq_len": T, "data.seq_len": T, "data.batch_size": 4,
                         "data.batching": "pack", **{f"gpt.{k}": v for k, v in gpt.items()},
                         **(values or {})})


def build_model(cfg, seed=0):
    return techniques.build(cfg, jax.random.PRNGKey(seed))


def apply_of(cfg):
    return make_apply(nnx.graphdef(techniques.abstract(cfg)))


def checked(values):
    """``small(values)`` checked as a run checks it before any work."""
    cfg = small(values)
    check_ranges(cfg)
    techniques.check(cfg)
    techniques.abstract(cfg)
    return cfg


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


def train_step(cfg):
    """A jitted train step of ``cfg`` as the loop builds it (``loop.train_step_of``: the
    buffers' statistics and updates included), and its initial state."""
    optimizer = optax.adam(1e-2)
    model = build_model(cfg)
    params = nnx.state(model)
    step = jax.jit(train_step_of(cfg, model, optimizer))
    return step, init_state(params, optimizer, 0, trainable=nn.trainable(params))


def token_loss_of(params):
    """The running-loss buffer (``TokenLoss``) of a state."""
    (value,) = jax.tree.leaves(nnx.filter_state(params, td.TokenLoss))
    return value


def test_keep_one_is_the_plain_model_bitwise():
    """keep 1 (with a drop range and the loss score set) trains bit for bit as the plain model:
    the same logits with a key, the same gradients and updates through the train step."""
    plain = small()
    off = small({"token_drop.keep": 1.0, "token_drop.layers": "1:3",
                 "token_drop.score": "loss"})
    params = nnx.state(build_model(off))
    chex.assert_trees_all_equal(params, nnx.state(build_model(plain)))
    key = jax.random.PRNGKey(5)
    logits = apply_of(plain)(params, batch(), key)
    chex.assert_trees_all_equal(apply_of(off)(params, batch(), key), logits)
    (step_off, state_off), (step_plain, state_plain) = train_step(off), train_step(plain)
    for i in range(2):
        state_off, metrics_off = step_off(state_off, batch(seed=i))
        state_plain, metrics_plain = step_plain(state_plain, batch(seed=i))
        chex.assert_trees_all_equal(metrics_off, metrics_plain)     # loss, grad norm, ...
    chex.assert_trees_all_equal(state_off, state_plain)
    # Dropping tokens changes training, not evaluation: without a key every token runs.
    on = small({"token_drop.keep": 0.5})
    assert not jnp.allclose(apply_of(on)(params, batch(), key), logits, atol=1e-3)
    chex.assert_trees_all_equal(apply_of(on)(params, batch()), logits)   # plain ignores keys


def test_keeping_every_token_through_the_drop_path_is_the_identity():
    """The gather, the layers and the scatter with K = T: the selection is every position in
    order, so a position-dependent computation comes out bit for bit."""
    b = batch()
    x_BTD = jax.random.normal(jax.random.PRNGKey(1), (4, T, 8))
    sin_BTR = jnp.sin(b["positions"][..., None] * jnp.arange(1, 4.0))

    def layers(x, args):
        return jnp.cumsum(x, axis=1) * args["sin"][..., :1] + args["segment_ids"][..., None]

    args = {"sin": sin_BTR, "segment_ids": b["segment_ids"]}
    keep = 0.99
    assert td.kept_tokens(T, keep) == T
    drop = td.TokenDrop(td.TokenDropSettings(keep=keep, layers="1:3"), (1, 3), 320)
    with nn.step(key=jax.random.PRNGKey(2), batch=b):
        out = drop.run_span(layers, x_BTD, args)
    chex.assert_trees_all_equal(out, layers(x_BTD, args))


def _blocks_of(model, cfg, layers, scan):
    """The blocks ``layers`` of ``model`` alone: a plain model of ``len(layers)`` blocks holding
    them, run on hidden states ``x_BTD`` with the per-token arguments of batch ``b``."""
    part = build_model(small({"remat.scan_layers": scan}, n_layers=len(layers)), seed=9)
    state, blocks = nnx.to_pure_dict(nnx.state(part)), nnx.to_pure_dict(nnx.state(model))
    blocks = blocks["blocks"]["layers"]
    state["blocks"]["layers"] = (jax.tree.map(lambda a: a[layers[0]:layers[-1] + 1], blocks)
                                 if scan else {i: blocks[layer] for i, layer in enumerate(layers)})
    variables = nnx.state(part)
    nnx.replace_by_pure_dict(variables, state)
    nnx.update(part, variables)
    return lambda x_BTD, b: run_blocks(part, x_BTD, b)


@pytest.mark.parametrize("scan", [False, True])
def test_kept_tokens_run_as_the_kept_subset_and_dropped_ones_pass_unchanged(scan):
    """Layers 1:3 of 3 at keep 0.5: the kept tokens' outputs are what the two last blocks give
    on the kept subset alone (its positions and segments, causal in its order), the dropped
    tokens' are the first block's output, unchanged; padding is dropped first."""
    cfg = small({"token_drop.keep": 0.5, "token_drop.layers": "1:3",
                 "remat.scan_layers": scan}, n_layers=3)
    model = build_model(cfg)
    b, key = batch(), jax.random.PRNGKey(7)
    x_BTD = jax.random.normal(jax.random.PRNGKey(1), (4, T, 32))
    out_BTD = run_blocks(model, x_BTD, b, key)

    first_BTD = _blocks_of(model, cfg, [0], scan)(x_BTD, b)
    kept = td.kept_tokens(T, 0.5)
    index_BK = td.select(jax.random.fold_in(key, td.SELECT_KEY), b["segment_ids"], kept)
    assert index_BK.shape == (4, 16) and bool(jnp.all(jnp.diff(index_BK, axis=1) > 0))
    take = lambda a: jnp.take_along_axis(a, index_BK.reshape(*index_BK.shape, *(1,) * (a.ndim - 2)),
                                         axis=1)
    assert bool(jnp.all(take(b["segment_ids"]) > 0))          # at least 24 real tokens a row
    subset = {"inputs": take(b["inputs"]), "positions": take(b["positions"]),
              "segment_ids": take(b["segment_ids"])}
    middle_BKD = _blocks_of(model, cfg, [1, 2], scan)(take(first_BTD), subset)
    np.testing.assert_allclose(take(out_BTD), middle_BKD, rtol=0, atol=1e-6)
    dropped_BT = jnp.ones((4, T), bool).at[jnp.arange(4)[:, None], index_BK].set(False)
    chex.assert_trees_all_equal(jnp.where(dropped_BT[..., None], out_BTD, 0.0),
                                jnp.where(dropped_BT[..., None], first_BTD, 0.0))
    assert not jnp.allclose(take(out_BTD), take(first_BTD), atol=1e-3)   # the kept ones moved


def test_selection_counts_scores_and_padding():
    assert [td.kept_tokens(t, k) for t, k in [(256, 0.5), (256, 0.75), (100, 0.5), (16, 0.01),
                                              (16, 0.99), (5, 0.5), (64, 1.0)]] == \
        [128, 192, 48, 8, 16, 2, 64]
    assert td.layer_range(None, 12) == (3, 9) and td.layer_range(None, 4) == (1, 3)
    assert td.layer_range(None, 3) == (1, 2) and td.layer_range("0:2", 4) == (0, 2)
    start, end = td.layer_range(None, 2)                  # no middle layers: dropping nothing
    assert start == end                                   # is refused, not silently run
    with pytest.raises(ConfigError, match="would drop no tokens") as info:
        checked({"token_drop.keep": 0.5, "gpt.n_layers": 2})
    assert info.value.field == "token_drop.layers"
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
    cfg = small({"token_drop.keep": 0.5, "token_drop.score": "loss", "optimizer.accumulate": 2,
                 "data.batch_size": 8})
    vocab = cfg.model.vocab_size
    step, state = train_step(cfg)
    assert not any("token_loss" in jax.tree_util.keystr(path) for path, _ in
                   jax.tree_util.tree_flatten_with_path(state.opt_state)[0])
    before = token_loss_of(state.params)
    np.testing.assert_allclose(before, math.log(vocab))
    b = batch(rows=8)
    new, metrics = step(state, b)
    assert "buffer_stats" not in metrics
    # The step's losses, recomputed: microbatch i takes rows i::2 and key fold_in(key, i).
    key = jax.random.fold_in(state.rng, state.step)
    sums, counts = np.zeros(vocab), np.zeros(vocab)
    for i in range(2):
        part = jax.tree.map(lambda a: a[i::2], b)
        logits = apply_of(cfg)(state.params, part, jax.random.fold_in(key, i))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, part["targets"])
        for loss, target, w in zip(np.ravel(losses), np.ravel(part["targets"]),
                                   np.ravel(part["weights"])):
            if w > 0:
                sums[target] += loss
                counts[target] += 1
    seen = counts > 0
    expected = np.where(seen, td.DECAY * np.asarray(before) + (1 - td.DECAY) * sums /
                        np.maximum(counts, 1), np.asarray(before))
    after = np.asarray(token_loss_of(new.params))
    np.testing.assert_allclose(after, expected, rtol=1e-5)
    assert seen.sum() > 50 and (after[~seen] == np.asarray(before)[~seen]).all()
    # The weights did train.
    assert not np.allclose(new.params["head"]["kernel"][...], state.params["head"]["kernel"][...])
    # The buffer is the one variable that does not train (nn.Buffer, not nnx.Param).
    trained, _, frozen = grads.partition(new.params, nn.trainable(new.params))
    assert [path for path, _ in nnx.to_flat_state(frozen)] == [
        ("blocks", "transforms", 0, "token_loss")]
    assert not jax.tree.leaves(nnx.filter_state(trained, td.TokenLoss))


def test_dropped_compute_matches_the_flops_accounting():
    """XLA's cost analysis of the compiled train step falls by the share the run's FLOP count
    (``loop.finish.flops_per_token``, traced) predicts (unrolled layers: a scan's body is
    counted once)."""
    def compiled_flops(cfg):
        step, state = train_step(cfg)
        return step.lower(state, batch()).compile().cost_analysis()["flops"]

    def per_token(cfg):
        return flops_per_token(cfg, techniques.abstract(cfg))

    plain, dropped = small(), small({"token_drop.keep": 0.5})
    predicted = per_token(dropped) / per_token(plain)
    # Layers 1 and 2 at K/T = 1/2: half of their 6 x 16384 matmul FLOPs (q, k, v, o 4 x 32 x 32,
    # SwiGLU 3 x 32 x 128) and 3/4 of their 12 d T attention FLOPs saved.
    saved = 2 * (6 * 16384 * 0.5 + 12 * 32 * T * 0.75)
    assert predicted == pytest.approx(1 - saved / per_token(plain))
    assert compiled_flops(dropped) / compiled_flops(plain) == pytest.approx(predicted, abs=0.05)


def _drop_layers(cfg, depth=None):
    """The layers the model's ``TokenDrop`` runs on the kept tokens, at a stacking ``depth``."""
    model = techniques.abstract(cfg, depth=depth)
    (drop,) = [t for t in nn.the_stack(model, "test")[1].transforms if isinstance(t, td.TokenDrop)]
    return drop.start, drop.end


def test_a_shallow_stacking_stage_drops_in_its_middle_or_in_the_named_layers_it_has():
    """Progressive stacking's shallow stages: the middle half of their own depth, or the named
    layers (checked against the whole model) they have; none (under 3 layers, or none of the
    named ones) runs the stage whole, not an error. The whole model keeps its own range."""
    eight = small({"token_drop.keep": 0.5, "stacking.stages": 3}, n_layers=8)
    assert _drop_layers(eight) == (2, 6)
    assert _drop_layers(eight, depth=4) == (1, 3)
    start, end = _drop_layers(eight, depth=2)
    assert start >= end
    named = small({"token_drop.keep": 0.5, "token_drop.layers": "1:3", "stacking.stages": 2})
    assert _drop_layers(named) == (1, 3) and _drop_layers(named, depth=2) == (1, 2)
    start, end = _drop_layers(small({"token_drop.keep": 0.5, "token_drop.layers": "1:2",
                                     "stacking.stages": 2}, n_layers=2), depth=1)
    assert start >= end
    drop = td.TokenDrop(td.TokenDropSettings(keep=0.5), (1, 1), 320)
    assert drop.span(0, 1, 1, T, training=True) is None        # the stage runs whole
    with pytest.raises(ConfigError, match="n_layers=4"):        # named beyond the whole model
        techniques.abstract(small({"token_drop.keep": 0.5, "token_drop.layers": "1:5",
                                   "stacking.stages": 2}), depth=2)


@pytest.mark.parametrize("values, message", [
    ({"token_drop.keep": 0.0}, "keep must be in (0, 1]"),
    ({"token_drop.keep": 1.5}, "keep must be in (0, 1]"),
    ({"token_drop.keep": float("nan")}, "keep must be in (0, 1]"),
    ({"token_drop.keep": 0.5, "token_drop.layers": "2"}, "token_drop_layers must be START:END"),
    ({"token_drop.keep": 0.5, "token_drop.layers": "a:b"}, "token_drop_layers must be START:END"),
    ({"token_drop.keep": 0.5, "token_drop.layers": "3:2"}, "token_drop_layers must be START:END"),
    ({"token_drop.keep": 0.5, "token_drop.layers": "1:5"}, "n_layers=4"),
    ({"token_drop.score": "big"}, "token_drop.score='big' is not one of random, loss"),
])
def test_bad_settings_are_one_clear_error(values, message):
    with pytest.raises(ConfigError) as error:
        checked(values)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert error.value.field.startswith("token_drop.")


def test_bad_settings_on_the_command_line_are_one_line(tmp_path, capsys):
    from experiments import token_drop as experiment
    for main, args, flag in [
            (train_main, ["--token-keep", "nan"], "--token-keep"),
            (train_main, ["--token-keep", "0.5", "--token-drop-layers", "0:9"],
             "--token-drop-layers"),
            (experiment.main, ["--keeps", "0.5,1.5"], "--keeps"),
            (experiment.main, ["--scores", "random,best"], "--scores"),
            (experiment.main, ["--timed-steps", "0"], "--timed-steps")]:
        assert main([*args, "--run-dir", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0], err
    assert not (tmp_path / "runs").exists()


def test_token_drop_experiment_runs_every_row(corpus_path, tmp_path, capsys):
    from experiments import token_drop as experiment
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
    dropped, plain = small({"token_drop.keep": 0.5, "data.batch_size": 8}), small(
        {"data.batch_size": 8})
    assert row["flops_saved"] == pytest.approx(
        1 - flops_per_token(dropped, techniques.abstract(dropped))
        / flops_per_token(plain, techniques.abstract(plain)))
    assert row["val_loss"] != base["val_loss"]
    assert result["meta"]["token_drop_layers"] == "1:3" and len(result["meta"]["targets"]) == 1
    assert result["meta"]["step_time"].startswith("median of 2 round-robin rounds")
    assert (tmp_path / "runs" / "token_drop.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "| row" in printed and "Targets:" in printed and "keep 0.5 loss" in printed
