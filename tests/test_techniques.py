"""The survey's techniques, part A: initialisation schemes, stochastic depth, progressive layer
stacking, LoRA and adapters; each against its paper's formula or an exact reference."""

import json
import math
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.train import main as train_main
from jaxaccel.step import grads
from jaxaccel.techniques import init, lora, stacking, surgery, registry as techniques
from jaxaccel.model import nn
from jaxaccel.techniques import stochastic_depth as sd
from jaxaccel.run.config import build, check_ranges, override
from jaxaccel.core.errors import ConfigError
from jaxaccel.techniques.init import tfixup_scale
from jaxaccel.run.loop import resume_settings, train
from jaxaccel.run.loop.finish import flops_per_token
from jaxaccel.model.contract import count_params, make_apply, parts, stack_of
from jaxaccel.step.state import init_state
from jaxaccel.step.train import lm_train_step
from tests.test_loop import SMALL_MODEL, final_state, small_config

SMALL = {"gpt.d_model": 64, "gpt.n_layers": 2, "gpt.n_heads": 4, "model.max_seq_len": 32}


def small(values=None, /, **gpt):
    """A small GPT's TrainConfig: ``values`` by field path (``{"lora.rank": 4}``), ``gpt``
    fields by name (``n_layers=4``)."""
    return build(values={**SMALL, **{f"gpt.{k}": v for k, v in gpt.items()}, **(values or {})})


def build_model(cfg, seed=0):
    """The model of ``cfg`` with its techniques, initialised from ``PRNGKey(seed)``."""
    return techniques.build(cfg, jax.random.PRNGKey(seed))


def init_params(cfg, seed=0):
    """The model's state (an ``nnx.State``)."""
    return nnx.state(build_model(cfg, seed))


def apply_of(cfg, **kwargs):
    """``apply(state, batch, key=None) -> logits`` of the model of ``cfg``."""
    return make_apply(nnx.graphdef(techniques.abstract(cfg)), **kwargs)


def copy_of(model):
    """A model of its own with the same values (an in-place change leaves ``model`` alone)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(jnp.array, state))


def run_blocks(model, x_BTD, b, key=None):
    """The model's stack of blocks alone on ``x_BTD``, with the per-token arguments the model
    passes it for batch ``b`` (``model.parts``)."""
    graphdef, state = nnx.split(model)
    cut = parts(graphdef, state)
    _, token_args = cut.embed(state, b)
    return cut.blocks(stack_of(state, cut.stack_path), x_BTD, token_args, b, key, 0, None)


def lm_step(cfg, optimizer, **kwargs):
    """A jitted train step of ``cfg``'s model training what it trains (``nn.trainable``), and
    its initial state."""
    params = init_params(cfg)
    trainable = nn.trainable(params)
    step = jax.jit(lm_train_step(apply_of(cfg), optimizer, trainable=trainable, **kwargs))
    return step, init_state(params, optimizer, 0, trainable=trainable)


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


def flat(tree) -> dict:
    """``{"a/b/0/c": leaf}`` of a nested dict (a checkpoint restored without a target) or a
    state (``.value`` left out)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        out["/".join(k for k in keys if k != "value")] = leaf
    return out


pure = nnx.to_pure_dict


# ---------------------------------------------------------------------------------------------
# Initialisation schemes.

@pytest.mark.parametrize("scheme, scan", [("rezero", False), ("skipinit", True)])
def test_rezero_and_skipinit_blocks_are_the_identity_at_initialisation(scheme, scan):
    cfg = small({"init.scheme": scheme, "remat.scan_layers": scan})
    model = build_model(cfg)
    gates = [wrapper.gate[...] for _, wrapper in surgery.wrappers(model, init.Gated)]
    # o and out of each block (a scanned stack holds one block, its variables stacked)
    assert len(gates) == 2 * (1 if scan else 2) and all(bool((g == 0).all()) for g in gates)
    params = nnx.state(model)
    # ReZero: one gate per block, shared by its branches; SkipInit: one per branch.
    assert sum(g.size for g in leaves_named(params, "['gate']")) == 2 * (1 if scheme == "rezero"
                                                                          else 2)
    assert not leaves_named(params, "attn_norm") and not leaves_named(params, "mlp_norm")
    x_BTD = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 64))
    chex.assert_trees_all_equal(run_blocks(model, x_BTD, batch()), x_BTD)
    # Training moves the gates off zero, so the blocks do not stay the identity.
    step, state = lm_step(cfg, optax.adam(1e-2))
    state, _ = step(state, batch())
    gates = leaves_named(state.params, "['gate']")
    assert gates and all(bool((g != 0).all()) for g in gates)


def test_tfixup_statistics_follow_the_paper():
    cfg = small({"init.scheme": "tfixup", "remat.scan_layers": True}, d_model=256, n_layers=6)
    params = pure(init_params(cfg))
    scale = tfixup_scale(6)
    assert scale == pytest.approx((9 * 6) ** -0.25)
    blocks = params["blocks"]["layers"]

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
    assert float(jnp.std(embedding)) == pytest.approx(256 ** -0.5 * scale, rel=0.03)
    assert not leaves_named(params, "attn_norm") and leaves_named(params, "final_norm")
    # Each layer draws its own weights; unrolled blocks draw the same ones.
    assert not jnp.allclose(blocks["attn"]["wq"]["kernel"][0], blocks["attn"]["wq"]["kernel"][1])
    unrolled = pure(init_params(small({"init.scheme": "tfixup"}, d_model=256, n_layers=6)))
    chex.assert_trees_all_equal(
        jax.tree.map(lambda *xs: jnp.stack(xs), *[unrolled["blocks"]["layers"][i]
                                                  for i in range(6)]), blocks)


# ---------------------------------------------------------------------------------------------
# Stochastic depth.

def test_stochastic_depth_rates_rows_and_flop_share():
    assert sd.drop_rates(0.2, 4) == pytest.approx([0.05, 0.1, 0.15, 0.2])
    assert [sd.kept_rows(16, p) for p in sd.drop_rates(0.2, 4)] == [15, 14, 14, 13]
    assert sd.kept_rows(16, 0.2, groups=4) == 12          # 4 per shard of 4, minus round(0.8)
    assert sd.kept_rows(2, 0.9) == 1                       # never none
    assert sd.kept_fraction(0.2, 4, 16) == pytest.approx(56 / 64)
    assert sd.kept_fraction(0.0, 4, 16) == 1.0


def jitted_apply_of(cfg):
    """``apply_of(cfg)`` compiled whole (one compile, not one per operation run eagerly)."""
    return jax.jit(apply_of(cfg))


def test_stochastic_depth_is_the_identity_at_evaluation_in_both_layouts():
    cfg, plain = small({"stochastic_depth.rate": 0.5}), small()
    apply, plain_apply = jitted_apply_of(cfg), jitted_apply_of(plain)
    params = init_params(cfg)
    chex.assert_trees_all_equal(apply(params, batch()), plain_apply(params, batch()))
    key = jax.random.PRNGKey(3)
    trained = apply(params, batch(rows=8), key)
    assert not jnp.allclose(trained, plain_apply(params, batch(rows=8)))
    # The scanned layout skips the same rows of the same layers.
    scanned_cfg = small({"stochastic_depth.rate": 0.5, "remat.scan_layers": True})
    stacked = init_params(small({"remat.scan_layers": True}))
    scanned = jitted_apply_of(scanned_cfg)(stacked, batch(rows=8), key)
    np.testing.assert_allclose(trained, scanned, atol=2e-5)


def test_stochastic_depth_skips_whole_rows_and_is_unbiased():
    """Each row either passes unchanged or gets the block's change times rows / kept; exactly
    ``kept`` rows are computed, each with probability kept / rows."""
    rows, kept = 8, 3
    x_BTD = jax.random.normal(jax.random.PRNGKey(0), (rows, 4, 6))
    args = {"segment_ids": jnp.ones((rows, 4), jnp.int32), "unused": None}

    def block(x, row_args):
        return x * 2.0 + 1.0 + row_args["segment_ids"][..., None]

    def once(key):
        return sd.skip_rows(block, x_BTD, args, key, kept, groups=1)

    outs = jax.vmap(once)(jax.random.split(jax.random.PRNGKey(1), 2000))
    full = x_BTD + (block(x_BTD, args) - x_BTD) * rows / kept
    same = jnp.all(outs == x_BTD, axis=(2, 3))
    changed = jnp.all(jnp.isclose(outs, full, atol=1e-5), axis=(2, 3))
    assert bool(jnp.all(same | changed))
    assert bool(jnp.all(changed.sum(axis=1) == kept))
    assert np.allclose(changed.mean(axis=0), kept / rows, atol=0.05)
    # Hence the expected output is the block's output.
    assert np.allclose(outs.mean(axis=0), block(x_BTD, args), atol=0.25)


def test_stochastic_depth_computes_fewer_flops():
    """The skipped rows are not computed: the compiled train step's FLOPs drop by the share the
    run's FLOP count (``loop.finish.flops_per_token``, traced) predicts (XLA's cost analysis)."""
    def flops(cfg):
        step, state = lm_step(cfg, optax.sgd(0.1))
        return step.lower(state, batch(rows=16)).compile().cost_analysis()["flops"]

    # Unrolled layers: XLA's cost analysis counts a scan's body once, however many layers.
    rows = {"data.batch_size": 16, "data.seq_len": 16}
    cfg, plain = small({**rows, "stochastic_depth.rate": 0.6}), small(rows)
    base, dropped = flops(plain), flops(cfg)
    kept = sd.kept_fraction(0.6, 2, 16)
    assert kept == 17 / 32
    predicted = (flops_per_token(cfg, techniques.abstract(cfg))
                 / flops_per_token(plain, techniques.abstract(plain)))
    assert kept < predicted < 1          # the blocks' share falls to kept, the head's stays
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
    deep = small({"remat.scan_layers": scan}, n_layers=4)
    optimizer = optax.adamw(1e-2)
    shallow = techniques.build(deep, jax.random.PRNGKey(0), depth=2)    # a stage's model
    graphdef, params = nnx.split(shallow)
    state = init_state(params, optimizer, 0, trainable=nnx.Param)
    state, _ = jax.jit(lm_train_step(make_apply(graphdef), optimizer, trainable=nnx.Param))(
        state, batch())
    template = jax.eval_shape(lambda: init_state(init_params(deep, 1), optimizer, 0,
                                                 trainable=nnx.Param))
    stack_path = nn.the_stack(shallow, "progressive stacking")[0]
    grown = stacking.grow(state, template, 2, stack_path)
    assert jax.tree.structure(grown) == jax.tree.structure(template)
    assert int(grown.step) == 1 and int(grown.opt_state[0].count) == 1
    blocks, old = pure(grown.params)["blocks"]["layers"], pure(state.params)["blocks"]["layers"]
    mu = pure(grown.opt_state[0].mu)["blocks"]["layers"]
    old_mu = pure(state.opt_state[0].mu)["blocks"]["layers"]
    if scan:
        for new, was in [(blocks, old), (mu, old_mu)]:
            chex.assert_trees_all_equal(new, jax.tree.map(lambda x: jnp.concatenate([x, x]), was))
    else:
        for i in range(4):
            chex.assert_trees_all_equal(blocks[i], old[i % 2])
            chex.assert_trees_all_equal(mu[i], old_mu[i % 2])
    chex.assert_trees_all_equal(pure(grown.params)["embed"], pure(state.params)["embed"])
    # The grown model computes what the shallow one computed, then the copies on top.
    x_BTD = jax.random.normal(jax.random.PRNGKey(2), (4, 16, 64))
    trained = nnx.merge(graphdef, state.params)
    twice = run_blocks(trained, run_blocks(trained, x_BTD, batch()), batch())
    grown_model = nnx.merge(nnx.graphdef(techniques.abstract(deep)), grown.params)
    np.testing.assert_allclose(run_blocks(grown_model, x_BTD, batch()), twice, atol=1e-5)


def progressive_config(corpus_path, tmp_path, name, **extra):
    """A run of 9 steps growing a 4-layer model in 3 stages (1, 2, then 4 layers), unrolled:
    grown blocks are copies in separate buffers (the scanned layout is experiments.depth's
    test). It drops tokens too (keep 0.5 in layers 1:3, the loss score), which the stacked
    stages must carry through each growth (``jaxaccel.techniques.token_drop``)."""
    base = small_config(corpus_path, tmp_path, name, steps=9, checkpoint_every=0, eval_every=0,
                        **extra)
    return override(base, {"gpt.n_layers": 4, "stacking.stages": 3, "token_drop.keep": 0.5,
                           "token_drop.layers": "1:3", "token_drop.score": "loss"})


@pytest.fixture(scope="module")
def progressive(corpus_path, tmp_path_factory):
    """(folder, summary) of the progressive run uninterrupted (``progressive_config``)."""
    tmp_path = tmp_path_factory.mktemp("progressive")
    return tmp_path, train(progressive_config(corpus_path, tmp_path, "whole"))


def test_progressive_run_grows_its_model_in_stages(progressive):
    """The stages (first step, depth), one compile each, a "stack" record at each growth."""
    _, whole = progressive
    assert whole.techniques["stacking"]["stages"] == [[0, 1], [3, 2], [6, 4]]
    assert whole.steps == 9 and whole.compiles == 3
    records = [json.loads(line) for line in open(os.path.join(whole.run_dir, "metrics.jsonl"))]
    assert [(r["step"], r["n_layers"]) for r in records if r["kind"] == "stack"] == [(3, 2), (6, 4)]


def test_token_dropping_trains_through_progressive_stacking(progressive):
    """The progressive run drops tokens with the loss score (its buffer carried through both
    growths) and trains every stage; the shallow one of 1 layer runs whole (which layers each
    stage drops in: test_token_drop's stage test)."""
    _, whole = progressive
    assert whole.steps == 9 and math.isfinite(whole.val_loss)
    assert whole.techniques["stacking"]["stages"] == [[0, 1], [3, 2], [6, 4]]
    assert whole.techniques["token_drop"]["score"] == "loss"


def test_progressive_run_resumes_mid_stage_bitwise(progressive, corpus_path):
    """Cut inside the second stage, resumed: the run restores the grown model (and the token
    loss buffer), grows it again, and ends bitwise as the uninterrupted run (the
    ``progressive`` fixture's)."""
    tmp_path, whole = progressive
    cut = train(progressive_config(corpus_path, tmp_path, "cut"),
                should_stop=lambda step: step == 4)
    assert cut.interrupted == "requested" and cut.steps == 4
    resumed = train(progressive_config(corpus_path, tmp_path, "cut", resume=True))
    assert resumed.steps == 9 and resumed.techniques["stacking"]["stages"] == [[4, 2], [6, 4]]
    chex.assert_trees_all_equal(final_state(whole.run_dir, 9), final_state(resumed.run_dir, 9))


# ---------------------------------------------------------------------------------------------
# LoRA and adapters.

@pytest.mark.parametrize("scan", [False, True])
def test_lora_merged_weights_give_the_same_logits(scan):
    cfg = small({"lora.rank": 4, "lora.targets": "q,v,o,out", "remat.scan_layers": scan})
    base_cfg = small({"remat.scan_layers": scan})
    model, base = build_model(cfg), build_model(base_cfg)
    apply, base_apply = apply_of(cfg), apply_of(base_cfg)
    logits = apply(nnx.state(model), batch())                    # B = 0: the base model
    chex.assert_trees_all_equal(logits, base_apply(nnx.state(base), batch()))
    merged = copy_of(model)
    assert lora.merge(merged) == 4 * (1 if scan else 2)        # q, v, o, out of each block
    chex.assert_trees_all_equal(nnx.state(merged), nnx.state(base))
    trained_b = jax.tree_util.tree_map_with_path(         # a trained B
        lambda path, x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(len(str(path))), x.shape)
        if "lora_b" in jax.tree_util.keystr(path) else x, nnx.state(model))
    nnx.update(model, trained_b)
    merged = copy_of(model)
    lora.merge(merged)
    assert not leaves_named(nnx.state(merged), "lora_")
    assert not jax.tree.leaves(nnx.filter_state(nnx.state(merged), nnx.LoRAParam))
    assert count_params(nnx.state(merged)) == count_params(nnx.state(base))
    # The merged model is the base architecture: the base model's graph runs its state.
    np.testing.assert_allclose(apply(nnx.state(model), batch()),
                               base_apply(nnx.state(merged), batch()), atol=1e-4)
    assert not np.allclose(apply(nnx.state(model), batch()), logits, atol=1e-3)


@pytest.mark.parametrize("values", [{"lora.rank": 4}, {"lora.rank": 2, "adapters.dim": 4}])
def test_frozen_base_is_bitwise_unchanged_and_has_no_optimizer_state(values):
    """One layer (nothing checked depends on the depth); the gradients compiled (jit)."""
    cfg = small(values, n_layers=1)
    params = init_params(cfg)
    trainable = nn.trainable(params)
    optimizer = optax.adamw(1e-2)
    state = init_state(params, optimizer, 0, trainable=trainable)
    train_part, _, frozen = grads.partition(params, trainable)
    assert all(isinstance(v, (nnx.LoRAParam, nn.Tuned)) for v in jax.tree.leaves(
        train_part, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == \
        2 * sum(x.size for x in jax.tree.leaves(train_part)) + 1
    apply = apply_of(cfg)
    step = jax.jit(lm_train_step(apply, optimizer, accumulate=2, trainable=trainable))
    for i in range(3):
        state, metrics = step(state, batch(seed=i))
    new_train, _, new_frozen = grads.partition(state.params, trainable)
    chex.assert_trees_all_equal(new_frozen, frozen)
    assert all(not bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(new_train),
                                                         jax.tree.leaves(train_part)))
    assert np.isfinite(float(metrics["loss"]))
    # The gradients are those of the whole model's loss with respect to the trainable part.
    loss_fn = lambda t: jnp.mean(apply(grads.combine(t, frozen), batch()) ** 2)  # noqa
    grad_fn = grads.value_and_grad(lambda p, b, k: (jnp.mean(apply(p, b) ** 2), {}),
                                   trainable=trainable)
    (_, _), got = jax.jit(grad_fn)(params, batch(), None)
    chex.assert_trees_all_close(got, jax.jit(jax.grad(loss_fn))(train_part), atol=1e-6)


@pytest.mark.parametrize("values,message,field", [
    ({"lora.rank": 65}, "lora_rank=65 exceeds the width 64 of a targeted layer", "lora.rank"),
    ({"lora.rank": -1}, "rank must be at least 0", "lora.rank"),
    ({"lora.rank": 4, "lora.targets": "q,x"}, "'x' matches none of the model's linear layers",
     "lora.targets"),
    ({"lora.rank": 4, "lora.targets": "gate", "gpt.mlp": "gelu"},
     "'gate' matches none of the model's linear layers", "lora.targets"),
    ({"adapters.dim": -2}, "dim must be at least 0", "adapters.dim"),
    ({"init.scheme": "fixup"}, "init.scheme='fixup' is not one of", "init.scheme"),
    ({"stochastic_depth.rate": 1.0}, "rate must be in [0, 1)", "stochastic_depth.rate"),
])
def test_bad_model_settings_are_one_clear_error(values, message, field):
    with pytest.raises(ConfigError) as error:
        cfg = small(values)
        check_ranges(cfg)
        techniques.abstract(cfg)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert error.value.field == field


def test_fine_tune_from_a_run_and_bad_runs(corpus_path, tmp_path, capsys):
    """LoRA on a one-layer run's weights (--init-from): the base is kept bit for bit, only the
    adapters train; runs that cannot be its base, or settings it cannot take, are one line."""
    base = train(small_config(corpus_path, tmp_path, "base", steps=4, eval_every=0,
                              n_layers=1))
    common = ["--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--max-seq-len", "32",
              "--data", corpus_path, "--seq-len", "32", "--batch-size", "4",
              "--steps", "3", "--eval-every", "0", "--no-progress", "--final-eval-batches", "2",
              "--cache-dir", str(tmp_path / "cache")]
    assert train_main([*common, "--run-dir", str(tmp_path / "lora"), "--lora-rank", "2",
                       "--init-from", base.run_dir, "--json", str(tmp_path / "lora.json")]) == 0
    summary = json.load(open(tmp_path / "lora.json"))
    assert summary["techniques"]["lora"]["init_from"] == base.run_dir
    assert summary["trainable_params"] == 1 * 2 * 2 * 32 * 2     # layers x (q, v) x (A + B)
    tuned = flat(final_state(str(tmp_path / "lora"), 3)["params"])
    start = flat(final_state(base.run_dir, 4)["params"])
    trained = {k: v for k, v in tuned.items() if "lora_" in k}
    frozen = {k.replace("/base/", "/"): v for k, v in tuned.items() if "lora_" not in k}
    assert sorted(frozen) == sorted(start)
    chex.assert_trees_all_equal(frozen, start)                  # the base, bit for bit
    assert len(trained) == 1 * 2 * 2
    capsys.readouterr()
    for args, message in [
        (["--n-layers", "4", "--init-from", base.run_dir], "trained another model shape"),
        (["--init-from", str(tmp_path / "nothing")], "is not a run directory"),
        ([], "LoRA and adapters tune a trained model"),
        (["--init-from", base.run_dir, "--sharding", "pp"], "does not run with the pipeline"),
    ]:
        code = train_main([*common, "--run-dir", str(tmp_path / "bad"), "--lora-rank", "2",
                           *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err


def test_checkpoints_record_every_technique_setting_by_its_path(corpus_path, tmp_path):
    """A checkpoint records each technique's section by its path (``lora.rank``, not the old
    ``model.lora_rank``), used or not: checkpoints of the old layout are refused outright
    (``checkpoint.FORMAT``), so none has to match without them; a used setting is recorded
    with its value, and a resumed run must match it."""
    cfg = small_config(corpus_path, tmp_path)
    plain = resume_settings(cfg, {"seq_len": 32}, 8, 1)
    for path in ("init.scheme", "remat.policy", "remat.scan_layers", "stochastic_depth.rate",
                 "token_drop.keep", "lora.rank", "adapters.dim", "sparsity.pattern",
                 "stacking.stages", "gpt.n_layers", "model.name"):
        assert path in plain, path
    assert not {"model.init", "model.lora_rank", "model.n_layers", "run.progressive_stack"} \
        & set(plain)
    used = override(cfg, {"init.scheme": "tfixup"})
    assert resume_settings(used, {"seq_len": 32}, 8, 1)["init.scheme"] == "tfixup"
