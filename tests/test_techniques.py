"""The survey's techniques, part A: initialisation schemes, stochastic depth, progressive layer
stacking, LoRA and adapters; each against its paper's formula or an exact reference."""

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.train import main as train_main
from jaxaccel import grads, lora, stacking
from jaxaccel import stochastic_depth as sd
from jaxaccel.errors import ConfigError
from jaxaccel.init import tfixup_scale
from jaxaccel.loop import train
from jaxaccel.model import count_params, flops_per_token, init_params, make_apply, model_parts, preset
from jaxaccel.state import init_state
from jaxaccel.train import lm_train_step
from tests.test_loop import SMALL_MODEL, final_state, small_config


def small(**fields):
    return preset("tiny", **{"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32,
                             **fields})


def batch(rows=4, length=16, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(3, 300, (rows, length)), jnp.int32)
    return {"inputs": ids, "targets": jnp.roll(ids, -1, axis=1),
            "positions": jnp.tile(jnp.arange(length), (rows, 1)),
            "segment_ids": jnp.ones((rows, length), jnp.int32),
            "weights": jnp.ones((rows, length), jnp.float32)}


def leaves_named(params, name):
    return [x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if name in jax.tree_util.keystr(path)]


# ---------------------------------------------------------------------------------------------
# Initialisation schemes.

@pytest.mark.parametrize("scheme, scan", [("rezero", False), ("skipinit", True)])
def test_rezero_and_skipinit_blocks_are_the_identity_at_initialisation(scheme, scan):
    cfg = small(init=scheme, scan_layers=scan)
    params = init_params(cfg, jax.random.PRNGKey(0))
    gates = leaves_named(params, "alpha")
    assert gates and all(bool((g == 0).all()) for g in gates)
    assert not leaves_named(params, "attn_norm") and not leaves_named(params, "mlp_norm")
    x_BTD = jax.random.normal(jax.random.PRNGKey(1), (4, 16, cfg.d_model))
    out_BTD = model_parts(cfg).blocks(params, x_BTD, batch())
    chex.assert_trees_all_equal(out_BTD, x_BTD)
    # Training moves the gates off zero, so the blocks do not stay the identity.
    step = jax.jit(lm_train_step(make_apply(cfg), optax.adam(1e-2)))
    state, _ = step(init_state(params, optax.adam(1e-2), 0), batch())
    assert all(bool((g != 0).all()) for g in leaves_named(state.params, "alpha"))


def test_tfixup_statistics_follow_the_paper():
    cfg = preset("tiny", d_model=256, n_layers=6, n_heads=4, init="tfixup", scan_layers=True)
    params = init_params(cfg, jax.random.PRNGKey(0))
    scale = tfixup_scale(cfg.n_layers)
    assert scale == pytest.approx((9 * 6) ** -0.25)
    blocks = params["blocks"]

    def xavier_std(w):
        fan_in, fan_out = w.shape[-2:]
        return (2.0 / (fan_in + fan_out)) ** 0.5

    for w, factor in [(blocks["attn"]["wq"]["kernel"], 1.0), (blocks["attn"]["wk"]["kernel"], 1.0),
                      (blocks["attn"]["wv"]["kernel"], scale), (blocks["attn"]["wo"]["kernel"], scale),
                      (blocks["mlp"]["w_in"]["kernel"], scale), (blocks["mlp"]["w_gate"]["kernel"], scale),
                      (blocks["mlp"]["w_out"]["kernel"], scale), (params["head"]["kernel"], 1.0)]:
        expected = xavier_std(w) * factor
        assert float(jnp.std(w)) == pytest.approx(expected, rel=0.03)
        limit = (6.0 / sum(w.shape[-2:])) ** 0.5 * factor      # uniform: bounded by the limit
        assert float(jnp.abs(w).max()) <= limit * (1 + 1e-6)
    embedding = params["embed"]["embedding"]
    assert float(jnp.std(embedding)) == pytest.approx(cfg.d_model ** -0.5 * scale, rel=0.03)
    assert not leaves_named(params, "attn_norm") and leaves_named(params, "final_norm")
    # Each layer draws its own weights; unrolled blocks draw the same ones.
    assert not jnp.allclose(blocks["attn"]["wq"]["kernel"][0], blocks["attn"]["wq"]["kernel"][1])
    unrolled = init_params(preset("tiny", d_model=256, n_layers=6, n_heads=4, init="tfixup"),
                           jax.random.PRNGKey(0))
    chex.assert_trees_all_equal(
        jax.tree.map(lambda *xs: jnp.stack(xs), *[unrolled["blocks"][i] for i in range(6)]),
        blocks)


# ---------------------------------------------------------------------------------------------
# Stochastic depth.

def test_stochastic_depth_rates_rows_and_flop_share():
    assert sd.drop_rates(0.2, 4) == pytest.approx([0.05, 0.1, 0.15, 0.2])
    assert [sd.kept_rows(16, p) for p in sd.drop_rates(0.2, 4)] == [15, 14, 14, 13]
    assert sd.kept_rows(16, 0.2, groups=4) == 12          # 4 per shard of 4, minus round(0.8)
    assert sd.kept_rows(2, 0.9) == 1                       # never none
    assert sd.kept_fraction(0.2, 4, 16) == pytest.approx(56 / 64)
    assert sd.kept_fraction(0.0, 4, 16) == 1.0


def test_stochastic_depth_is_the_identity_at_evaluation_in_both_layouts():
    cfg, plain = small(stochastic_depth=0.5), small()
    params = init_params(cfg, jax.random.PRNGKey(0))
    chex.assert_trees_all_equal(make_apply(cfg)(params, batch()), make_apply(plain)(params, batch()))
    key = jax.random.PRNGKey(3)
    trained = make_apply(cfg)(params, batch(rows=8), key)
    assert not jnp.allclose(trained, make_apply(plain)(params, batch(rows=8)))
    # The scanned layout skips the same rows of the same layers.
    stacked = init_params(small(scan_layers=True), jax.random.PRNGKey(0))
    scanned = make_apply(small(stochastic_depth=0.5, scan_layers=True))(stacked, batch(rows=8), key)
    np.testing.assert_allclose(trained, scanned, atol=2e-5)


def test_stochastic_depth_skips_whole_rows_and_is_unbiased():
    """Each row either passes unchanged or gets the block's change times rows / kept; exactly
    ``kept`` rows are computed, each with probability kept / rows."""
    rows, kept = 8, 3
    x_BTD = jax.random.normal(jax.random.PRNGKey(0), (rows, 4, 6))
    segment_BT = jnp.ones((rows, 4), jnp.int32)

    def block(x, seg):
        return x * 2.0 + 1.0 + seg[..., None]

    def once(key):
        return sd.skip_rows(block, x_BTD, (segment_BT,), key, kept, groups=1)

    outs = jax.vmap(once)(jax.random.split(jax.random.PRNGKey(1), 2000))
    full = x_BTD + (block(x_BTD, segment_BT) - x_BTD) * rows / kept
    same = jnp.all(outs == x_BTD, axis=(2, 3))
    changed = jnp.all(jnp.isclose(outs, full, atol=1e-5), axis=(2, 3))
    assert bool(jnp.all(same | changed))
    assert bool(jnp.all(changed.sum(axis=1) == kept))
    assert np.allclose(changed.mean(axis=0), kept / rows, atol=0.05)
    # Hence the expected output is the block's output.
    assert np.allclose(outs.mean(axis=0), block(x_BTD, segment_BT), atol=0.25)


def test_stochastic_depth_computes_fewer_flops():
    """The skipped rows are not computed: the compiled train step's FLOPs drop by about the
    blocks' kept share (XLA's cost analysis)."""
    def flops(cfg):
        params = init_params(cfg, jax.random.PRNGKey(0))
        step = jax.jit(lm_train_step(make_apply(cfg), optax.sgd(0.1)))
        compiled = step.lower(init_state(params, optax.sgd(0.1), 0), batch(rows=16)).compile()
        return compiled.cost_analysis()["flops"]

    # Unrolled layers: XLA's cost analysis counts a scan's body once, however many layers.
    cfg = small(stochastic_depth=0.6)
    base, dropped = flops(small()), flops(cfg)
    kept = sd.kept_fraction(0.6, 2, 16)
    assert kept == 17 / 32
    predicted = flops_per_token(cfg, 16, kept) / flops_per_token(cfg, 16)
    assert dropped / base == pytest.approx(predicted, abs=0.05)


# ---------------------------------------------------------------------------------------------
# Progressive layer stacking.

def test_stacking_plan_and_bad_settings():
    assert stacking.depths(8, 3) == [2, 4, 8]
    assert stacking.boundaries(30, 3) == [10, 20]
    assert stacking.boundaries(30, 3, "5,12") == [5, 12]
    assert [stacking.depth_at(s, 8, 3, [10, 20]) for s in (0, 10, 11, 20, 21)] == [2, 2, 4, 4, 8]
    assert stacking.stage_end(10, 30, [10, 20]) == 20
    with pytest.raises(ConfigError, match="does not divide"):
        stacking.depths(6, 3)
    with pytest.raises(ConfigError, match="increasing steps"):
        stacking.boundaries(30, 3, "20,10")
    with pytest.raises(ConfigError, match="increasing steps"):
        stacking.boundaries(30, 2, "30")


@pytest.mark.parametrize("scan", [False, True])
def test_grow_copies_the_blocks_and_their_optimizer_state(scan):
    shallow, deep = small(n_layers=2, scan_layers=scan), small(n_layers=4, scan_layers=scan)
    optimizer = optax.adamw(1e-2)
    state = init_state(init_params(shallow, jax.random.PRNGKey(0)), optimizer, 0)
    state, _ = jax.jit(lm_train_step(make_apply(shallow), optimizer))(state, batch())
    template = jax.eval_shape(lambda: init_state(init_params(deep, jax.random.PRNGKey(1)),
                                                 optimizer, 0))
    grown = stacking.grow(state, template, 2)
    assert jax.tree.structure(grown) == jax.tree.structure(template)
    assert int(grown.step) == 1 and int(grown.opt_state[0].count) == 1
    blocks, old = grown.params["blocks"], state.params["blocks"]
    mu, old_mu = grown.opt_state[0].mu["blocks"], state.opt_state[0].mu["blocks"]
    if scan:
        for new, was in [(blocks, old), (mu, old_mu)]:
            chex.assert_trees_all_equal(new, jax.tree.map(lambda x: jnp.concatenate([x, x]), was))
    else:
        for i in range(4):
            chex.assert_trees_all_equal(blocks[i], old[i % 2])
            chex.assert_trees_all_equal(mu[i], old_mu[i % 2])
    chex.assert_trees_all_equal(grown.params["embed"], state.params["embed"])
    # The grown model computes what the shallow one computed, then the copies on top.
    x_BTD = jax.random.normal(jax.random.PRNGKey(2), (4, 16, 64))
    twice = model_parts(shallow).blocks(state.params, model_parts(shallow).blocks(
        state.params, x_BTD, batch()), batch())
    np.testing.assert_allclose(model_parts(deep).blocks(grown.params, x_BTD, batch()), twice,
                               atol=1e-5)


def test_progressive_run_resumes_mid_stage_bitwise(corpus_path, tmp_path):
    def cfg(name, **extra):
        base = small_config(corpus_path, tmp_path, name, steps=9, checkpoint_every=0,
                            eval_every=0, **extra)
        model = dataclasses.replace(base.model, n_layers=4)   # unrolled: grown blocks are
        # copies in separate buffers (the scanned layout is experiments.depth's test)
        return dataclasses.replace(base, model=model, run=dataclasses.replace(
            base.run, progressive_stack=3))

    whole = train(cfg("whole"))
    assert whole.progressive_stages == [[0, 1], [3, 2], [6, 4]]
    assert whole.steps == 9 and whole.compiles == 3
    records = [json.loads(line) for line in open(os.path.join(whole.run_dir, "metrics.jsonl"))]
    assert [(r["step"], r["n_layers"]) for r in records if r["kind"] == "stack"] == [(3, 2), (6, 4)]
    cut = train(cfg("cut"), should_stop=lambda step: step == 4)      # inside the second stage
    assert cut.interrupted == "requested" and cut.steps == 4
    resumed = train(cfg("cut", resume=True))
    assert resumed.steps == 9 and resumed.progressive_stages == [[4, 2], [6, 4]]
    chex.assert_trees_all_equal(final_state(whole.run_dir, 9), final_state(resumed.run_dir, 9))


# ---------------------------------------------------------------------------------------------
# LoRA and adapters.

@pytest.mark.parametrize("scan", [False, True])
def test_lora_merged_weights_give_the_same_logits(scan):
    cfg = small(lora_rank=4, lora_targets="q,v,o,out", scan_layers=scan)
    params = init_params(cfg, jax.random.PRNGKey(0))
    chex.assert_trees_all_equal(make_apply(cfg)(params, batch()),     # B = 0: the base model
                                make_apply(lora.base_config(cfg))(lora.merge(params, cfg), batch()))
    params = jax.tree_util.tree_map_with_path(         # a trained B
        lambda path, x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(len(str(path))), x.shape)
        if "lora_b" in jax.tree_util.keystr(path) else x, params)
    merged = lora.merge(params, cfg)
    assert not leaves_named(merged, "lora_")
    assert count_params(merged) == count_params(init_params(lora.base_config(cfg),
                                                            jax.random.PRNGKey(0)))
    np.testing.assert_allclose(make_apply(cfg)(params, batch()),
                               make_apply(lora.merged_config(cfg))(merged, batch()), atol=1e-4)


@pytest.mark.parametrize("fields", [dict(lora_rank=4), dict(lora_rank=2, adapter_dim=4)])
def test_frozen_base_is_bitwise_unchanged_and_has_no_optimizer_state(fields):
    cfg = small(**fields)
    trainable = lora.trainable(cfg)
    params = init_params(cfg, jax.random.PRNGKey(0))
    optimizer = optax.adamw(1e-2)
    state = init_state(params, optimizer, 0, trainable=trainable)
    train_part, frozen = grads.partition(params, trainable)
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == \
        2 * sum(x.size for x in jax.tree.leaves(train_part)) + 1
    step = jax.jit(lm_train_step(make_apply(cfg), optimizer, accumulate=2, trainable=trainable))
    for i in range(3):
        state, metrics = step(state, batch(seed=i))
    new_train, new_frozen = grads.partition(state.params, trainable)
    chex.assert_trees_all_equal(new_frozen, frozen)
    assert all(not bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(new_train),
                                                         jax.tree.leaves(train_part)))
    assert np.isfinite(float(metrics["loss"]))
    # The gradients are those of the whole model's loss with respect to the trainable part.
    loss_fn = lambda t: jnp.mean(make_apply(cfg)(grads.combine(t, frozen), batch()) ** 2)  # noqa
    grad_fn = grads.value_and_grad(lambda p, b, k: (jnp.mean(make_apply(cfg)(p, b) ** 2), {}),
                                   trainable=trainable)
    (_, _), got = grad_fn(params, batch(), None)
    chex.assert_trees_all_close(got, jax.grad(loss_fn)(train_part), atol=1e-6)


@pytest.mark.parametrize("fields,message", [
    (dict(lora_rank=65), "lora_rank=65 exceeds the width 64 of wq"),
    (dict(lora_rank=-1), "lora_rank must be >= 0"),
    (dict(lora_rank=4, lora_targets="q,x"), "unknown lora_targets ['x']"),
    (dict(lora_rank=4, lora_targets="gate", mlp="gelu"), "needs mlp=swiglu"),
    (dict(adapter_dim=-2), "adapter_dim must be >= 0"),
    (dict(init="fixup"), "unknown init 'fixup'"),
    (dict(stochastic_depth=1.0), "stochastic_depth must be in [0, 1)"),
])
def test_bad_model_settings_are_one_clear_error(fields, message):
    with pytest.raises(ConfigError) as error:
        small(**fields)
    assert message in str(error.value)


def test_fine_tune_from_a_run_and_bad_runs(corpus_path, tmp_path, capsys):
    base = train(small_config(corpus_path, tmp_path, "base", steps=4, eval_every=0))
    common = [*SMALL_MODEL, "--data", corpus_path, "--seq-len", "32", "--batch-size", "4",
              "--steps", "3", "--eval-every", "0", "--no-progress", "--final-eval-batches", "2",
              "--cache-dir", str(tmp_path / "cache")]
    assert train_main([*common, "--run-dir", str(tmp_path / "lora"), "--lora-rank", "2",
                       "--init-from", base.run_dir, "--json", str(tmp_path / "lora.json")]) == 0
    summary = json.load(open(tmp_path / "lora.json"))
    assert summary["init_from"] == base.run_dir
    assert summary["trainable_params"] == 2 * 2 * 2 * 32 * 2     # layers x (q, v) x (A + B)
    tuned = final_state(str(tmp_path / "lora"), 3)["params"]
    start = final_state(base.run_dir, 4)["params"]
    train_part, frozen = grads.partition(tuned, lora.trainable(small(lora_rank=2)))
    chex.assert_trees_all_equal(frozen, start)                  # the base, bit for bit
    assert len(jax.tree.leaves(train_part)) == 2 * 2 * 2
    capsys.readouterr()
    for args, message in [
        (["--n-layers", "4", "--init-from", base.run_dir], "trained another model shape: "
                                                            "n_layers=2 (here 4)"),
        (["--init-from", str(tmp_path / "nothing")], "is not a run directory"),
        ([], "LoRA and adapters tune a trained model"),
        (["--init-from", base.run_dir, "--sharding", "pp"], "does not run with the pipeline"),
    ]:
        code = train_main([*common, "--run-dir", str(tmp_path / "bad"), "--lora-rank", "2",
                           *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err


def test_checkpoints_from_before_these_settings_still_resume(corpus_path, tmp_path):
    """The resume settings leave out the new fields while they are unused, so a checkpoint
    recorded without them matches; used, they are recorded."""
    from jaxaccel.loop import ADDED_SETTINGS, resume_settings
    plain = resume_settings(small_config(corpus_path, tmp_path), {"seq_len": 32}, 8, 1)
    assert not set(ADDED_SETTINGS) & set(plain)
    cfg = small_config(corpus_path, tmp_path)
    used = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="tfixup"))
    assert resume_settings(used, {"seq_len": 32}, 8, 1)["model.init"] == "tfixup"
