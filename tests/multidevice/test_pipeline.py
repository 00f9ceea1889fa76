"""Pipeline parallelism on 8 simulated CPU devices: every schedule and its compositions with data,
FSDP and tensor parallelism against one device, precision and remat inside the stages, and the
memory targets. A pipelined run resumed on one device: test_strategies.py
(test_training_loop_resumes_on_another_mesh)."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxaccel import grads, techniques
from jaxaccel.compiled import CompiledFn, abstract, memory_bytes
from jaxaccel.loader import abstract_batch, place_batch
from jaxaccel.model import make_apply
from jaxaccel.pipeline import pipeline_grad_fn
from jaxaccel.precision import DynamicLossScale
from jaxaccel.sharding import (batch_sharding, bytes_per_device, make_mesh, param_shardings,
                               replicated)
from jaxaccel.state import init_sharded_state, init_state
from jaxaccel.train import lm_loss, lm_train_step, make_train_step

from .test_strategies import OPTIMIZER, batch, config

PP = {"remat.scan_layers": True}          # the stack scanned: its layers split over the stages


def pp_config(values=None, /, **changes):
    """The strategies' model with 4 scanned layers; ``values`` by path, ``changes`` to gpt."""
    return config({**PP, **(values or {})}, **{"n_layers": 4, **changes})


def pipelined_run(mesh, cfg, microbatches, schedule, steps=5, loss_scale=None,
                  optimizer=OPTIMIZER):
    """The losses of ``steps`` pipelined steps on ``mesh`` (under ``cfg``'s precision policy),
    the final state and the step."""
    policy = cfg.policy()
    with jax.set_mesh(mesh):
        state, shardings = init_sharded_state(techniques.variables(cfg), optimizer, 0,
                                              loss_scale, mesh, policy)
        layout = batch_sharding(mesh)
        model = techniques.abstract(cfg)
        step = CompiledFn(
            make_train_step(pipeline_grad_fn(model, microbatches, schedule, policy=policy,
                                             trainable=nnx.Param),
                            optimizer, trainable=nnx.Param),
            in_shardings=(shardings, layout), out_shardings=(shardings, replicated(mesh)),
            donate_argnums=0)
        losses = []
        for i in range(steps):
            state, metrics = step(state, place_batch(batch(i), layout))
            losses.append(float(metrics["loss"]))
    return np.array(losses), state, step


def one_device(cfg, microbatches=4, steps=5):
    """The losses of the plain step (``accumulate`` microbatches) on one device, and its
    gradient on the first batch."""
    graphdef, params = nnx.split(techniques.build(cfg, jax.random.PRNGKey(0)))
    step = jax.jit(lm_train_step(make_apply(graphdef), OPTIMIZER, accumulate=microbatches,
                                 trainable=nnx.Param))
    state = init_state(params, OPTIMIZER, 0, trainable=nnx.Param)
    losses = []
    for i in range(steps):
        state, metrics = step(state, batch(i))
        losses.append(float(metrics["loss"]))
    reference = grads.accumulate(grads.value_and_grad(lm_loss(make_apply(graphdef)),
                                                      trainable=nnx.Param),
                                 microbatches, weight="real_tokens")
    return np.array(losses), jax.jit(reference)(params, batch(0), jax.random.PRNGKey(1))[1]


# Both schedules, composed with data, FSDP and tensor parallelism, under Auto and Explicit axes;
# with dropout, whose keys must follow each microbatch and layer exactly as on one device.
@pytest.mark.parametrize("schedule, shape, dropout, axis_types", [
    ("gpipe", {"stage": 4, "data": 2}, 0.0, "auto"),
    ("1f1b", {"stage": 2, "fsdp": 2, "tensor": 2}, 0.1, "explicit"),
])
def test_every_schedule_trains_like_one_device(schedule, shape, dropout, axis_types):
    cfg = pp_config(dropout=dropout)
    reference_losses, reference_grads = one_device(cfg)
    mesh = make_mesh(shape, axis_types)
    losses, state, _ = pipelined_run(mesh, cfg, 4, schedule)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    wq = state.params["blocks"]["layers"]["attn"]["wq"]["kernel"][...]
    assert wq.sharding.shard_shape(wq.shape)[0] == 4 // shape["stage"]
    model = techniques.build(cfg, jax.random.PRNGKey(0))
    with jax.set_mesh(mesh):
        params = jax.device_put(nnx.state(model), param_shardings(mesh, state.params))
        _, g = jax.jit(pipeline_grad_fn(model, 4, schedule, trainable=nnx.Param))(
            params, place_batch(batch(0), batch_sharding(mesh)), jax.random.PRNGKey(1))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                 jax.device_get(g), jax.device_get(reference_grads))


def test_bf16_loss_scaling_and_remat_inside_the_stages():
    cfg = pp_config({"remat.policy": "full", "precision.policy": "bf16"})
    scale = DynamicLossScale.create(2.0 ** 10, growth_interval=2)
    mesh = make_mesh({"stage": 1}, devices=jax.devices()[:1])
    reference, _, _ = pipelined_run(mesh, cfg, 4, "gpipe", steps=3, loss_scale=scale)
    losses, state, _ = pipelined_run(make_mesh({"stage": 4, "data": 2}), cfg, 4, "1f1b",
                                     steps=3, loss_scale=scale)
    np.testing.assert_allclose(losses, reference, rtol=1e-3)
    assert float(state.loss_scale.loss_scale) == 2.0 ** 11       # grew after 2 finite steps


def test_four_stages_hold_a_quarter_of_the_blocks_and_1f1b_less_than_gpipe():
    """With 4 stages a device stores a quarter of the blocks' weights and their optimizer state
    (the embedding and head stay whole on every stage); at 8 microbatches 1F1B's compiled step
    needs no more temporary memory than GPipe's."""
    cfg = pp_config(d_model=128, n_heads=4, n_kv_heads=4)
    model = techniques.abstract(cfg)
    temps = {}
    for schedule in ("gpipe", "1f1b"):
        mesh = make_mesh({"stage": 4, "data": 2})
        with jax.set_mesh(mesh):
            state, shardings = init_sharded_state(techniques.variables(cfg), OPTIMIZER, 0, None,
                                                  mesh)
            step = CompiledFn(make_train_step(pipeline_grad_fn(model, 8, schedule,
                                                               trainable=nnx.Param),
                                              OPTIMIZER, trainable=nnx.Param),
                              in_shardings=(shardings, batch_sharding(mesh)),
                              out_shardings=(shardings, replicated(mesh)))
            step.compile(abstract(state), abstract_batch((16, 32)))
        temps[schedule] = memory_bytes(step.last)["temp"]
    whole = sum(x.nbytes for x in jax.tree.leaves(state.params["blocks"]))
    blocks = bytes_per_device(state.params["blocks"])
    assert blocks <= whole / 4 * 1.05, (blocks, whole)
    moments = [s.mu["blocks"] for s in jax.tree.leaves(
        state.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]
    assert bytes_per_device(moments) <= whole / 4 * 1.05
    assert temps["1f1b"] <= temps["gpipe"], temps
