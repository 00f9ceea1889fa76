import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from jaxaccel.step import grads
from jaxaccel.model import nn
from jaxaccel.techniques import registry as techniques
from jaxaccel.step.compiled import CompiledFn, memory_bytes
from jaxaccel.run.config import TrainConfig, build
from jaxaccel.core.errors import ConfigError
from jaxaccel.model.contract import make_apply
from jaxaccel.step.optim import (DEFAULTS, OPTIMIZERS, decay_mask, make_optimizer, make_schedule,
                                 path_name, scale_learning_rate, state_bytes)
from jaxaccel.step.state import init_state
from jaxaccel.step.train import lm_eval_step, lm_loss, lm_train_step
from tests.test_train import CFG, config, init_params, random_batch


def params_and_apply(cfg=CFG, seed=0):
    """The model's state (an ``nnx.State``) and its apply function."""
    graphdef, params = init_params(cfg, jax.random.PRNGKey(seed))
    return params, make_apply(graphdef)


def by_path(tree) -> dict:
    """``{path: leaf}`` of a mask or of a State mapped to bools."""
    return {path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def mean_loss(eval_step, state, batch):
    sums = eval_step(state, batch)
    return float(sums["loss_sum"] / sums["weight_sum"])


def test_unknown_optimizer_is_a_clear_error_listing_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        make_optimizer("adamm", total_steps=10)
    for name in OPTIMIZERS:
        assert name in str(e.value)
    assert e.value.field == "optimizer.name"


def overfit(optimizers: dict, batch_seed: int, steps=40) -> dict:
    """Train each optimizer on one batch from the same parameters; return ``{name: (loss
    before, loss after, final state, last metrics)}``. One jitted step trains them all side by
    side (each its own state): one compile instead of one per optimizer."""
    params, apply_fn = params_and_apply()
    train_steps = {name: lm_train_step(apply_fn, opt) for name, opt in optimizers.items()}
    step = jax.jit(lambda states, batch: {name: train_steps[name](states[name], batch)
                                          for name in train_steps})
    eval_step = jax.jit(lm_eval_step(apply_fn))
    batch = random_batch(batch_seed)
    states = {name: init_state(params, opt, seed=0) for name, opt in optimizers.items()}
    before = mean_loss(eval_step, states[next(iter(states))], batch)   # the same parameters
    for _ in range(steps):
        out = step(states, batch)
        states = {name: state for name, (state, _) in out.items()}
    return {name: (before, mean_loss(eval_step, states[name], batch), states[name],
                   out[name][1]) for name in optimizers}


@pytest.fixture(scope="module")
def overfitted():
    """Every optimizer, and AdamW with bfloat16 moments, overfitted on batch 1."""
    optimizers = {name: make_optimizer(name, total_steps=40, warmup_steps=4)
                  for name in OPTIMIZERS}
    optimizers["adamw, bf16 state"] = make_optimizer("adamw", total_steps=40, warmup_steps=4,
                                                     state_dtype=jnp.bfloat16)
    return overfit(optimizers, 1)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_lowers_the_loss(overfitted, name):
    before, after, _, metrics = overfitted[name]
    assert after < 0.93 * before, (name, before, after)
    assert float(metrics["update_norm"]) > 0


def test_decay_mask_excludes_exactly_norms_biases_and_embeddings():
    """Decay is decided by rank, variable type and metadata, never by name: norms and biases
    are left out because they are vectors per layer (a scanned stack's leading layer axis,
    metadata ``stacked``, does not count), embedding tables by their ``weight_decay=False``
    metadata, buffers by their type. (Before the any-model change it matched the names embed,
    norm and bias; a plain pytree is now judged by rank alone.)"""
    params = nnx.State({
        "embed": {"embedding": nnx.Param(jnp.ones((8, 4)), weight_decay=False)},
        "blocks": {"layers": {0: {"attn": {"wq": {"kernel": nnx.Param(jnp.ones((4, 4))),
                                                  "bias": nnx.Param(jnp.ones(4))}},
                                  "attn_norm": {"scale": nnx.Param(jnp.ones(4))}}}},
        "scanned": {"layers": {"mlp_norm": {"scale": nnx.Param(jnp.ones((2, 4)), stacked=True)},
                               "w": {"kernel": nnx.Param(jnp.ones((2, 4, 4)), stacked=True)}}},
        "amax": nn.Buffer(jnp.ones((4, 4))),
        "head": {"kernel": nnx.Param(jnp.ones((4, 8)))}})
    mask = decay_mask(params)
    decayed = sorted(name for name, m in by_path(mask).items() if m)
    assert decayed == ["blocks/layers/0/attn/wq/kernel", "head/kernel",
                       "scanned/layers/w/kernel"]
    # Names no longer decide: a matrix named like a norm decays, a vector named kernel does not.
    renamed = nnx.State({"norm": {"scale": nnx.Param(jnp.ones((4, 4)))},
                         "embed": {"kernel": nnx.Param(jnp.ones(4))}})
    assert by_path(decay_mask(renamed)) == {"norm/scale": True, "embed/kernel": False}
    # A plain pytree is judged by rank.
    assert by_path(decay_mask({"a": jnp.ones((2, 2)), "b": jnp.ones(2)})) == {"a": True,
                                                                               "b": False}
    # Overridable: a custom pattern list (--no-decay) spares the head besides.
    assert not decay_mask(params, exclude=(r"^head/",))["head"]["kernel"]
    assert sum(jax.tree.leaves(decay_mask(params, exclude=(r"^head/",)))) == 2
    with pytest.raises(ConfigError, match="bad parameter-path pattern") as info:
        decay_mask(params, exclude=("(",))
    assert info.value.field == "optimizer.no_decay"


def test_real_model_mask_decays_every_projection_and_nothing_else():
    params, _ = params_and_apply()
    mask = decay_mask(params)
    for path, decays in jax.tree_util.tree_leaves_with_path(mask):
        name = path_name(path)
        expected = name.endswith("kernel") and not name.startswith("embed")
        assert decays == expected, name


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_weight_decay_and_trust_ratio_touch_only_the_masked_leaves(name):
    """With zero gradients the only change a step makes is weight decay: it must land on the
    masked leaves alone, and a mask that spares the head must spare it."""
    params, _ = params_and_apply()
    sparing_head = lambda p: decay_mask(p, exclude=(r"^head/",))  # noqa: E731
    optimizer = make_optimizer(name, learning_rate=1e-2, weight_decay=0.5, total_steps=10,
                               clip_norm=None, mask=sparing_head)
    state = optimizer.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(optimizer.update)(zeros, state, params)    # one compile, not per op
    mask = sparing_head(params)
    moved = jax.tree.map(lambda u: bool(jnp.any(u != 0)), updates)
    assert by_path(moved) == by_path(mask), name
    assert not mask["head"]["kernel"] and mask["blocks"]["layers"][0]["mlp"]["w_in"]["kernel"]
    assert not mask["embed"]["embedding"] and not mask["final_norm"]["scale"]


def test_schedules_at_chosen_steps():
    lr = 1.0
    values = lambda name: [float(make_schedule(name, lr, warmup_steps=10,  # noqa: E731
                                               total_steps=110)(s)) for s in (0, 5, 10, 60, 110)]
    np.testing.assert_allclose(values("constant"), [0, 0.5, 1, 1, 1], atol=1e-6)
    np.testing.assert_allclose(values("cosine"), [0, 0.5, 1, 0.55, 0.1], atol=1e-6)
    np.testing.assert_allclose(values("linear"), [0, 0.5, 1, 0.55, 0.1], atol=1e-6)
    np.testing.assert_allclose(values("rsqrt"), [0, 0.5, 1, (10 / 60) ** 0.5, (10 / 110) ** 0.5],
                               atol=1e-6)
    no_warmup = make_schedule("cosine", lr, warmup_steps=0, total_steps=100)
    assert float(no_warmup(0)) == 1.0
    with pytest.raises(ConfigError, match="unknown schedule 'step'") as info:
        make_schedule("step", lr, warmup_steps=0, total_steps=10)
    assert info.value.field == "optimizer.schedule"


def test_learning_rate_scaling_rules():
    assert scale_learning_rate(1e-3, "linear", 128, 16) == pytest.approx(8e-3)
    assert scale_learning_rate(1e-3, "sqrt", 128, 32) == pytest.approx(2e-3)
    assert scale_learning_rate(1e-3, "none", 128, 16) == 1e-3
    with pytest.raises(ConfigError, match="unknown learning-rate scaling 'cubic'") as info:
        scale_learning_rate(1e-3, "cubic", 128, 16)
    assert info.value.field == "optimizer.lr_scaling"


def test_lion_defaults_follow_its_authors_advice():
    adamw, lion = DEFAULTS["adamw"], DEFAULTS["lion"]
    assert 3 <= adamw.learning_rate / lion.learning_rate <= 10
    assert 3 <= lion.weight_decay / adamw.weight_decay <= 10


def test_state_bytes_lion_half_of_adamw_and_bf16_halves_again():
    # Wide enough (256) for Adafactor to factor its second moments.
    params = nnx.state(techniques.abstract(build(TrainConfig, {"model.name": "tiny"})))
    sizes = {}
    for name in ("adamw", "lion", "adafactor"):
        optimizer = make_optimizer(name, total_steps=10)
        sizes[name] = state_bytes(jax.eval_shape(optimizer.init, params))
    param_bytes = state_bytes(params)
    assert abs(sizes["adamw"] - 2 * param_bytes) < 0.01 * param_bytes
    assert abs(sizes["lion"] - param_bytes) < 0.01 * param_bytes
    assert sizes["adafactor"] < 0.5 * param_bytes
    optimizer = make_optimizer("adamw", total_steps=10, state_dtype=jnp.bfloat16)
    bf16_state = jax.eval_shape(optimizer.init, params)
    assert abs(state_bytes(bf16_state) - param_bytes) < 0.01 * param_bytes
    floats = [x for x in jax.tree.leaves(bf16_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)


def test_bf16_optimizer_state_still_trains(overfitted):
    """AdamW with bfloat16 moments (trained beside the others, on the same batch)."""
    before, after, state, _ = overfitted["adamw, bf16 state"]
    assert after < 0.8 * before
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.opt_state)
               if jnp.issubdtype(x.dtype, jnp.floating))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def accumulated():
    """The parameters, the batch, and ``{microbatches: ((loss, aux), gradients)}`` for the whole
    batch (1) and 2, 4 and 8 microbatches, from one jitted function (one compile)."""
    params, apply_fn = params_and_apply()
    # Uneven padding so that microbatches carry different token counts.
    batch = random_batch(3, B=8)
    rng = np.random.default_rng(4)
    for row in range(8):
        cut = int(rng.integers(2, 16))
        batch["weights"][row, cut:] = 0
        batch["segment_ids"][row, cut:] = 0
    grad_fn = grads.value_and_grad(lm_loss(apply_fn))
    fns = {1: grad_fn, **{n: grads.accumulate(grad_fn, n, weight="real_tokens")
                          for n in (2, 4, 8)}}
    results = jax.jit(lambda params, batch, key: {n: fn(params, batch, key)
                                                  for n, fn in fns.items()})(
        params, batch, jax.random.PRNGKey(0))
    return params, batch, results


@pytest.mark.parametrize("microbatches", [2, 4, 8])
def test_accumulated_gradient_equals_the_full_batch_gradient(accumulated, microbatches):
    params, batch, results = accumulated
    (loss, aux), whole = results[1]
    (acc_loss, acc_aux), acc_grads = results[microbatches]
    assert float(acc_aux["real_tokens"]) == float(aux["real_tokens"]) == batch["weights"].sum()
    assert float(acc_aux["padded_tokens"]) == float(aux["padded_tokens"])
    assert abs(float(acc_loss) - float(loss)) <= 1e-6 * abs(float(loss))
    for leaf_acc, leaf in zip(jax.tree.leaves(acc_grads), jax.tree.leaves(whole)):
        assert relative_error(leaf_acc, leaf) < 1e-6
    chex.assert_trees_all_equal_shapes_and_dtypes(acc_grads, params)


def test_accumulated_step_equals_full_batch_step_and_uses_less_memory():
    cfg = config(**{"gpt.d_model": 64, "model.max_seq_len": 128})
    params, apply_fn = params_and_apply(cfg)
    # SGD's update is linear in the gradient, so equal gradients give equal parameters (Adam's
    # first step is about sign(g), which rounding flips on entries near zero).
    optimizer = make_optimizer("sgd", total_steps=10, warmup_steps=0)
    batch = random_batch(5, B=16, T=128)
    results, temps = [], []
    for microbatches in (1, 4):
        state = init_state(params, optimizer, seed=0)
        step = CompiledFn(lm_train_step(apply_fn, optimizer, accumulate=microbatches))
        new_state, metrics = step(state, batch)
        results.append((new_state.params, float(metrics["loss"]), float(metrics["grad_norm"])))
        temps.append(memory_bytes(step.last)["temp"])
    (full, full_loss, full_norm), (acc, acc_loss, acc_norm) = results
    assert abs(acc_loss - full_loss) <= 1e-6 * full_loss
    assert abs(acc_norm - full_norm) <= 1e-5 * full_norm
    chex.assert_trees_all_close(acc, full, rtol=1e-5, atol=1e-6)
    assert temps[1] < 0.6 * temps[0], temps


def test_accumulate_must_divide_the_batch():
    params, apply_fn = params_and_apply()
    grad_fn = grads.accumulate(grads.value_and_grad(lm_loss(apply_fn)), 3)
    with pytest.raises(ConfigError, match="does not split into 3 microbatches"):
        grad_fn(params, random_batch(0, B=4), jax.random.PRNGKey(0))


def test_accumulate_reduces_sums_and_means_as_told():
    """Any pytree batch: a mean loss averages over microbatches, a sum loss adds up, and each
    microbatch gets its own key."""
    def loss_fn(w, batch, key):
        return jnp.mean(batch["x"] * w), {"row_count": jnp.float32(batch["x"].shape[0]),
                                          "noise": jax.random.normal(key, ())}

    def sum_fn(w, batch, key):
        return jnp.sum(batch["x"] * w), {}

    batch = {"x": jnp.arange(8.0)}
    mean = grads.value_and_grad(loss_fn)
    (loss, aux), g = grads.accumulate(mean, 4)(2.0, batch, jax.random.PRNGKey(0))
    (whole, _), g_whole = mean(2.0, batch, jax.random.PRNGKey(0))
    assert float(loss) == pytest.approx(float(whole)) and float(g) == pytest.approx(float(g_whole))
    assert float(aux["row_count"]) == 8
    noises = [jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(0), i), ()) for i in range(4)]
    assert float(aux["noise"]) == pytest.approx(float(sum(noises)), rel=1e-6)
    (total, _), g_sum = grads.accumulate(grads.value_and_grad(sum_fn), 4, reduce="sum")(
        2.0, batch, jax.random.PRNGKey(0))
    assert float(total) == 2.0 * 28 and float(g_sum) == 28
    with pytest.raises(ConfigError, match="weight only applies"):
        grads.accumulate(mean, 2, reduce="sum", weight="row_count")


def test_accumulate_keeps_per_row_values_in_row_order_and_maxima_by_maximum():
    """``aux["rows"]`` comes back as the whole batch's rows (microbatches are strided), and
    ``aux["observed_max"]`` combines by maximum, not by sum."""
    def loss_fn(w, batch, key):
        return jnp.mean(batch["x"] * w), {"rows": {"scaled": 10 * batch["x"]},
                                          "observed_max": {"m": jnp.max(batch["x"])}}

    batch = {"x": jnp.arange(8.0) ** 2}
    (_, aux), _ = grads.accumulate(grads.value_and_grad(loss_fn), 4)(2.0, batch,
                                                                   jax.random.PRNGKey(0))
    np.testing.assert_array_equal(aux["rows"]["scaled"], 10 * batch["x"])
    assert float(aux["observed_max"]["m"]) == 49.0


def test_observed_leaves_report_their_cotangent_and_get_no_gradient():
    """``value_and_grad(observed=)``: a variable of the observed type (``nn.Observation``) has
    its cotangent come back in aux, not in the gradients (FP8's amax histories use it); a
    variable outside both filters (a plain buffer) gets neither."""
    @jax.custom_vjp
    def probe(x, p):
        return x

    probe.defvjp(lambda x, p: (x, x), lambda x, g: (g, jnp.max(jnp.abs(x))))

    def loss_fn(params, batch, key):
        w = params["w"][...] * params["frozen"][...]
        return jnp.sum(probe(w * batch, params["probe"][...])), {}

    params = nnx.State({"w": nnx.Param(jnp.float32(3.0)),
                        "probe": nn.Observation(jnp.float32(0.0)),
                        "frozen": nn.Buffer(jnp.float32(1.0))})
    grad_fn = grads.value_and_grad(loss_fn, trainable=nnx.Param, observed=nn.Observation)
    (_, aux), g = grad_fn(params, jnp.array([1.0, -2.0]), None, scale=8.0)
    assert set(g) == {"w"} and float(g["w"][...]) == 8.0 * -1.0
    assert set(aux["observed_max"]) == {"probe"}
    assert float(aux["observed_max"]["probe"][...]) == 6.0   # max |3 * batch|, not scaled by 8
