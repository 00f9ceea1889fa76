"""Phase 2 of a run, compile: the train and eval steps, jitted over the mesh and compiled for
every batch shape before the clock starts; the OOM pre-flight; the memory budget's remat policy."""

import dataclasses
import math

import jax
from flax import nnx

from jaxaccel.core import hardware
from jaxaccel.model import nn
from jaxaccel.step import precision, trace
from jaxaccel.techniques import registry as techniques
from jaxaccel.step.compiled import CompiledFn, StateStep, abstract, largest_memory_bytes
from jaxaccel.run.config import override
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import abstract_batch, abstract_key
from jaxaccel.run.loop.console import announce
from jaxaccel.model.contract import eval_graphdef, is_preset, make_apply
from jaxaccel.techniques.pipeline import pipeline_eval_fn, pipeline_grad_fn
from jaxaccel.core.sharding import batch_sharding, bytes_per_device, pipelined, replicated
from jaxaccel.step.train import lm_eval_step, lm_train_step, make_train_step


@dataclasses.dataclass
class Steps:
    train: StateStep
    eval: CompiledFn
    warm_compiles: int


def observed_filter(model):
    """``nn.Observation`` when the model has such buffers (FP8's histories), else None."""
    leaves = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nn.Observation if any(isinstance(v, nn.Observation) for v in leaves) else None


def train_step_of(cfg, model, optimizer, schedule=None):
    """The pure train step of ``cfg`` for ``model`` (abstract or not): ``train.lm_train_step``,
    or with a pp strategy the pipelined gradient function of ``jaxaccel.techniques.pipeline``."""
    graphdef, state = nnx.split(model)
    trainable = nn.trainable(state)
    if pipelined(cfg.mesh.strategy):
        grad_fn = pipeline_grad_fn(model, cfg.optimizer.accumulate, cfg.mesh.pipeline_schedule,
                                   policy=cfg.policy(), trainable=trainable)
        return make_train_step(grad_fn, optimizer, schedule, trainable=trainable)
    # rows of one document (every batching but pack) need no segment mask: causal suffices
    return lm_train_step(make_apply(graphdef, segment_attention=cfg.data.batching == "pack"),
                         optimizer, schedule, policy=cfg.policy(),
                         accumulate=cfg.optimizer.accumulate, trainable=trainable,
                         observed=observed_filter(model), update_buffers=nn.updater(model),
                         stats=nn.loss_stats(model), sampling=cfg.data.sampling)


def eval_step_of(cfg, model):
    """The pure evaluation step (fixed rows: no segment mask) of ``cfg`` for ``model``."""
    graphdef, state = nnx.split(model)
    graphdef = eval_graphdef(graphdef, state)
    if pipelined(cfg.mesh.strategy):
        return pipeline_eval_fn(nnx.merge(graphdef, state), eval_microbatches(cfg),
                                policy=cfg.policy())
    return lm_eval_step(make_apply(graphdef, segment_attention=False), cfg.policy())


def eval_microbatches(cfg) -> int:
    """Microbatches of an evaluation batch: ``accumulate`` with a pp strategy, else 1."""
    return cfg.optimizer.accumulate if pipelined(cfg.mesh.strategy) else 1


def sharded_steps(cfg, model, optimizer, schedule, shardings, mesh):
    """The train and eval steps as ``CompiledFn``s jitted over ``mesh``: the state in
    ``shardings`` (donated to the train step), the batch over data x fsdp, metrics replicated."""
    layout, whole = batch_sharding(mesh), replicated(mesh)
    train_step = StateStep(train_step_of(cfg, model, optimizer, schedule),
                           in_shardings=(shardings, layout), out_shardings=(shardings, whole),
                           donate=True)
    eval_step = CompiledFn(eval_step_of(cfg, model), in_shardings=(shardings, layout),
                           out_shardings=whole, keyed_by=(1,))
    return train_step, eval_step


def compile_steps(run) -> Steps:
    """The steps of this stage: those ``set_up`` compiled before it made the state (taken once),
    else compiled now for the state's shapes and checked against the memory left beside it."""
    steps, run.precompiled = run.precompiled, None
    if steps is not None:
        return steps
    resident = bytes_per_device(run.state) if hardware.memory_limit_bytes() is None else 0
    return compiled_steps(run.cfg, run.model, run.optimizer, run.schedule, run.shardings,
                          run.mesh, abstract(run.state), run.stream.global_shapes,
                          run.eval_batch_size, resident)


def compiled_steps(cfg, model, optimizer, schedule, shardings, mesh, abstract_state, shapes,
                   eval_batch_size: int, resident: int = 0) -> Steps:
    """The train step compiled for every batch shape and the eval step for its batch, from the
    state's shapes alone (nothing allocated), then the OOM pre-flight (``check_memory``) against
    the device's memory; on the CPU the host's, plus ``resident`` bytes of the state already in
    it (the step's arguments count them)."""
    announce(cfg, f"compiling the train step for {len(shapes)} batch shape(s) and the eval step")
    train_step, eval_step = sharded_steps(cfg, model, optimizer, schedule, shardings, mesh)
    for shape in shapes:
        train_step.compile(abstract_state, abstract_batch(shape))
    eval_step.compile(abstract_state, abstract_batch((eval_batch_size, cfg.seq_len)))
    check_memory(cfg, [train_step, eval_step], hardware.device_memory_bytes() + resident)
    return Steps(train_step, eval_step, train_step.compiles)


def scores_bytes(cfg, model, rows: int) -> tuple[int, tuple, str]:
    """(bytes, shape, dtype) of the largest matmul output of ``model``'s forward on ``rows`` x
    ``seq_len`` that is quadratic in the length (attention scores, T x T), traced abstractly:
    nothing is compiled or computed. XLA keeps a matmul's output, so no step on that batch
    needs less; (0, (), "") where there is none (flash attention keeps no T x T scores)."""
    graphdef, state = nnx.split(model)
    apply = precision.cast(make_apply(graphdef, segment_attention=cfg.data.batching == "pack"),
                           cfg.policy())
    jaxpr = jax.make_jaxpr(apply)(state, dict(abstract_batch((rows, cfg.seq_len))),
                                  abstract_key())
    found = [(math.prod(v.aval.shape) * v.aval.dtype.itemsize, v.aval.shape, str(v.aval.dtype))
             for eqn, _ in trace.equations(jaxpr) if eqn.primitive.name == "dot_general"
             for v in eqn.outvars if cfg.seq_len > 1 and v.aval.shape.count(cfg.seq_len) >= 2]
    return max(found, default=(0, (), ""))


def check_scores(cfg, model, eval_rows: int):
    """Before any work, and before compiling (XLA's compiler aborts, no error, on buffers past
    its 64-bit sizes): ConfigError when the attention scores of one training microbatch or
    validation batch (``scores_bytes``) alone are larger than all the devices' memory."""
    have = hardware.device_memory_bytes() * jax.device_count()
    owner = (hardware.memory_owner() if jax.device_count() == 1
             or hardware.memory_limit_bytes() is None else
             f"the memory of all {jax.device_count()} devices")
    rows = max(1, cfg.batch_rows() // cfg.optimizer.accumulate)
    checks = [("training", rows)]
    if -(-eval_rows // eval_microbatches(cfg)) > rows:
        checks.append(("validation", -(-eval_rows // eval_microbatches(cfg))))
    length = "data.seq_len" if cfg.data.seq_len is not None else "model.max_seq_len"
    for name, rows in checks:
        need, shape, dtype = scores_bytes(cfg, model, rows)
        if need > have:
            raise ConfigError(
                f"at seq_len {cfg.seq_len:,} the attention scores of one {name} batch of "
                f"{rows:,} rows ({dtype} {list(shape)}) alone take {need:,} bytes, more than "
                f"{owner} ({have:,}); lower --seq-len (or --max-seq-len, "
                f"its default)" + (", --eval-batch-size" if name == "validation" else
                                   ", --batch-size (or raise --accumulate)" if rows > 1 else "")
                + (" or a flash attention (--attention cudnn or pallas: no T x T scores)"
                   if is_preset(cfg.model.name) else ""), field=length)


def memory_budget_bytes(budget: int | str) -> int:
    """``run.memory_budget`` in bytes: ``auto`` is this device's memory (``bytes_limit``)."""
    if budget != "auto":
        return budget
    limit = hardware.memory_limit_bytes()
    if limit is None:
        raise ConfigError(f"memory_budget auto needs a device that reports its memory (GPUs, "
                          f"TPUs; not the {jax.default_backend()}); pass a number of bytes",
                          field="run.memory_budget")
    return limit


def plan_memory(cfg, model, depth, optimizer, state, stream, batch_layout):
    """``(cfg, model, plan)`` with the settings the memory budget chooses for this model
    (``techniques.plan_for_budget``: the remat policy)."""
    def make_step(settings):
        variant = override(cfg, settings)
        return train_step_of(variant, techniques.abstract(variant, depth=depth), optimizer)

    settings, plan = techniques.plan_for_budget(make_step, abstract(state), stream.global_shapes,
                                                memory_budget_bytes(cfg.run.memory_budget),
                                                batch_layout)
    cfg = override(cfg, settings)
    return cfg, techniques.abstract(cfg, depth=depth), plan


def check_memory(cfg, compiled_fns, limit: int | None):
    """The OOM pre-flight: ConfigError, before the first step, when a compiled step needs more
    bytes per device than the device has (``limit``; None checks nothing)."""
    for name, fn in zip(("train", "eval"), compiled_fns):
        need = largest_memory_bytes(fn)
        if limit is None or need is None or need["total"] <= limit:
            continue
        on_device = hardware.memory_limit_bytes() is not None
        if name == "eval":
            fixes = "a smaller --eval-batch-size (or --seq-len)"
        else:
            budget = ("a lower --memory-budget" if cfg.run.memory_budget is not None else
                      "--memory-budget auto (the remat policy that fits)" if on_device else
                      f"--memory-budget {limit} (the remat policy that fits)")
            fixes = ", ".join([budget, "--remat full", "a smaller --batch-size (or --seq-len)",
                                        "or more devices with --sharding fsdp"])
        raise ConfigError(
            f"the {name} step needs {need['total']:,} bytes per device ({need['temp']:,} of "
            f"temporaries) but {'this device has' if on_device else 'this host has'} "
            f"{limit:,}{'' if on_device else ' available'}; try {fixes}",
            field="run.eval_batch_size" if name == "eval" else "data.batch_size")
