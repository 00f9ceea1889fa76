"""The precision policy and loss scaling inside the real train step."""

import functools
import json
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import xla_flags
from jaxaccel.step import grads
from jaxaccel.model.contract import make_apply
from jaxaccel.step.optim import make_optimizer, path_name
from jaxaccel.step.precision import (POLICIES, DynamicLossScale, NoLossScale, StaticLossScale,
                                     loss_scaled)
from jaxaccel.step.state import init_state
from jaxaccel.step.train import lm_eval_step, lm_loss, lm_train_step
from tests.test_train import CFG, init_params as model_of, random_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@jax.custom_vjp
def inf_gradient_if(x, flag):
    """The identity, whose gradient is +inf everywhere when ``flag`` holds."""
    return x


def _forward(x, flag):
    return x, flag


def _backward(flag, g):
    return jnp.where(flag, jnp.full_like(g, jnp.inf), g), None


inf_gradient_if.defvjp(_forward, _backward)


def init_params(cfg, key):
    """The model's state (an ``nnx.State``)."""
    return model_of(cfg, key)[1]


def apply_of(cfg=CFG):
    return make_apply(model_of(cfg, jax.random.PRNGKey(0))[0])


def head(params):
    """The output head's kernel of a state (or of its gradients), as a NumPy array."""
    return np.asarray(params["head"]["kernel"][...])


def poisoned_apply(cfg=CFG):
    """The model, with an inf injected into the head kernel's gradient when any row of the batch
    has ``poison`` set."""
    apply_fn = apply_of(cfg)

    def apply(params, batch, key=None):
        flag = jnp.any(batch["poison"] > 0)
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: inf_gradient_if(x, flag) if path_name(path) == "head/kernel" else x,
            params)
        return apply_fn(params, batch, key)

    return apply


def batch_with_poison(seed, rows=(), B=4):
    batch = random_batch(seed, B=B)
    batch["poison"] = np.zeros(B, np.int32)
    batch["poison"][list(rows)] = 1
    return batch


def fresh_state(loss_scale, optimizer):
    return init_state(init_params(CFG, jax.random.PRNGKey(0)), optimizer, seed=0,
                      loss_scale=loss_scale)


# The optimizer of the tests that run the plain model under a policy; ``policy_step`` jits each
# policy's step once for them all, so that a step they share compiles once.
OPTIMIZER = make_optimizer("adamw", total_steps=30, warmup_steps=3)


@functools.cache
def policy_step(name):
    """The jitted train step of the plain model under the policy ``name``, with OPTIMIZER."""
    return jax.jit(lm_train_step(apply_of(), OPTIMIZER, policy=POLICIES[name]))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_overflow_skips_the_step_bitwise_and_halves_the_scale(accumulate):
    """An inf gradient skips the step bitwise and halves the scale; then the scale grows after
    exactly growth_interval (3) finite steps, not before."""
    optimizer = make_optimizer("adamw", total_steps=10, warmup_steps=0)
    step = jax.jit(lm_train_step(poisoned_apply(), optimizer, accumulate=accumulate))
    state = fresh_state(DynamicLossScale.create(initial_scale=2.0**10, growth_interval=3),
                        optimizer)
    state, _ = step(state, batch_with_poison(0))            # one normal step first
    before = jax.tree.map(np.array, state)
    state, metrics = step(state, batch_with_poison(1, rows=[3]))
    chex.assert_trees_all_equal(state.params, before.params)
    chex.assert_trees_all_equal(state.opt_state, before.opt_state)
    assert float(state.loss_scale.scale) == 2.0**9
    assert int(state.loss_scale.skipped_steps) == 1 and int(metrics["skipped_steps"]) == 1
    assert int(state.loss_scale.growth_tracker) == 0
    assert float(metrics["loss_scale"]) == 2.0**10        # the scale this step ran with
    scales = []
    for seed in range(2, 6):                                # and training goes on
        state, _ = step(state, batch_with_poison(seed))
        scales.append(float(state.loss_scale.scale))
    assert not np.array_equal(head(state.params), head(before.params))
    assert int(state.loss_scale.skipped_steps) == 1
    # The scale grows after exactly growth_interval finite steps (once a test of its own, with
    # the unpoisoned model: a batch without poison runs the same numbers).
    assert scales == [2.0**9, 2.0**9, 2.0**10, 2.0**10]


def test_static_scale_also_skips_and_no_scale_applies_the_step_uncounted():
    """A static scale skips a non-finite step; no scale (fp32, bf16) applies it, the parameters
    NaN, and counts none as skipped (it once counted the applied step as skipped: issue 51)."""
    optimizer = make_optimizer("sgd", total_steps=10, warmup_steps=0)
    step = jax.jit(lm_train_step(poisoned_apply(), optimizer))
    static = fresh_state(StaticLossScale.create(2.0**8), optimizer)
    new, _ = step(static, batch_with_poison(0, rows=[0]))
    chex.assert_trees_all_equal(new.params, static.params)
    assert float(new.loss_scale.scale) == 2.0**8 and int(new.loss_scale.skipped_steps) == 1
    unscaled = fresh_state(NoLossScale.create(), optimizer)
    new, metrics = step(unscaled, batch_with_poison(0, rows=[0]))
    assert not np.all(np.isfinite(head(new.params)))
    assert int(new.loss_scale.skipped_steps) == 0 and int(metrics["skipped_steps"]) == 0


def test_loss_scaling_scales_the_backward_pass_and_unscales_the_gradients():
    params = init_params(CFG, jax.random.PRNGKey(0))
    grad_fn = grads.value_and_grad(lm_loss(apply_of()))
    batch = random_batch(7, pad=2)
    key = jax.random.PRNGKey(0)

    @jax.jit        # the three gradient functions in one compile
    def all_three(params, batch, key, scale):
        return (grad_fn(params, batch, key), grad_fn(params, batch, key, scale=2.0**16),
                loss_scaled(grad_fn)(params, batch, key, scale))

    ((loss, _), plain), (_, scaled), ((scaled_loss, aux), unscaled, next_scale) = all_three(
        params, batch, key, DynamicLossScale.create(2.0**16))
    assert float(scaled_loss) == float(loss)               # the reported loss is unscaled
    assert bool(aux["grads_finite"]) and int(next_scale.growth_tracker) == 1
    for a, b in zip(jax.tree.leaves(unscaled), jax.tree.leaves(plain)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)
    # The backward pass really ran scaled.
    ratio = head(scaled) / head(plain)
    assert np.nanmedian(ratio) == pytest.approx(2.0**16, rel=1e-4)


def test_policy_computes_in_half_precision_and_keeps_float32_masters():
    apply_fn = apply_of()
    for name, dtype in (("bf16", "bf16"), ("fp16", "f16")):
        scale = DynamicLossScale.create() if name == "fp16" else NoLossScale.create()
        state = fresh_state(scale, OPTIMIZER)
        traced = policy_step(name).trace(state, random_batch(0))    # the step's own jaxpr
        text = str(traced.jaxpr)
        dots = [line for line in text.splitlines() if "dot_general" in line]
        assert dots and sum(f":{dtype}[" in line.split("=")[0] for line in dots) >= 0.5 * len(dots)
        new, metrics = policy_step(name)(state, random_batch(0))
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.params))
        assert metrics["loss"].dtype == jnp.float32
        eval_sums = jax.jit(lm_eval_step(apply_fn, POLICIES[name]))(new, random_batch(1))
        assert eval_sums["loss_sum"].dtype == jnp.float32
    fp32_text = str(jax.make_jaxpr(lm_train_step(apply_fn, OPTIMIZER))(
        fresh_state(NoLossScale.create(), OPTIMIZER), random_batch(0)))
    assert ":bf16[" not in fp32_text and ":f16[" not in fp32_text


def test_bf16_and_fp16_losses_track_float32():
    losses = {}
    for name in ("fp32", "bf16", "fp16"):
        scale = DynamicLossScale.create() if name == "fp16" else NoLossScale.create()
        state = fresh_state(scale, OPTIMIZER)
        for i in range(30):
            state, metrics = policy_step(name)(state, random_batch(i % 3))
        losses[name] = float(metrics["loss"])
        assert int(state.loss_scale.skipped_steps) == 0
    assert losses["fp32"] < 3.5
    assert abs(losses["bf16"] - losses["fp32"]) < 0.05 * losses["fp32"]
    assert abs(losses["fp16"] - losses["fp32"]) < 0.02 * losses["fp32"]


def test_fp16_overflow_backs_off_until_steps_are_finite():
    """A scale far too large for float16 overflows for real; the scale backs off to a working
    one, and the skipped steps change nothing."""
    step = policy_step("fp16")          # the step of the test above
    state = fresh_state(DynamicLossScale.create(initial_scale=2.0**40), OPTIMIZER)
    initial = jax.tree.map(np.array, state.params)
    state, _ = step(state, random_batch(0))
    chex.assert_trees_all_equal(state.params, initial)
    for i in range(40):
        state, metrics = step(state, random_batch(i % 3))
    skipped = int(state.loss_scale.skipped_steps)
    assert 1 <= skipped < 40
    assert float(state.loss_scale.scale) == 2.0 ** (40 - skipped)
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 41


TWO_DEVICE_SCRIPT = textwrap.dedent("""
    import json
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxaccel.step.optim import make_optimizer
    from jaxaccel.step.precision import DynamicLossScale, all_finite
    from jaxaccel.step.train import lm_train_step
    from tests.test_mixed_precision_step import batch_with_poison, fresh_state, poisoned_apply
    mesh = Mesh(np.array(jax.devices()), ("data",))
    optimizer = make_optimizer("adamw", total_steps=10, warmup_steps=0)
    state = fresh_state(DynamicLossScale.create(initial_scale=2.0**10), optimizer)
    replicated = NamedSharding(mesh, P())
    state = jax.device_put(state, replicated)
    batch = batch_with_poison(0, rows=[3], B=4)   # rows 2-3 live on the second device only
    batch = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in batch.items()}
    assert batch["poison"].addressable_shards[0].data.sum() == 0
    step = jax.jit(lm_train_step(poisoned_apply(), optimizer),
                   out_shardings=(replicated, replicated))
    new, _ = step(state, batch)
    for shard in new.loss_scale.scale.addressable_shards:
        print("scale", shard.device.id, float(shard.data))
    for shard in new.loss_scale.skipped_steps.addressable_shards:
        print("skipped", shard.device.id, int(shard.data))
    kernel = new.params["head"]["kernel"][...]
    same = [bool(np.array_equal(s.data, np.asarray(state.params["head"]["kernel"][...])))
            for s in kernel.addressable_shards]
    print("unchanged", all(same), len(same))

    # all_finite and adjust alone (tests/test_precision.py's units), on sharded gradients.
    g = np.random.default_rng(8).standard_normal((8, 4)).astype(np.float32)
    g[6, 2] = np.inf
    grads = jax.device_put(g, NamedSharding(mesh, P("data")))

    def check(grads, scale):
        finite = all_finite(grads)
        return finite, scale.adjust(finite)

    check = jax.jit(check, out_shardings=NamedSharding(mesh, P()))
    finite, scale = check(grads, DynamicLossScale.create(initial_scale=1024.0))
    shards = lambda a: sorted(a.addressable_shards, key=lambda s: s.device.id)
    print("units", json.dumps({
        "devices": len(jax.devices()),
        "shard_finite": [bool(np.isfinite(s.data).all()) for s in shards(grads)],
        "finite": [bool(s.data) for s in shards(finite)],
        "scale": [float(s.data) for s in shards(scale.scale)],
        "skipped": [int(s.data) for s in shards(scale.skipped_steps)],
    }))
""")


def test_two_devices_agree_on_skipping_when_only_one_sees_an_inf():
    """Two devices, one of which alone sees the inf: the real train step skips on both and both
    halve the scale; and ``all_finite`` with ``adjust`` alone agree on both (one subprocess for
    the two checks, moved here from tests/test_precision.py, which needs two devices too)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2"),
           "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
           "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", TWO_DEVICE_SCRIPT], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split("\n")
    assert sorted(line for line in lines if line.startswith("scale")) == \
        ["scale 0 512.0", "scale 1 512.0"]
    assert sorted(line for line in lines if line.startswith("skipped")) == \
        ["skipped 0 1", "skipped 1 1"]
    assert "unchanged True 2" in lines
    (units,) = [json.loads(line[len("units "):]) for line in lines if line.startswith("units ")]
    assert units == {"devices": 2, "shard_finite": [True, False], "finite": [False, False],
                     "scale": [512.0, 512.0], "skipped": [1, 1]}


def test_param_dtype_is_the_dtype_parameters_are_stored_in():
    """A policy's param_dtype is applied: the state holds the parameters (and so the optimizer
    moments) in it, and steps keep them there."""
    from jaxaccel.step.precision import get_policy
    policy = get_policy("params=bfloat16,compute=bfloat16,output=float32")
    optimizer = make_optimizer("adamw", total_steps=10, warmup_steps=0)
    state = init_state(init_params(CFG, jax.random.PRNGKey(0)), optimizer, seed=0,
                       policy=policy)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    step = jax.jit(lm_train_step(apply_of(), optimizer, policy=policy, accumulate=2))
    for seed in range(3):
        state, metrics = step(state, random_batch(seed))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert np.isfinite(float(metrics["loss"])) and metrics["loss"].dtype == jnp.float32
