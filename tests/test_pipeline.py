"""Pipeline schedules, the pipelined gradient and evaluation on one device (a single stage), and
the settings a pipeline refuses; the stages over 8 simulated devices (tests/multidevice/
test_pipeline.py) in a subprocess."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import run_multidevice
from jaxaccel.step import grads
from jaxaccel.techniques import registry as techniques
from jaxaccel.run.config import build
from jaxaccel.core.errors import ConfigError
from jaxaccel.model.contract import make_apply
from jaxaccel.techniques.pipeline import (bubble_fraction, check, check_layers, make_schedule,
                                          pipeline_eval_fn, pipeline_grad_fn)
from jaxaccel.core.sharding import mesh_shape, parse_mesh
from jaxaccel.step.train import TrainState, lm_loss, make_eval_step

CFG = {"gpt.d_model": 32, "gpt.n_layers": 2, "gpt.n_heads": 2, "model.max_seq_len": 16,
       "remat.scan_layers": True}


def config(**values):
    """A TrainConfig of the small scanned GPT (64 ids), ``values`` by field path
    (``**{"gpt.dropout": 0.1}``)."""
    cfg = build(values={**CFG, **values})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=64))


def model_of(cfg, seed=0):
    """The model of ``cfg`` and its state."""
    model = techniques.build(cfg, jax.random.PRNGKey(seed))
    return model, nnx.state(model)


def lm_batch(seed, B=8, T=16, vocab=64):
    rng = np.random.default_rng(seed)
    end = rng.integers(4, T + 1, size=B)
    segment_ids = (np.arange(T) < end[:, None]).astype(np.int32)
    return {"inputs": rng.integers(0, vocab, (B, T)).astype(np.int32),
            "targets": rng.integers(0, vocab, (B, T)).astype(np.int32),
            "weights": segment_ids.astype(np.float32), "segment_ids": segment_ids,
            "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)) * segment_ids}


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, microbatches", [(1, 1), (1, 3), (2, 2), (3, 5), (4, 8), (8, 8)])
def test_schedules_run_every_microbatch_once_in_dependency_order(name, stages, microbatches):
    plan = make_schedule(name, stages, microbatches)
    forward_at, backward_at = {}, {}
    for t in range(plan.ticks):
        for s in range(stages):
            if plan.forward[t, s] >= 0:
                forward_at[plan.forward[t, s], s] = t
            if plan.backward[t, s] >= 0:
                backward_at[plan.backward[t, s], s] = t
    every = {(m, s) for m in range(microbatches) for s in range(stages)}
    assert set(forward_at) == every and set(backward_at) == every
    assert (plan.forward >= 0).sum() == (plan.backward >= 0).sum() == len(every)
    for m, s in every:
        if s > 0:     # the input comes from the previous stage's forward, a tick earlier
            assert forward_at[m, s] > forward_at[m, s - 1]
        if s < stages - 1:    # the gradient from the next stage's backward, a tick earlier
            assert backward_at[m, s] > backward_at[m, s + 1]
        assert backward_at[m, s] >= forward_at[m, s]


def test_1f1b_keeps_inputs_bounded_by_the_stages_and_gpipe_one_per_microbatch():
    for microbatches in (4, 8, 32):
        assert make_schedule("gpipe", 4, microbatches).slots == microbatches
        assert make_schedule("1f1b", 4, microbatches).slots == min(microbatches, 5)
    assert make_schedule("1f1b", 2, 16).slots == 1     # the only later stage is the last
    assert make_schedule("1f1b", 8, 64).slots == 13    # 2 (S - 2) + 1


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(8, 8) == pytest.approx(7 / 15)


@pytest.mark.parametrize("schedule, microbatches, values", [
    ("gpipe", 4, {"gpt.dropout": 0.1}),
    ("1f1b", 2, {"gpt.tie_embeddings": True, "remat.policy": "full"}),
])
def test_one_stage_gives_the_loss_and_gradients_of_accumulation(schedule, microbatches, values):
    model, params = model_of(config(**values))
    batch, key = lm_batch(0), jax.random.PRNGKey(3)
    reference = grads.accumulate(
        grads.value_and_grad(lm_loss(make_apply(nnx.graphdef(model))), trainable=nnx.Param),
        microbatches, weight="real_tokens")
    (loss, aux), g = jax.jit(pipeline_grad_fn(model, microbatches, schedule,
                                              trainable=nnx.Param))(
        params, batch, key, scale=8.0)
    (ref_loss, ref_aux), ref_g = jax.jit(reference)(params, batch, key, scale=8.0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert {k: float(v) for k, v in aux.items()} == {k: float(v) for k, v in ref_aux.items()}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), g, ref_g)


def test_pipelined_evaluation_sums_like_the_plain_one():
    model, params = model_of(config())
    state = TrainState(params=params, opt_state=None, step=0, rng=None, loss_scale=None)
    sums = jax.jit(pipeline_eval_fn(model, 4))(state, lm_batch(2))
    expected = make_eval_step(make_apply(nnx.graphdef(model)))(state, lm_batch(2))
    assert sums["weight_sum"] == expected["weight_sum"]
    np.testing.assert_allclose(sums["loss_sum"], expected["loss_sum"], rtol=1e-6)


def test_pp_strategies_fill_the_mesh():
    assert mesh_shape("pp", 8) == {"stage": 8, "data": 1, "fsdp": 1, "tensor": 1}
    assert mesh_shape("fsdp+pp", 8) == {"stage": 4, "data": 1, "fsdp": 2, "tensor": 1}
    assert mesh_shape("dp+pp", 8) == {"stage": 4, "data": 2, "fsdp": 1, "tensor": 1}
    assert mesh_shape("fsdp+tp+pp", 8) == {"stage": 2, "data": 1, "fsdp": 2, "tensor": 2}
    assert mesh_shape("fsdp+pp", 8, parse_mesh("stage=2,fsdp=4")) == {
        "stage": 2, "data": 1, "fsdp": 4, "tensor": 1}


@pytest.mark.parametrize("make_error, message, field", [
    (lambda: check("1f1b", 4, 2), "1f1b needs at least as many microbatches as pipeline stages",
     "optimizer.accumulate"),
    (lambda: check("zigzag", 2, 2), "unknown pipeline schedule 'zigzag'",
     "mesh.pipeline_schedule"),
    (lambda: check_layers(techniques.abstract(config(**{"remat.scan_layers": False})), 4),
     "the stack is not scanned; turn scan_layers on", "remat.scan_layers"),
    (lambda: check_layers(techniques.abstract(config()), 4),
     "the model's 2 layers do not split evenly over 4 pipeline stages", "mesh.shape"),
    (lambda: check_layers(techniques.abstract(config(**{"gpt.n_layers": 6})), 4),
     "the model's 6 layers do not split evenly over 4 pipeline stages", "mesh.shape"),
    (lambda: mesh_shape("pp", 8, parse_mesh("stage=3")), "has 3 devices but 8 are available",
     "mesh.shape"),
    (lambda: mesh_shape("pp", 8, parse_mesh("fsdp=2")), "does not use the fsdp axis",
     "mesh.shape"),
])
def test_a_pipeline_that_cannot_run_is_one_clear_error(make_error, message, field):
    with pytest.raises(ConfigError, match=message) as info:
        make_error()
    assert info.value.field == field and "\n" not in str(info.value)
    # Messages name settings, not flags (the command line adds the flag), but for the one
    # pipeline.check_layers gives an unscanned stack (reported: it says --scan-layers).
    assert "--" not in str(info.value) or field == "remat.scan_layers"


@pytest.mark.parametrize("part", range(4))
def test_eight_device_pipeline_suite(part):
    """Both schedules composed with dp, fsdp and tp against one device, bf16 with loss scaling
    and remat in the stages, and the memory targets, on 8 simulated CPU devices: one test of
    the file per part (a process each; two of them together took 25-30 s of CPU)."""
    run_multidevice("tests/multidevice/test_pipeline.py", part, 4)
