"""FP8 matmuls with delayed scaling (jaxaccel.techniques.fp8): numerics against float32 and an
independent
float8 reference (ml_dtypes), the amax histories through the step and the checkpoint, saturation
instead of overflow, and the device check."""

import types

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from jaxaccel.techniques import fp8, surgery, registry as techniques
from jaxaccel.model import nn
from jaxaccel.step import trace
from jaxaccel.run.config import build
from jaxaccel.core.errors import ConfigError
from jaxaccel.run.loop import train, train_step_of
from jaxaccel.step.state import init_state
from tests.test_loop import final_state
from tests.test_techniques import batch, build_model, flat, small

E4M3_EPS = 2.0 ** -3          # float8 e4m3: 3 mantissa bits; e5m2: 2
E5M2_EPS = 2.0 ** -2


def reference_qdq(x, dtype):
    """float8 rounding through ml_dtypes with the power-of-two current scale, in float64."""
    x = np.asarray(x, np.float64)
    limit = float(ml_dtypes.finfo(dtype).max)
    scale = 2.0 ** np.floor(np.log2(limit / np.abs(x).max()))
    return np.clip(x * scale, -limit, limit).astype(np.float32).astype(dtype).astype(
        np.float64) / scale


def relative_error(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def operands(seed=0, shape=(4, 16, 64), n=48):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kx, shape) * 3.0, jax.random.normal(kw, (shape[-1], n)) * 0.02,
            jax.random.normal(kg, (*shape[:-1], n)) * 1e-4)


def test_matmul_matches_float8_rounding_and_stays_within_the_format_bound():
    x, w, g = operands()
    empty = fp8.new_history()
    y, backward = jax.vjp(fp8.matmul, x, w, empty)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    expected = reference_qdq(x, ml_dtypes.float8_e4m3fn) @ reference_qdq(w, ml_dtypes.float8_e4m3fn)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    error = relative_error(y, exact)
    assert 1e-3 < error < E4M3_EPS         # float8's rounding, not float32's, and within its bound
    dx, dw, observed = backward(g)
    g_q = reference_qdq(g, ml_dtypes.float8_e5m2)
    np.testing.assert_allclose(dx, g_q @ reference_qdq(w, ml_dtypes.float8_e4m3fn).T, rtol=1e-4,
                               atol=1e-9)
    exact_dx = np.asarray(g, np.float64) @ np.asarray(w, np.float64).T
    exact_dw = np.asarray(x, np.float64).reshape(-1, 64).T @ np.asarray(g, np.float64).reshape(-1, 48)
    assert relative_error(dx, exact_dx) < E5M2_EPS and relative_error(dw, exact_dw) < E5M2_EPS
    # The history's cotangent is the observed amaxes in column 0, not a gradient.
    np.testing.assert_allclose(observed[:, 0], [jnp.abs(x).max(), jnp.abs(w).max(),
                                                jnp.abs(g).max()], rtol=1e-6)
    assert not np.any(observed[:, 1:])


def test_delayed_scale_comes_from_the_history_and_saturates_instead_of_overflowing():
    x, w, _ = operands()
    history = fp8.new_history().at[:, 0].set(1.0)      # amax 1 seen: scale 256 for e4m3
    big = x * 1e4                                       # far beyond what the history expects
    y, backward = jax.vjp(fp8.matmul, big, w, history)
    dx, dw, observed = backward(jnp.full(y.shape, 1e6, jnp.float32))
    for tensor in (y, dx, dw):
        assert np.all(np.isfinite(tensor))
    # Saturated at 448 / 256 per input: the product is bounded by it, not by the true values.
    limit = 448.0 / 256
    bound = limit * np.abs(reference_qdq(w, ml_dtypes.float8_e4m3fn)).sum(axis=0).max()
    assert np.abs(y).max() <= bound * (1 + 1e-6) < np.abs(np.asarray(big) @ np.asarray(w)).max()
    assert observed[0, 0] == pytest.approx(float(jnp.abs(big).max()), rel=1e-6)
    # The recorded amax scales the next step: no saturation then.
    history = fp8.record(history, observed)
    np.testing.assert_allclose(history[:, 1], 1.0)
    y2 = fp8.matmul(big, w, history)
    assert relative_error(y2, np.asarray(big, np.float64) @ np.asarray(w, np.float64)) < E4M3_EPS


def fp8_step(cfg):
    """The train step of ``cfg`` as the loop builds it (``loop.train_step_of``), its initial
    state and the model's graph."""
    optimizer = optax.adamw(1e-3)
    model = build_model(cfg)
    graphdef, params = nnx.split(model)
    state = init_state(params, optimizer, 0, trainable=nn.trainable(params))
    return state, jax.jit(train_step_of(cfg, model, optimizer)), graphdef


def wq_of(graphdef, params, scan):
    """The Fp8 wrapper of the first block's query projection (of every block, stacked, when
    scanned)."""
    blocks = nnx.merge(graphdef, params).blocks.layers
    return (blocks if scan else blocks[0]).attn.wq


@pytest.mark.parametrize("scan", [False, True])
def test_the_step_records_amaxes_and_never_trains_the_histories(scan):
    cfg = small({"precision.policy": "fp8", "remat.scan_layers": scan,
                 "optimizer.accumulate": 2}, d_model=32, n_layers=2)
    state, step, graphdef = fp8_step(cfg)
    model = nnx.merge(graphdef, state.params)
    wrapped = surgery.wrappers(model, fp8.Fp8)
    assert len(wrapped) == 7 * (1 if scan else 2)            # every linear layer of the blocks
    assert all(path[0] == "blocks" for path, _ in wrapped)   # the embedding and head stay out
    assert not [p for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
                if "history" in jax.tree_util.keystr(p)]
    wq = wq_of(graphdef, state.params, scan)
    assert isinstance(wq, fp8.Fp8) and isinstance(wq.history, nn.Observation)
    weight_amax = float(jnp.abs(wq.kernel[...].astype(jnp.bfloat16)).max())
    state1, metrics = step(state, batch(rows=4))
    assert "observed_max" not in metrics and np.isfinite(metrics["loss"])
    history = np.asarray(wq_of(graphdef, state1.params, scan).history[...], np.float32)
    newest = history[..., 0]                                 # [(L,) 3]
    assert np.all(newest > 0) and not np.any(history[..., 1:])
    # The weight's amax is that of the kernel the step multiplied (in bfloat16), per layer.
    assert np.max(newest[..., fp8.WEIGHT]) == pytest.approx(weight_amax, rel=1e-2)
    state2, _ = step(state1, batch(rows=4, seed=1))
    np.testing.assert_array_equal(
        np.asarray(wq_of(graphdef, state2.params, scan).history[...])[..., 1], newest)


def test_fp8_training_follows_bf16_and_the_histories_resume_bitwise(corpus_path, tmp_path):
    def cfg(name, policy, resume=False):
        """A 6-step run of one block 32 wide, checkpointed only where it ends or is stopped;
        one final evaluation batch, no plot."""
        return build(values={
            "gpt.d_model": 32, "gpt.n_layers": 1, "gpt.n_heads": 4, "model.max_seq_len": 32,
            "data.path": corpus_path, "data.seq_len": 32, "data.batch_size": 4,
            "run.steps": 6, "optimizer.warmup_steps": 2, "run.eval_every": 0,
            "run.final_eval_batches": 1, "run.log_every": 2, "run.checkpoint_every": 0,
            "run.progress": False, "run.loss_plot": False, "precision.policy": policy,
            "run.resume": resume, "run.run_dir": str(tmp_path / name),
            "data.cache_dir": str(tmp_path / "cache")})

    # FP8 follows from the policy alone (the old model.fp8 field is read and dropped).
    assert build(values={"precision.policy": "fp8"}).policy().fp8
    assert not build(values={"precision.policy": "bf16", "model.fp8": True}).policy().fp8
    fp8_model = techniques.abstract(build(values={"precision.policy": "fp8"}))
    assert surgery.wrappers(fp8_model, fp8.Fp8)
    assert not surgery.wrappers(techniques.abstract(build(values={"precision.policy": "bf16"})),
                                fp8.Fp8)
    bf16 = train(cfg("bf16", "bf16"))
    whole = train(cfg("whole", "fp8"))
    assert abs(whole.train_bpb - bf16.train_bpb) < 0.02 * bf16.train_bpb
    cut = train(cfg("cut", "fp8"), should_stop=lambda step: step == 3)
    resumed = train(cfg("cut", "fp8", resume=True))
    assert cut.steps == 3 and resumed.steps == 6
    state = final_state(whole.run_dir, 6)
    history = flat(state["params"])["blocks/layers/0/mlp/w_in/history"]
    assert np.any(np.asarray(history)[:, 5] > 0)
    chex.assert_trees_all_equal(state, final_state(resumed.run_dir, 6))


def test_the_device_check_refuses_gpus_without_fp8_tensor_cores():
    assert "emulated" in fp8.check_device(jax.devices()[0])
    ampere = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB",
                                   compute_capability="8.0")
    with pytest.raises(ConfigError, match="no FP8 tensor cores"):
        fp8.check_device(ampere)
    hopper = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                                   compute_capability="9.0")
    assert "FP8 tensor cores" in fp8.check_device(hopper)


def test_every_product_takes_float8_operands_so_xla_cannot_fold_them_to_bf16():
    """The forward and both backward products contract the float8 values themselves (e4m3 by
    e4m3, e5m2 by e4m3): on an H200 XLA had folded the earlier quantise-dequantise form back to
    a bfloat16 GEMM."""
    x, w, g = operands()
    history = fp8.new_history()

    def loss(x, w):
        return jnp.sum(fp8.matmul(x.astype(jnp.bfloat16), w, history).astype(jnp.float32) * g)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
    dots = [sorted(str(v.aval.dtype) for v in eqn.invars)
            for eqn, _ in trace.equations(jaxpr) if eqn.primitive.name == "dot_general"]
    assert sorted(dots) == [["float8_e4m3fn"] * 2, ["float8_e4m3fn", "float8_e5m2"],
                            ["float8_e4m3fn", "float8_e5m2"]]
