"""Pipeline parallelism on 8 simulated CPU devices: every schedule and its compositions with data,
FSDP and tensor parallelism against one device, precision and remat inside the stages, and the
memory targets. A pipelined run resumed on one device: test_strategies.py
(test_training_loop_resumes_on_another_mesh)."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxaccel.techniques import registry as techniques
from jaxaccel.step.compiled import CompiledFn, abstract, memory_bytes
from jaxaccel.data.loader import place_batch
from jaxaccel.model.contract import make_apply
from jaxaccel.step.optim import make_optimizer
from jaxaccel.techniques.pipeline import pipeline_grad_fn
from jaxaccel.step.precision import DynamicLossScale
from jaxaccel.core.sharding import batch_sharding, bytes_per_device, make_mesh, replicated
from jaxaccel.step.state import abstract_sharded_state, state_maker
from jaxaccel.step.train import lm_train_step, make_train_step

from .test_strategies import OPTIMIZER, batch, config

PP = {"remat.scan_layers": True}          # the stack scanned: its layers split over the stages

# The strategies' optimizer without clipping: AdamW's first moment after one step is then
# (1 - b1) times the first batch's gradient, so a run's own state shows that gradient leaf by
# leaf. Clipping would scale both runs' gradients to the same norm and hide a gradient off by a
# constant factor, which Adam's normalized updates, and so the losses, do not show either.
UNCLIPPED = make_optimizer("adamw", learning_rate=1e-2, weight_decay=0.1, warmup_steps=0,
                           total_steps=10, clip_norm=None)

# Both schedules train one model, compared to one device and to each other's memory: 16 rows in
# 8 microbatches of 2 (one row per device of a data or FSDP axis of 2).
ROWS, MICROBATCHES = 16, 8


def pp_config(values=None, /, **changes):
    """The strategies' model with 4 scanned layers; ``values`` by path, ``changes`` to gpt."""
    return config({**PP, **(values or {})}, **{"n_layers": 4, **changes})


def schedules_config():
    """The model both schedules train: d_model 128 (the memory targets' size), with dropout,
    whose keys must follow each microbatch and layer exactly as on one device."""
    return pp_config(d_model=128, n_heads=4, n_kv_heads=4, dropout=0.1)


def first_moment(opt_state):
    """Adam's first moment (``mu``, a tree like the trainable parameters) in ``opt_state``, on
    the host."""
    (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))
               if hasattr(s, "mu")]
    return jax.device_get(adam.mu)


def initial_state(mesh, cfg, optimizer, loss_scale=None):
    """The step-0 state of ``cfg`` in its shardings over ``mesh``, and those shardings: made by
    ``init_sharded_state``'s own function (``state.state_maker``) run op by op on the host and
    put in place, rather than compiled for each mesh (that compile was a third of a run here;
    the compiled initialisation on pipeline meshes is tested in test_any_model.py and
    test_strategies.py). The one-device reference starts from the same values."""
    with jax.set_mesh(mesh):
        make_state, _, shardings = state_maker(techniques.variables(cfg), optimizer, 0,
                                               loss_scale, mesh, cfg.policy(), None)
    host = jax.device_get(make_state(jax.random.PRNGKey(0)))
    return jax.device_put(host, shardings), shardings


def pipelined_run(mesh, cfg, microbatches, schedule, steps=5, loss_scale=None,
                  optimizer=OPTIMIZER, rows=8):
    """The losses of ``steps`` pipelined steps on ``mesh`` (under ``cfg``'s precision policy),
    the final state, the step and Adam's first moment after the first step."""
    policy = cfg.policy()
    state, shardings = initial_state(mesh, cfg, optimizer, loss_scale)
    with jax.set_mesh(mesh):
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
            state, metrics = step(state, place_batch(batch(i, B=rows), layout))
            losses.append(float(metrics["loss"]))
            first = first_moment(state.opt_state) if i == 0 else first
    return np.array(losses), state, step, first


def one_device(cfg, microbatches=4, steps=5, optimizer=OPTIMIZER, rows=8):
    """The losses of the plain step (``accumulate`` microbatches) on one device, and Adam's
    first moment after its first step."""
    graphdef = nnx.graphdef(techniques.abstract(cfg))
    step = jax.jit(lm_train_step(make_apply(graphdef), optimizer, accumulate=microbatches,
                                 trainable=nnx.Param))
    state, _ = initial_state(make_mesh({"data": 1}, devices=jax.devices()[:1]), cfg, optimizer)
    losses, first = [], None
    for i in range(steps):
        state, metrics = step(state, batch(i, B=rows))
        losses.append(float(metrics["loss"]))
        first = first_moment(state.opt_state) if i == 0 else first
    return np.array(losses), first


@pytest.fixture(scope="module")
def reference():
    """The one-device losses and first moment of ``schedules_config``, for both schedules."""
    return one_device(schedules_config(), MICROBATCHES, optimizer=UNCLIPPED, rows=ROWS)


def assert_trains_like_one_device(run, reference, stages):
    """The losses of 5 steps, and the first batch's pipelined gradient leaf by leaf against
    accumulation's on one device. The gradient is read from the runs themselves (AdamW's first
    moment after the first step, with no clipping: ``UNCLIPPED``) rather than from a separate
    jit of each gradient function, which compiled the pipeline a second time: the same
    ``pipeline_grad_fn`` on the same parameters and batch, under the train step's own key."""
    losses, state, _, moment = run
    reference_losses, reference_moment = reference
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    wq = state.params["blocks"]["layers"]["attn"]["wq"]["kernel"][...]
    assert wq.sharding.shard_shape(wq.shape)[0] == 4 // stages
    assert jax.tree.structure(moment) == jax.tree.structure(reference_moment)
    assert any(np.abs(leaf).max() > 0 for leaf in jax.tree.leaves(moment))
    # 0.1 (1 - b1) times the gradients: atol 1e-8 is the gradients' 1e-7
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8),
                 moment, reference_moment)


# Both schedules, composed with data, FSDP and tensor parallelism, under Auto and Explicit axes;
# with dropout, whose keys must follow each microbatch and layer exactly as on one device.
def test_gpipe_with_data_parallelism_trains_like_one_device(reference):
    """GPipe on 4 stages and data parallelism of 2, under Auto axes."""
    run = pipelined_run(make_mesh({"stage": 4, "data": 2}, "auto"), schedules_config(),
                        MICROBATCHES, "gpipe", optimizer=UNCLIPPED, rows=ROWS)
    assert_trains_like_one_device(run, reference, stages=4)


def test_1f1b_with_fsdp_and_tensor_parallelism_trains_like_one_device(reference):
    """1F1B on 2 stages, FSDP 2 and tensor parallelism 2, under Explicit axes."""
    mesh = make_mesh({"stage": 2, "fsdp": 2, "tensor": 2}, "explicit")
    run = pipelined_run(mesh, schedules_config(), MICROBATCHES, "1f1b", optimizer=UNCLIPPED,
                        rows=ROWS)
    assert_trains_like_one_device(run, reference, stages=2)


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
    needs no more temporary memory than GPipe's. Compiled for the state's shapes and shardings,
    not run: the model, mesh and batch of test_gpipe_with_data_parallelism_trains_like_one_device
    (so its GPipe step is the same program, the run-wide compilation cache's)."""
    cfg, mesh = schedules_config(), make_mesh({"stage": 4, "data": 2}, "auto")
    with jax.set_mesh(mesh):
        shapes, shardings = abstract_sharded_state(techniques.variables(cfg), UNCLIPPED, 0, None,
                                                   mesh)
        state = jax.tree.map(lambda sharding, leaves: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), leaves),
            shardings, shapes)
        layout = batch_sharding(mesh)
        temps = {}
        for schedule in ("gpipe", "1f1b"):
            step = CompiledFn(make_train_step(pipeline_grad_fn(techniques.abstract(cfg),
                                                               MICROBATCHES, schedule,
                                                               trainable=nnx.Param),
                                              UNCLIPPED, trainable=nnx.Param),
                              in_shardings=(shardings, layout),
                              out_shardings=(shardings, replicated(mesh)), donate_argnums=0)
            step.compile(state, abstract(place_batch(batch(0, B=ROWS), layout)))
            temps[schedule] = memory_bytes(step.last)["temp"]
    whole = sum(math.prod(x.shape) * x.dtype.itemsize
                for x in jax.tree.leaves(state.params["blocks"]))
    blocks = bytes_per_device(state.params["blocks"])
    assert blocks <= whole / 4 * 1.05, (blocks, whole)
    moments = [s.mu["blocks"] for s in jax.tree.leaves(
        state.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]
    assert bytes_per_device(moments) <= whole / 4 * 1.05
    assert temps["1f1b"] <= temps["gpipe"], temps
