"""Pipeline parallelism on 8 simulated CPU devices: every schedule and its compositions with data,
FSDP and tensor parallelism against one device, precision and remat inside the stages, and the
memory targets. A pipelined run resumed on one device: test_strategies.py
(test_training_loop_resumes_on_another_mesh)."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxaccel import techniques
from jaxaccel.compiled import CompiledFn, abstract, memory_bytes
from jaxaccel.loader import abstract_batch, place_batch
from jaxaccel.model import make_apply
from jaxaccel.optim import make_optimizer
from jaxaccel.pipeline import pipeline_grad_fn
from jaxaccel.precision import DynamicLossScale
from jaxaccel.sharding import batch_sharding, bytes_per_device, make_mesh, replicated
from jaxaccel.state import init_sharded_state, init_state
from jaxaccel.train import lm_train_step, make_train_step

from .test_strategies import OPTIMIZER, batch, config

PP = {"remat.scan_layers": True}          # the stack scanned: its layers split over the stages

# The strategies' optimizer without clipping: AdamW's first moment after one step is then
# (1 - b1) times the first batch's gradient, so a run's own state shows that gradient leaf by
# leaf. Clipping would scale both runs' gradients to the same norm and hide a gradient off by a
# constant factor, which Adam's normalized updates, and so the losses, do not show either.
UNCLIPPED = make_optimizer("adamw", learning_rate=1e-2, weight_decay=0.1, warmup_steps=0,
                           total_steps=10, clip_norm=None)


def pp_config(values=None, /, **changes):
    """The strategies' model with 4 scanned layers; ``values`` by path, ``changes`` to gpt."""
    return config({**PP, **(values or {})}, **{"n_layers": 4, **changes})


def first_moment(opt_state):
    """Adam's first moment (``mu``, a tree like the trainable parameters) in ``opt_state``, on
    the host."""
    (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))
               if hasattr(s, "mu")]
    return jax.device_get(adam.mu)


def pipelined_run(mesh, cfg, microbatches, schedule, steps=5, loss_scale=None,
                  optimizer=OPTIMIZER):
    """The losses of ``steps`` pipelined steps on ``mesh`` (under ``cfg``'s precision policy),
    the final state, the step and Adam's first moment after the first step."""
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
        losses, first = [], None
        for i in range(steps):
            state, metrics = step(state, place_batch(batch(i), layout))
            losses.append(float(metrics["loss"]))
            first = first_moment(state.opt_state) if i == 0 else first
    return np.array(losses), state, step, first


def one_device(cfg, microbatches=4, steps=5, optimizer=OPTIMIZER):
    """The losses of the plain step (``accumulate`` microbatches) on one device, and Adam's
    first moment after its first step."""
    graphdef, params = nnx.split(techniques.build(cfg, jax.random.PRNGKey(0)))
    step = jax.jit(lm_train_step(make_apply(graphdef), optimizer, accumulate=microbatches,
                                 trainable=nnx.Param))
    state = init_state(params, optimizer, 0, trainable=nnx.Param)
    losses, first = [], None
    for i in range(steps):
        state, metrics = step(state, batch(i))
        losses.append(float(metrics["loss"]))
        first = first_moment(state.opt_state) if i == 0 else first
    return np.array(losses), first


# Both schedules, composed with data, FSDP and tensor parallelism, under Auto and Explicit axes;
# with dropout, whose keys must follow each microbatch and layer exactly as on one device.
@pytest.mark.parametrize("schedule, shape, dropout, axis_types", [
    ("gpipe", {"stage": 4, "data": 2}, 0.0, "auto"),
    ("1f1b", {"stage": 2, "fsdp": 2, "tensor": 2}, 0.1, "explicit"),
])
def test_every_schedule_trains_like_one_device(schedule, shape, dropout, axis_types):
    """The losses of 5 steps, and the first batch's pipelined gradient leaf by leaf against
    accumulation's on one device. The gradient is read from the runs themselves (AdamW's first
    moment after the first step, with no clipping: ``UNCLIPPED``) rather than from a separate
    jit of each gradient function, which compiled the pipeline a second time: the same
    ``pipeline_grad_fn`` on the same parameters and batch, under the train step's own key."""
    cfg = pp_config(dropout=dropout)
    reference_losses, reference_moment = one_device(cfg, optimizer=UNCLIPPED)
    mesh = make_mesh(shape, axis_types)
    losses, state, _, moment = pipelined_run(mesh, cfg, 4, schedule, optimizer=UNCLIPPED)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    wq = state.params["blocks"]["layers"]["attn"]["wq"]["kernel"][...]
    assert wq.sharding.shard_shape(wq.shape)[0] == 4 // shape["stage"]
    assert jax.tree.structure(moment) == jax.tree.structure(reference_moment)
    assert any(np.abs(leaf).max() > 0 for leaf in jax.tree.leaves(moment))
    # 0.1 (1 - b1) times the gradients: atol 1e-8 is the gradients' 1e-7
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8),
                 moment, reference_moment)


def test_bf16_loss_scaling_and_remat_inside_the_stages():
    cfg = pp_config({"remat.policy": "full", "precision.policy": "bf16"})
    scale = DynamicLossScale.create(2.0 ** 10, growth_interval=2)
    mesh = make_mesh({"stage": 1}, devices=jax.devices()[:1])
    reference, _, _, _ = pipelined_run(mesh, cfg, 4, "gpipe", steps=3, loss_scale=scale)
    losses, state, _, _ = pipelined_run(make_mesh({"stage": 4, "data": 2}), cfg, 4, "1f1b",
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
    mesh = make_mesh({"stage": 4, "data": 2})
    with jax.set_mesh(mesh):     # one state for both schedules: they lay it out the same way
        state, shardings = init_sharded_state(techniques.variables(cfg), OPTIMIZER, 0, None,
                                              mesh)
    for schedule in ("gpipe", "1f1b"):
        with jax.set_mesh(mesh):
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
