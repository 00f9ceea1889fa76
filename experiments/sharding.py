"""Every sharding strategy on the same model and batches: memory per device, step time, and
the loss against one device.

    python -m experiments.sharding                     # on a CPU: 8 simulated devices, ~4 min
    python -m experiments.sharding --mesh-axis-types explicit --json sharding.json
    python -m experiments.sharding --model small --seq-len 1024 --batch-size 32   # 8 GPUs
    python -m experiments.sharding --model medium --strategies fsdp,fsdp+pp,tp+pp \
        --batch-size 64 --pipeline-microbatches 16      # 8 GPUs, pipelines of 4 stages

Each row trains the same model from the same initial parameters on the same ``--steps`` batches
of the corpus, with one strategy on its default mesh over all devices (``jaxaccel.core.sharding``),
then computes the loss of one validation batch. The first row runs on one device: the others'
loss differences are relative to it. Per device, it reports the bytes of parameters plus
optimizer state (from the arrays' shards), the compiled temporaries of the train step and of
one MLP's forward and backward pass (XLA's memory analysis), and the median step time after the
first step. On a CPU the devices are simulated (``--cpu-devices``) and share its cores: the
step times show the cost of the collectives, not a speedup.

A pipelined strategy (``+pp``) runs once per schedule in ``--pipeline-schedules``, with
``--pipeline-microbatches`` microbatches (``optimizer.accumulate`` of that row) and stacked
layers; its row adds the bubble, (stages - 1) / (microbatches + stages - 1), and the stage
inputs a stage keeps. "blocks of one device's" is the share of the transformer blocks' weights
a device holds: the stages split the blocks, while the embedding and the head stay whole on
every stage (``jaxaccel.techniques.pipeline``).
"""

import contextlib
import dataclasses
import itertools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from experiments.common import (Experiment, Row, RowRun, check_stop, config_of, gpt_shape,
                                main_of, parse_list, relative, stack_depth)
from jaxaccel.model import gpt, contract as model_lib, nn
from jaxaccel.techniques import registry as techniques
from jaxaccel.step.compiled import abstract, memory_bytes
from jaxaccel.run.config import override, setting
from jaxaccel.data.corpus import corpus_of
from jaxaccel.data.batching import batches
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import abstract_batch, place_batch
from jaxaccel.run.loop import sharded_steps
from jaxaccel.model.contract import describe
from jaxaccel.step.optim import build_optimizer
from jaxaccel.techniques.pipeline import (SCHEDULES, bubble_fraction, check as check_pipeline,
                                          check_layers, make_schedule)
from jaxaccel.core.sharding import (COMPUTE_RULES, MESH_AXES, STRATEGIES, batch_shards,
                                    batch_sharding, bytes_per_device, check_split, format_mesh,
                                    logical_spec, make_mesh, mesh_shape, param_shardings,
                                    parse_axis_rules, pipelined)
from jaxaccel.step.state import init_sharded_state


@dataclasses.dataclass
class ShardingSettings:
    strategies: str = setting(",".join(STRATEGIES), "comma-separated strategies, each on its "
                                                    "default mesh over all devices")
    cpu_devices: int = setting(8, "on a CPU, simulate this many devices", at_least=1)
    pipeline_schedules: str = setting("gpipe,1f1b", "comma-separated schedules each pipelined "
                                                    "strategy runs with")
    pipeline_microbatches: int = setting(8, "microbatches per step of the pipelined rows (their "
                                            "accumulate)", at_least=1)


ShardingConfig = config_of(ShardingSettings)


def prepare(cfg: ShardingConfig) -> ShardingConfig:
    """Ask for ``--cpu-devices`` CPU devices, before JAX starts (``cpu_devices_note`` if it had)."""
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", cfg.experiment.cpu_devices)
    return cfg


def cpu_devices_note(cfg: ShardingConfig) -> str | None:
    if jax.config.jax_num_cpu_devices == cfg.experiment.cpu_devices:
        return None
    return (f"JAX had started before --cpu-devices took effect; the rows use the "
            f"{jax.device_count()} devices it has")


def rows(cfg: ShardingConfig) -> list[Row]:
    """One device, then every strategy on all devices (a pipelined one once per schedule),
    each row's model, mesh and batch checked."""
    exp = cfg.experiment
    strategies = parse_list(exp.strategies, "experiment.strategies", valid=STRATEGIES)
    if cfg.data.batch_size is None or cfg.data.tokens_per_batch is not None:
        raise ConfigError("this experiment takes batch_size, not tokens_per_batch",
                          field="data.batch_size")
    schedules = parse_list(exp.pipeline_schedules, "experiment.pipeline_schedules",
                           valid=SCHEDULES)
    plan = [Row("single", {"mesh.strategy": "dp"}, {"strategy": "single"})]
    for name in strategies:
        variants = {name: {"mesh.strategy": name}}
        if pipelined(name):
            variants = {f"{name} ({schedule})": {
                "mesh.strategy": name, "mesh.pipeline_schedule": schedule,
                "optimizer.accumulate": exp.pipeline_microbatches, "remat.scan_layers": True}
                for schedule in schedules}
        for label, settings in variants.items():
            try:
                check(override(cfg, settings))
            except ConfigError as e:
                if pipelined(name) and e.field in ("data.batch_size", "optimizer.accumulate"):
                    raise _microbatch_error(e, label, exp.pipeline_microbatches) from None
                raise
            plan.append(Row(label, settings, {"strategy": label}))
    return plan


def _microbatch_error(error: ConfigError, label: str, microbatches: int) -> ConfigError:
    """A pipelined row's batch that does not split into its microbatches, said in this
    experiment's flags: its microbatches are --pipeline-microbatches (the row's accumulate)."""
    reason = str(error).split("; pass")[0].replace(f"accumulate={microbatches}",
                                                   f"pipeline_microbatches={microbatches}")
    return ConfigError(f"the pipelined row {label}: {reason}; pass --pipeline-microbatches "
                       f"that divides the batch, or a --batch-size that splits",
                       field="experiment.pipeline_microbatches")


def check(cfg: ShardingConfig):
    """The row's config, its model's split over its mesh (and stages) and its batch's."""
    cfg.validate()
    name, model = cfg.mesh.strategy, techniques.abstract(cfg)
    shape = mesh_shape(name, jax.device_count())
    check_split(shape, nnx.state(model), parse_axis_rules(cfg.mesh.axis_rules), name)
    if pipelined(name):
        check_layers(model, shape["stage"])
        check_pipeline(cfg.mesh.pipeline_schedule, shape["stage"], cfg.optimizer.accumulate)
    multiple = batch_shards(shape) * cfg.optimizer.accumulate
    if cfg.data.batch_size % multiple:
        raise ConfigError(
            f"batch_size={cfg.data.batch_size} does not split over {name}'s mesh "
            f"{format_mesh(shape)} (data x fsdp) times its microbatches "
            f"({cfg.optimizer.accumulate}); pass a multiple of {multiple}",
            field="data.batch_size")


def shared(cfg: ShardingConfig):
    """The optimizer, and the batches every row trains and evaluates on."""
    optimizer, _, _ = build_optimizer(cfg.optimizer, batch_rows=cfg.data.batch_size,
                                      total_steps=cfg.run.steps)
    return optimizer, *corpus_batches(cfg, cfg.seq_len)


def corpus_batches(cfg: ShardingConfig, seq_len: int):
    """The first ``--steps`` training batches and the first validation batch, on the host."""
    corpus = corpus_of(cfg.data)
    rows = cfg.data.batch_size
    stream = batches(corpus.train, strategy="fixed", seq_len=seq_len, batch_size=rows,
                     seed=cfg.run.seed)
    train = list(itertools.islice(stream, cfg.run.steps))
    if len(train) < cfg.run.steps:
        raise ConfigError(f"steps={cfg.run.steps}: every row trains on the same first batches "
                          f"of one epoch, and this corpus has {len(train)} of batch_size "
                          f"{rows} at seq_len {seq_len}; pass --steps {len(train)} or fewer",
                          field="run.steps")
    val = next(batches(corpus.val, strategy="fixed", seq_len=seq_len, batch_size=rows,
                       shuffle=False))
    return train, val


def mlp_temp_bytes(mesh, cfg, batch_shape) -> int | None:
    """Compiled temporary bytes per device of one MLP's forward and backward pass on ``mesh``,
    its weights sharded as in training and its input split over the batch axes. ``cfg``: a
    TrainConfig (its GPT preset's MLP; None for a model of one's own, which has no such MLP)
    or a ``gpt.GPTConfig``."""
    shape = cfg if isinstance(cfg, gpt.GPTConfig) else gpt_shape(cfg)
    if shape is None:
        return None
    rules = None if isinstance(cfg, gpt.GPTConfig) else parse_axis_rules(cfg.mesh.axis_rules)
    graphdef, params = nnx.split(model_lib.abstract(lambda: gpt.MLP(shape, rngs=nnx.Rngs(0))))
    # params: ShapeDtypeStructs, with their logical axes: nothing is allocated

    def loss(params, x_BTD):
        return jnp.sum(nnx.merge(graphdef, params)(x_BTD) ** 2)

    with jax.set_mesh(mesh):
        shardings = param_shardings(mesh, params, rules)
        x_sharding = NamedSharding(mesh, logical_spec(gpt.ACTIVATION_AXES, COMPUTE_RULES))
        x = jax.ShapeDtypeStruct((*batch_shape, shape.d_model), jnp.float32)
        executable = jax.jit(jax.grad(loss, argnums=(0, 1)),
                             in_shardings=(shardings, x_sharding)).lower(params, x).compile()
    return memory_bytes(executable)["temp"]


def measure(run: RowRun) -> dict:
    """One row: the strategy's mesh, its memory per device, its step time and its loss (and
    with a pipeline, its bubble and the stage inputs kept)."""
    (optimizer, train, val), cfg, devices = run.shared, run.config(), jax.devices()
    if run.row.label == "single":
        shape, devices = {a: 1 for a in MESH_AXES}, devices[:1]
    else:
        shape = mesh_shape(cfg.mesh.strategy, len(devices))
    model = techniques.abstract(cfg)
    stacks = nn.stacks(model)
    mesh = make_mesh(shape, cfg.mesh.axis_types, devices)
    with jax.set_mesh(mesh):
        state, shardings = init_sharded_state(
            techniques.variables(cfg), optimizer, cfg.run.seed, cfg.make_loss_scale(), mesh,
            cfg.policy(), axis_rules=parse_axis_rules(cfg.mesh.axis_rules))
        layout = batch_sharding(mesh)
        step, evaluate = sharded_steps(cfg, model, optimizer, None, shardings, mesh)
        step.compile(abstract(state), abstract_batch(train[0]["inputs"].shape))
        memory = memory_bytes(step.last)
        param_opt = bytes_per_device((state.params, state.opt_state))
        blocks = (bytes_per_device(model_lib.stack_of(state.params, stacks[0][0]))
                  if len(stacks) == 1 else None)
        seconds = []
        for batch in train:
            check_stop()
            start = time.perf_counter()
            state, metrics = step(state, place_batch(batch, layout))
            jax.block_until_ready((state, metrics))
            seconds.append(time.perf_counter() - start)
        sums = jax.device_get(evaluate(state, place_batch(val, layout)))
    piped, microbatches = pipelined(cfg.mesh.strategy), cfg.optimizer.accumulate
    schedule = (make_schedule(cfg.mesh.pipeline_schedule, shape["stage"], microbatches)
                if piped else None)
    return {
        "mesh": ",".join(str(shape[a]) for a in MESH_AXES),
        "mesh_axes": format_mesh(shape),
        "devices": len(mesh.devices.flat),
        "param_opt_bytes_per_device": param_opt,
        "blocks_bytes_per_device": blocks,
        "pipeline_schedule": schedule.name if piped else None,
        "microbatches": microbatches,
        "bubble": bubble_fraction(shape["stage"], microbatches) if piped else None,
        "stage_inputs": schedule.slots if piped else None,
        "temp_bytes_per_device": memory.get("temp"),
        "mlp_temp_bytes_per_device": mlp_temp_bytes(mesh, cfg, train[0]["inputs"].shape),
        "step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0],
        "compile_s": step.compile_seconds,
        "loss": float(sums["loss_sum"] / max(sums["weight_sum"], 1.0)),
    }


def compare(cfg: ShardingConfig, rows: list[dict], partial):
    """Every row against the one on one device."""
    single = rows[0]
    relative(rows, single, param_opt_fraction=("param_opt_bytes_per_device", "ratio"),
             blocks_fraction=("blocks_bytes_per_device", "ratio"),
             mlp_temp_fraction=("mlp_temp_bytes_per_device", "ratio"))
    for row in rows:
        row["loss_diff_vs_single"] = abs(row["loss"] - single["loss"]) / abs(single["loss"])


def setup(cfg: ShardingConfig) -> str:
    arch = gpt_shape(cfg)
    width = f"{arch.d_model} wide, " if arch else ""
    return (f"{describe(cfg.model, cfg.gpt)} ({width}{stack_depth(cfg)} layers), seq_len "
            f"{cfg.seq_len}, batch {cfg.data.batch_size}, {cfg.run.steps} steps of "
            f"{cfg.optimizer.name}, {cfg.policy().name}, {cfg.mesh.axis_types} axes, "
            f"{jax.device_count()} {jax.default_backend()} devices")


def meta(cfg: ShardingConfig, rows: list[dict]) -> dict:
    arch = gpt_shape(cfg)
    return {"model": describe(cfg.model, cfg.gpt), "d_model": arch and arch.d_model,
            "n_layers": stack_depth(cfg), "n_heads": arch and arch.n_heads,
            "n_kv_heads": arch and arch.n_kv_heads, "optimizer": cfg.optimizer.name,
            "precision": cfg.policy().name, "mesh_axis_types": cfg.mesh.axis_types,
            "device_count": jax.device_count(), "backend": jax.default_backend(),
            "note": cpu_devices_note(cfg)}


def notes(cfg: ShardingConfig, rows: list[dict], meta: dict) -> list[str]:
    return [*([meta["note"]] if meta["note"] else []),
            *(["simulated CPU devices share the machine's cores: step times show the cost of "
               "the collectives, not a speedup"] if meta["backend"] == "cpu" else [])]


EXPERIMENT = Experiment(
    name="sharding", doc=__doc__, config=ShardingConfig, rows=rows, setup=setup, trains=False,
    columns=[("strategy", "strategy", ""), ("mesh", "mesh (stage,data,fsdp,tensor)", ""),
             ("param_opt_bytes_per_device", "params+opt B/device", ",d"),
             ("param_opt_fraction", "of one device's", ".3f"),
             ("blocks_fraction", "blocks of one device's", ".3f"),
             ("temp_bytes_per_device", "step temp B/device", ",d"),
             ("mlp_temp_bytes_per_device", "MLP temp B/device", ",d"),
             ("mlp_temp_fraction", "of one device's", ".3f"),
             ("step_s", "step s (median)", ".3f"), ("bubble", "bubble", ".3f"),
             ("stage_inputs", "inputs kept", ""), ("loss", "loss", ".6f"),
             ("loss_diff_vs_single", "rel. diff vs 1 device", ".1e")],
    # This experiment's defaults (tp splits the 8 heads, pp the 8 layers over all devices);
    # each row sets its own strategy and mesh, and the pipelined rows their schedule and
    # microbatches.
    defaults={"gpt.n_heads": 8, "gpt.n_layers": 8, "run.steps": 5, "data.seq_len": 128,
              "data.batch_size": 16, "optimizer.warmup_steps": 0},
    fixed=("mesh.strategy", "mesh.shape", "mesh.num_devices", "mesh.pipeline_schedule"),
    prepare=prepare, shared=shared, measure=measure, compare=compare, meta=meta, notes=notes)
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
