import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxaccel.core.errors import ConfigError
from jaxaccel.step.precision import (POLICIES, DynamicLossScale, NoLossScale, Policy,
                                     StaticLossScale, all_finite, get_policy, make_loss_scale,
                                     select_tree)


def random_tree(seed):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(3), jnp.float32),
            "ids": jnp.asarray(rng.integers(1, 100, (2, 5)), jnp.int32)}


@pytest.mark.parametrize("spec, expected", [
    ("bf16", POLICIES["bf16"]),
    ("fp16", Policy(jnp.float32, jnp.float16, jnp.float32)),
    ("params=float32,compute=bfloat16,output=float32", POLICIES["bf16"]),
    ("output=f32, compute=f16, params=fp32", POLICIES["fp16"]),
    ("params=bf16,compute=bf16,output=f32", Policy(jnp.bfloat16, jnp.bfloat16, jnp.float32)),
])
def test_policy_parses_names_and_string_form(spec, expected):
    policy = get_policy(spec)
    assert policy == expected
    assert get_policy(str(policy)) == policy


def test_policy_names():
    assert [str(p) for p in POLICIES.values()] == list(POLICIES)
    assert get_policy("params=float16,compute=float16,output=float32").name == \
        "params=float16,compute=float16,output=float32"
    assert [p.needs_loss_scaling for p in POLICIES.values()] == [False, False, True, False]
    assert [p.fp8 for p in POLICIES.values()] == [False, False, False, True]


@pytest.mark.parametrize("spec, bad", [
    ("fp4", "'fp4'"),
    ("params=float32,compute=int8,output=float32", "'int8'"),
    ("params=float32,compute=bf16", "lacks output"),
    ("params=float32,compute=bf16,output=f32,compute=f16", "'compute=f16'"),
    ("params=float32,weights=bf16,output=f32", "'weights=bf16'"),
    ("params=float32,bf16,output=f32", "'bf16'"),
])
def test_bad_policy_strings_raise_one_helpful_line(spec, bad):
    with pytest.raises(ConfigError) as info:
        get_policy(spec)
    message = str(info.value)
    assert "\n" not in message and bad in message and info.value.field == "precision.policy"
    assert "bf16" in message and "float16" in message


def test_casts_change_floating_leaves_only():
    tree = random_tree(1)
    policy = POLICIES["bf16"]
    compute = policy.cast_to_compute(tree)
    assert jax.tree.structure(compute) == jax.tree.structure(tree)
    assert compute["w"].dtype == jnp.bfloat16 and compute["b"].dtype == jnp.bfloat16
    assert compute["ids"] is tree["ids"]
    back = policy.cast_to_output(compute)
    assert back["w"].dtype == jnp.float32 and back["ids"].dtype == jnp.int32
    np.testing.assert_allclose(back["w"], tree["w"], rtol=1e-2)
    assert policy.cast_to_param(compute)["b"].dtype == jnp.float32


@pytest.mark.parametrize("leaf, bad", [("b", np.inf), ("w", -np.inf), ("w", np.nan)])
def test_overflow_skips_step_and_backs_off(leaf, bad):
    old_params, new_params = random_tree(2), random_tree(3)
    grads = random_tree(4)
    grads[leaf] = grads[leaf].at[-1].set(bad)
    scale = DynamicLossScale.create(initial_scale=1024.0, growth_interval=10)
    scale = scale.replace(growth_tracker=jnp.asarray(5, jnp.int32))

    finite = all_finite(grads)
    assert not finite and all_finite(random_tree(4))
    adjusted = scale.adjust(finite)
    assert adjusted.scale == 512.0 and adjusted.growth_tracker == 0
    assert adjusted.skipped_steps == 1
    chex.assert_trees_all_equal(select_tree(finite, new_params, old_params), old_params)
    chex.assert_trees_all_equal(select_tree(~finite, new_params, old_params), new_params)


def test_growth_after_exactly_growth_interval_finite_steps_under_jit():
    adjust = jax.jit(lambda scale, finite: scale.adjust(finite))
    scale = DynamicLossScale.create(initial_scale=256.0, growth_interval=3)
    history = []
    for finite in [True, True, False, True, True, True]:
        scale = adjust(scale, jnp.asarray(finite))
        history.append((float(scale.scale), int(scale.growth_tracker)))
    assert history == [(256, 1), (256, 2), (128, 0), (128, 1), (128, 2), (256, 0)]
    assert scale.skipped_steps == 1 and scale.growth_interval == 3


def test_min_scale_is_respected():
    scale = DynamicLossScale.create(initial_scale=2.0**10, min_scale=8.0)
    for _ in range(20):
        scale = scale.adjust(jnp.asarray(False))
    assert scale.scale == 8.0 and scale.skipped_steps == 20


def test_scale_never_grows_to_inf():
    f32_max = float(jnp.finfo(jnp.float32).max)
    scale = DynamicLossScale.create(initial_scale=f32_max / 4, growth_interval=1)
    for _ in range(10):
        scale = scale.adjust(jnp.asarray(True))
    assert scale.scale == f32_max and scale.growth_tracker == 0


def mlp_loss(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"]) ** 2)


@pytest.mark.parametrize("loss_scale", [DynamicLossScale.create(), StaticLossScale.create()])
def test_scaled_then_unscaled_gradients_match(loss_scale):
    rng = np.random.default_rng(5)
    params = {"w1": rng.standard_normal((8, 16)), "b1": rng.standard_normal(16),
              "w2": rng.standard_normal((16, 4))}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    x = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    plain = jax.grad(mlp_loss)(params, x)
    scaled = jax.grad(lambda p: loss_scale.scale_loss(mlp_loss(p, x)))(params)
    assert not np.allclose(scaled["w1"], plain["w1"])
    chex.assert_trees_all_close(loss_scale.unscale(scaled), plain, rtol=1e-6, atol=0)


def test_fp16_gradients_underflow_without_scaling():
    policy = POLICIES["fp16"]
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.uniform(0.5, 1.5, (16, 8)), jnp.float32)
    x = jnp.asarray(rng.uniform(0.5, 1.5, (32, 16)), jnp.float32)
    weights = jnp.asarray(10.0 ** rng.uniform(-9, -8, (32, 8)), jnp.float32)

    def loss(w):
        y = policy.cast_to_compute(x) @ policy.cast_to_compute(w)
        return jnp.sum(policy.cast_to_output(y) * weights)

    reference = np.asarray(x, np.float64).T @ np.asarray(weights, np.float64)
    unscaled = jax.grad(loss)(w)
    loss_scale = make_loss_scale("auto", policy)
    scaled = loss_scale.unscale(jax.grad(lambda w: loss_scale.scale_loss(loss(w)))(w))
    assert loss_scale.scale == 2.0**16
    assert np.mean(unscaled == 0) > 0.9
    assert np.mean(scaled == 0) == 0
    np.testing.assert_allclose(scaled, reference, rtol=1e-2)


def test_a_static_scale_counts_skipped_steps_and_no_scale_none():
    """No scale (fp32, bf16) applies every step (``make_train_step``), so it counts none as
    skipped; a static scale skips and counts the non-finite ones."""
    grads = random_tree(7)
    for loss_scale, value, skipped in [
            (make_loss_scale("static", POLICIES["fp32"], static_scale=64.0), 64, 2),
            (make_loss_scale("auto", POLICIES["bf16"]), 1, 0)]:
        for finite in [True, False, False]:
            loss_scale = loss_scale.adjust(jnp.asarray(finite))
        assert loss_scale.skipped_steps == skipped and loss_scale.loss_scale == value
        assert loss_scale.loss_scale.dtype == jnp.float32
        scaled = {**grads, "w": grads["w"] * value, "b": grads["b"] * value}
        chex.assert_trees_all_close(loss_scale.unscale(scaled), grads)
    assert isinstance(make_loss_scale("none", POLICIES["fp16"]), NoLossScale)


@pytest.mark.parametrize("kwargs", [
    {"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"backoff_factor": 0.0},
    {"growth_interval": 0}, {"initial_scale": 0.5}, {"min_scale": 0.0},
    {"initial_scale": float("inf")},
])
def test_nonsense_loss_scale_settings_raise(kwargs):
    with pytest.raises(ConfigError, match="loss scale|loss-scale") as info:
        DynamicLossScale.create(**kwargs)
    assert info.value.field.startswith("precision.")


def test_unknown_loss_scale_kind_raises():
    with pytest.raises(ConfigError, match="use one of auto, dynamic, static, none") as info:
        make_loss_scale("adaptive", POLICIES["fp16"])
    assert info.value.field == "precision.loss_scale"


def test_loss_scale_roundtrips_through_orbax(tmp_path):
    settings = dict(growth_factor=4.0, backoff_factor=0.25, growth_interval=7, min_scale=2.0)
    saved = DynamicLossScale.create(initial_scale=2.0**20, **settings)
    saved = saved.replace(growth_tracker=jnp.asarray(5, jnp.int32),
                          skipped_steps=jnp.asarray(3, jnp.int32))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"loss_scale": saved})
    checkpointer.wait_until_finished()
    target = {"loss_scale": DynamicLossScale.create(**settings)}
    restored = checkpointer.restore(tmp_path / "ckpt", target)["loss_scale"]
    assert isinstance(restored, DynamicLossScale)
    chex.assert_trees_all_equal(restored, saved)
    assert (restored.scale.dtype, restored.growth_tracker.dtype) == (jnp.float32, jnp.int32)
    assert (restored.growth_factor, restored.backoff_factor, restored.growth_interval,
            restored.min_scale) == (4.0, 0.25, 7, 2.0)


def test_loss_scale_passes_through_jit():
    scale = DynamicLossScale.create(initial_scale=128.0, growth_interval=5)
    out = jax.jit(lambda s: s.replace(scale=s.scale * 3))(scale)
    assert isinstance(out, DynamicLossScale) and out.scale == 384.0
    assert out.growth_interval == 5 and out.skipped_steps.dtype == jnp.int32


# all_finite and adjust on two devices, one of which alone sees an inf, agree to skip: checked in
# tests/test_mixed_precision_step.py's two-device subprocess, beside the train step's check.
