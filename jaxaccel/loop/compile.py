"""Phase 2 of a run, compile: the train and eval steps, jitted over the mesh and compiled for
every batch shape before the clock starts; the OOM pre-flight; the memory budget's remat policy."""

import dataclasses

import jax
from flax import nnx

from jaxaccel import hardware, nn, techniques
from jaxaccel.compiled import CompiledFn, abstract, largest_memory_bytes
from jaxaccel.config import override
from jaxaccel.errors import ConfigError
from jaxaccel.loader import abstract_batch
from jaxaccel.loop.console import announce
from jaxaccel.model import eval_graphdef, make_apply
from jaxaccel.pipeline import pipeline_eval_fn, pipeline_grad_fn
from jaxaccel.planner import choose_remat
from jaxaccel.sharding import batch_sharding, pipelined, replicated
from jaxaccel.train import lm_eval_step, lm_train_step, make_train_step


@dataclasses.dataclass
class Steps:
    train: CompiledFn
    eval: CompiledFn
    warm_compiles: int


def observed_filter(model):
    """``nn.Observation`` when the model has such buffers (FP8's histories), else None."""
    leaves = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nn.Observation if any(isinstance(v, nn.Observation) for v in leaves) else None


def train_step_of(cfg, model, optimizer, schedule=None):
    """The pure train step of ``cfg`` for ``model`` (abstract or not): ``train.lm_train_step``,
    or with a pp strategy the pipelined gradient function of ``jaxaccel.pipeline``."""
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
    train_step = CompiledFn(train_step_of(cfg, model, optimizer, schedule),
                            in_shardings=(shardings, layout), out_shardings=(shardings, whole),
                            donate_argnums=0)
    eval_step = CompiledFn(eval_step_of(cfg, model), in_shardings=(shardings, layout),
                           out_shardings=whole)
    return train_step, eval_step


def compile_steps(run) -> Steps:
    announce(run.cfg, f"compiling the train step for {len(run.stream.global_shapes)} batch "
                      f"shape(s) and the eval step")
    train_step, eval_step = sharded_steps(run.cfg, run.model, run.optimizer, run.schedule,
                                          run.shardings, run.mesh)
    abstract_state = abstract(run.state)
    for shape in run.stream.global_shapes:
        train_step.compile(abstract_state, abstract_batch(shape))
    eval_step.compile(abstract_state, abstract_batch((run.eval_batch_size, run.cfg.seq_len)))
    check_memory(run.cfg, [train_step, eval_step], hardware.memory_limit_bytes())
    return Steps(train_step, eval_step, train_step.compiles)


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


def plan_remat(cfg, model, depth, optimizer, state, stream, batch_layout):
    """``(cfg, model, plan)`` with the remat policy the memory budget chooses for this model."""
    def make_step(policy):
        variant = override(cfg, {"remat.policy": policy})
        return train_step_of(variant, techniques.abstract(variant, depth=depth), optimizer)

    policy, plan = choose_remat(make_step, abstract(state), stream.global_shapes,
                                memory_budget_bytes(cfg.run.memory_budget), batch_layout)
    cfg = override(cfg, {"remat.policy": policy})
    return cfg, techniques.abstract(cfg, depth=depth), plan


def check_memory(cfg, compiled_fns, limit: int | None):
    """The OOM pre-flight: ConfigError, before the first step, when a compiled step needs more
    bytes per device than the device has (``limit``; None, as on the CPU, checks nothing)."""
    for name, fn in zip(("train", "eval"), compiled_fns):
        need = largest_memory_bytes(fn)
        if limit is None or need is None or need["total"] <= limit:
            continue
        fixes = ("--memory-budget auto (the remat policy that fits)" if cfg.run.memory_budget
                 is None else "a lower --memory-budget")
        raise ConfigError(
            f"the {name} step needs {need['total']:,} bytes per device ({need['temp']:,} of "
            f"temporaries) but this device has {limit:,}; try {fixes}, --remat full, a smaller "
            f"--batch-size" + (" or --eval-batch-size" if name == "eval" else "")
            + ", or more devices with --sharding fsdp",
            field="run.eval_batch_size" if name == "eval" else "data.batch_size")
