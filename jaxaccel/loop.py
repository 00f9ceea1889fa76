"""The training loop in four phases: set up, compile, run, finish.

``train(cfg)`` runs one training run and returns its ``RunSummary``. It is deterministic: a run
resumed from a checkpoint continues with the same state, the same batches and the same keys, so
on the CPU it ends bitwise identical to an uninterrupted run. SIGINT and SIGTERM finish the step
in flight, save a checkpoint and return with ``interrupted`` set.

The run happens on a device mesh (``jaxaccel.sharding``; one device is a mesh of one): the state
is created sharded, the steps are jitted with the state's and the batch's shardings, and with
several processes each loads and places only its own rows of every batch.
"""

import collections
import contextlib
import dataclasses
import glob
import json
import math
import os
import shlex
import shutil
import signal
import sys
import time

import jax
import numpy as np

from jaxaccel import buffers, compile_cache, fp8, hardware, lora, profiling, sparsity, stacking
from jaxaccel.checkpoint import Checkpointer
from jaxaccel.compiled import CompiledFn, abstract, largest_memory_bytes
from jaxaccel.config import TrainConfig, build, check_json_outputs, check_writable, field_value, \
    override, read_config_file, stop_step, to_dict, write_config
from jaxaccel.corpus import corpus_of, skipped_inputs
from jaxaccel.data import DataStream, batches
from jaxaccel.errors import ConfigError
from jaxaccel.loader import DevicePrefetcher, abstract_batch, place_batch
from jaxaccel.metrics import (MetricsWriter, plot_loss_curve, read_metrics,
                              truncate_metrics)
from jaxaccel.model import count_params, describe_model, flops_per_token, init_params, make_apply
from jaxaccel.optim import build_optimizer, state_bytes
from jaxaccel.planner import choose_remat
from jaxaccel.report import dump_json
from jaxaccel.sampling import SampledStream, lag as sampling_lag
from jaxaccel.pipeline import bubble_fraction, check as check_pipeline, pipeline_eval_fn, \
    pipeline_grad_fn
from jaxaccel.sharding import (batch_shards, batch_sharding, build_mesh, bytes_per_device,
                               format_mesh, initialize_distributed, pipelined, replicated)
from jaxaccel.state import abstract_sharded_state, init_sharded_state, init_state
from jaxaccel.stochastic_depth import kept_fraction
from jaxaccel.trackers import open_trackers, parse as tracker_names
from jaxaccel.train import lm_eval_step, lm_train_step, make_train_step

RUNS_ROOT = "runs"

# Sections and fields a resumed run must share with its checkpoint: they shape the state, the
# data order or the optimizer's trajectory, so changing them would silently break the run.
RESUME_SECTIONS = ("model", "optimizer", "precision")
RESUME_FIELDS = ("data.path", "data.batching", "run.seed", "run.init_from",
                 "run.progressive_stack", "data.sampling", "data.sampling_power",
                 "data.sampling_floor")
# Settings added after checkpoints were first written, with the value that means "not used":
# recorded only when used, so a checkpoint from before them still resumes.
ADDED_SETTINGS = {"model.init": "default", "model.stochastic_depth": 0.0, "model.lora_rank": 0,
                  "model.lora_alpha": 16.0, "model.lora_targets": "q,v", "model.adapter_dim": 0,
                  "model.fp8": False, "model.sparsity": "none", "model.sparsity_every": 100,
                  "model.sparsity_decay": 2e-4, "model.token_keep": 1.0,
                  "model.token_drop_layers": None, "model.token_drop_score": "random",
                  "run.init_from": None, "run.progressive_stack": 1, "data.sampling": "uniform",
                  "data.sampling_power": 1.0, "data.sampling_floor": 0.1}


@dataclasses.dataclass
class RunSummary:
    """What one run did and measured (``experiments.train`` prints it; ``--json`` writes it)."""

    steps: int
    steps_this_run: int
    interrupted: str | None
    run_dir: str
    # data
    batching: str
    shapes: list
    real_tokens: int
    padding_efficiency: float
    epoch_padding_efficiency: float
    split_documents: int
    empty_documents_skipped: int
    data_wait_s: float
    # quality
    train_bpb: float
    val_loss: float
    val_bpb: float
    val_tokens: int
    unigram_bpb: float
    # speed and memory
    real_tokens_per_s: float
    flops_per_token: float
    achieved_flops_per_s: float
    mfu: float | None
    compiles: int
    compiles_after_warmup: int
    compile_s: float
    eval_compiles: int
    step_memory_bytes: dict | None
    peak_memory_bytes: int | None
    wall_s: float
    train_s: float
    # the techniques as they ran
    model: str
    params: int
    attention: str
    remat: str
    scan_layers: bool
    remat_plan: dict | None
    precision: str
    matmul_precision: str
    loss_scale: float
    skipped_steps: int
    optimizer: str
    learning_rate: float
    weight_decay: float
    batch_rows: int
    accumulate: int
    optimizer_state_bytes: int
    sharding: str
    mesh: dict
    pipeline_schedule: str | None
    pipeline_bubble: float | None
    init: str
    stochastic_depth: float
    stochastic_depth_kept: float
    progressive_stages: list | None
    trainable_params: int
    init_from: str | None
    mesh_axis_types: str
    process_count: int
    param_opt_bytes_per_device: int
    device: str
    jax_version: str
    fp8: str | None = None              # how the FP8 matmuls ran (jaxaccel.fp8.check_device)
    fp8_gemms: int | None = None        # FP8 GEMMs in the compiled step (GPUs; fp8.fp8_gemms)
    sparsity: str = "none"
    sparsity_density: float | None = None  # share of the masked weights the N:M masks keep
    sampling: str = "uniform"           # importance sampling of documents (jaxaccel.sampling)
    diverged_at_step: int | None = None  # the first step whose loss was NaN or inf (a failure)
    inputs_skipped: dict | None = None  # what the corpus source left out, by reason
    extended_from_steps: int | None = None  # resumed with another length: the earlier one
    profile: dict | None = None         # --profile: the steps traced and the top operations
    startup_s: dict | None = None       # seconds of each start-up phase (STARTUP_PHASES)
    step_alone: dict | None = None      # run.time_step: the step timed alone on the last batches
    stopped_at: int | None = None       # run.stop_at paused the run at this step (resumable)
    total_steps: int | None = None      # the run's length in steps (steps: how far it got)

    @classmethod
    def read(cls, path: str) -> "RunSummary":
        with open(path) as f:
            return cls(**json.load(f))


def train(cfg: TrainConfig, *, should_stop=None) -> RunSummary:
    """Run training as configured; return its summary.

    ``should_stop(step)`` is polled after every step; returning True stops the run as a signal
    would (checkpoint saved, ``interrupted`` set). Tests use it to cut a run short.

    With ``mesh.coordinator`` (or ``mesh.distributed``) this process first joins the others
    through ``jax.distributed``; then every process runs this same function on its share of the
    data.
    """
    wall_start = time.perf_counter()
    m = cfg.mesh
    if not jax.distributed.is_initialized():
        initialize_distributed(m.coordinator, m.num_processes, m.process_id,
                               auto=m.distributed, timeout_s=m.distributed_timeout)
    cfg.validate()
    check_outputs(cfg)
    cache_warning = compile_cache.enable(compile_cache.resolve(cfg.run.compilation_cache,
                                                               cfg.data.cache_dir))
    if cache_warning and jax.process_index() == 0:
        print(cache_warning, file=sys.stderr)
    if cfg.run.memory_budget == "auto":
        memory_budget_bytes("auto")         # the device can say its memory, before any work
    fp8_note = fp8.check_device() if cfg.model.fp8 else None
    mesh, mesh_shape = build_mesh(m.strategy, m.shape, m.axis_types, cfg.model, m.num_devices)
    if pipelined(m.strategy):
        check_pipeline(m.pipeline_schedule, mesh_shape["stage"], cfg.optimizer.accumulate)
    with jax.default_matmul_precision(cfg.precision.matmul), jax.set_mesh(mesh):
        announce(cfg, f"set-up: corpus {cfg.data.path}, {describe_model(cfg.model)} model, "
                      f"mesh {format_mesh(mesh_shape)}" + (", resuming" if cfg.run.resume
                                                            else ""))
        set_up_began = time.perf_counter()
        run = set_up(cfg, mesh, mesh_shape)
        run.startup["before_set_up"] = set_up_began - wall_start
        progress, compiled = None, []
        while True:         # one stage, unless progressive stacking grows the model
            begin = time.perf_counter()
            compiled.append(compile_steps(run))
            run.startup.setdefault("compile", time.perf_counter() - begin)
            progress = run_steps(run, compiled[-1], should_stop, previous=progress,
                                 wall_start=wall_start)
            if progress.interrupted or int(progress.state.step) >= run.stop_step:
                break
            run = grow_run(run, progress)
        summary = finish(run, compiled, progress, wall_start, fp8_note)
    if jax.process_index() == 0:        # the run record: every run directory has its summary
        dump_json(os.path.join(summary.run_dir, "summary.json"), dataclasses.asdict(summary))
    return summary


# =============================================================================================
# Phase 1: set up. Data, optimizer, sharded state, remat plan, checkpoint (restored on resume).

@dataclasses.dataclass
class Setup:
    cfg: TrainConfig            # model.remat as the memory budget chose it; model.n_layers the
                                # depth of this progressive-stacking stage
    mesh: object
    mesh_shape: dict
    run_dir: str
    corpus: object
    stream: DataStream
    total_steps: int
    optimizer: object
    schedule: object
    hyperparameters: dict
    state: object
    shardings: object
    batch_layout: object
    plan: object
    resume_config: dict
    checkpointer: Checkpointer
    eval_batch_size: int
    stream_args: dict
    full_layers: int            # the model's depth when every stacking stage has grown
    stack_ends: list            # the steps where progressive stacking doubles the depth
    stop_step: int              # the step this invocation ends at: run.stop_at, else the last
    stages: list                # [first step, depth] of each stage this run has trained
    extended_from_steps: int | None = None  # a resumed run given another length: the old one
    startup: dict = dataclasses.field(default_factory=dict)  # seconds of each start-up phase
    restored_history: list = dataclasses.field(default_factory=list)  # (loss, real tokens) of
                                # the steps just before the checkpoint resumed from (its meta)


def set_up(cfg: TrainConfig, mesh, mesh_shape) -> Setup:
    multiple = batch_shards(mesh_shape) * cfg.optimizer.accumulate
    if cfg.data.batch_size is not None and cfg.data.batch_size % multiple:
        raise ConfigError(
            f"batch_size={cfg.data.batch_size} does not split over the mesh's data x fsdp axes "
            f"({batch_shards(mesh_shape)} parts, {format_mesh(mesh_shape)}) times accumulate="
            f"{cfg.optimizer.accumulate}; pass a batch size that is a multiple of {multiple}",
            field="data.batch_size")
    began = time.perf_counter()
    run_dir = resolve_run_dir(cfg)
    corpus = corpus_of(cfg.data)
    startup = {"corpus": time.perf_counter() - began}
    if corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {cfg.data.tokenizer} has {corpus.tokenizer.vocab_size} "
                          f"ids, more than the model's vocab_size={cfg.model.vocab_size}; build "
                          f"the config with config.build, which sets vocab_size from the "
                          f"tokenizer", field="model.vocab_size")
    os.makedirs(run_dir, exist_ok=True)
    if jax.process_index() == 0:
        corpus.tokenizer.save(run_dir)          # the run keeps the tokenizer it trains with

    stream_args = stream_settings(cfg, multiple)
    stream = open_stream(cfg, corpus.train, stream_args)
    total_steps = cfg.run.steps
    if cfg.run.train_tokens is not None:
        total_steps = max(1, math.ceil(cfg.run.train_tokens
                                       / stream.stats["real_tokens_per_batch"]))
    optimizer, schedule, hyperparameters = build_optimizer(
        cfg.optimizer, batch_rows=cfg.batch_rows(), total_steps=total_steps)
    # Before any work: where this invocation stops, and a profile window within its steps.
    resumed = max(_saved_steps(run_dir), default=0) if cfg.run.resume else 0
    stop = (stop_step(cfg.run.stop_at, total_steps, resumed) if cfg.run.stop_at is not None
            else total_steps)
    if cfg.run.profile is not None:
        profiling.check_window(cfg.run.profile, resumed, stop)
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"),
                                max_to_keep=cfg.run.keep_checkpoints,
                                keep_period=cfg.run.keep_every_steps,
                                asynchronous=cfg.run.async_checkpoint)
    full_cfg, stages = cfg, cfg.run.progressive_stack
    stack_ends = stacking.boundaries(total_steps, stages, cfg.run.stack_at)
    first_step = (checkpointer.latest_step() or 0) if cfg.run.resume else 0
    cfg = _with_layers(cfg, stacking.depth_at(first_step, full_cfg.model.n_layers, stages,
                                              stack_ends))
    begin = time.perf_counter()
    state, shardings = init_sharded_state(cfg.model, optimizer, cfg.run.seed,
                                          cfg.make_loss_scale(), mesh, cfg.policy())
    jax.block_until_ready(state)
    startup["init"] = time.perf_counter() - begin
    if cfg.run.init_from is not None and not cfg.run.resume:
        state = state.replace(params=jax.device_put(
            lora.attach(load_trained_params(cfg.run.init_from, cfg.model), state.params),
            shardings.params))
    batch_layout = batch_sharding(mesh)
    plan = None
    if cfg.run.memory_budget is not None:
        cfg, plan = _plan_remat(cfg, optimizer, state, stream, batch_layout)
    resume_config = {**resume_settings(full_cfg, stream_args, total_steps, multiple),
                     "data.corpus_fingerprint": corpus.fingerprint}
    extended_from = None
    if cfg.run.resume:
        state, position, restored = checkpointer.restore(state, config=resume_config,
                                                         may_differ=("run.steps",))
        saved_steps = checkpointer.saved_config.get("run.steps", total_steps)
        if saved_steps != total_steps:
            if total_steps < restored:
                raise ConfigError(f"steps={total_steps} is below the checkpoint's step "
                                  f"{restored}; resume with at least that many steps",
                                  field="run.steps")
            extended_from = saved_steps
            announce(cfg, f"the run's length changes from {saved_steps} to {total_steps} "
                          f"steps: the learning-rate schedule follows the new length")
        stream = open_stream(cfg, corpus.train, stream_args, position)
    if jax.process_index() == 0:
        write_config(override(_with_layers(cfg, full_cfg.model.n_layers), {"run.stop_at": None}),
                     run_dir, shlex.join(sys.orig_argv))     # a pause is not the run's setting
        dump_json(os.path.join(run_dir, "environment.json"), run_environment(mesh_shape))
    eval_multiple = math.lcm(batch_shards(mesh_shape) * eval_microbatches(cfg),
                             jax.process_count())
    eval_batch_size = cfg.run.eval_batch_size or cfg.batch_rows()
    eval_batch_size = -(-eval_batch_size // eval_multiple) * eval_multiple
    return Setup(cfg, mesh, mesh_shape, run_dir, corpus, stream, total_steps, optimizer,
                 schedule, hyperparameters, state, shardings, batch_layout, plan, resume_config,
                 checkpointer, eval_batch_size, stream_args, full_cfg.model.n_layers, stack_ends,
                 stop, [[int(state.step), cfg.model.n_layers]], extended_from,
                 restored_history=checkpointer.saved_history if cfg.run.resume else [],
                 startup=startup)


def _with_layers(cfg: TrainConfig, n_layers: int) -> TrainConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n_layers))


def _plan_remat(cfg: TrainConfig, optimizer, state, stream, batch_layout):
    """``cfg`` with the remat policy its memory budget chooses for this model, and the plan."""
    remat, plan = choose_remat(lambda model: train_step_of(cfg, model, optimizer),
                               cfg.model, abstract(state), stream.global_shapes,
                               memory_budget_bytes(cfg.run.memory_budget), batch_layout)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat)), plan


# Model fields that shape the weights a run can start from (``run.init_from``).
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "mlp",
                "tie_embeddings", "init", "scan_layers")


def load_trained_params(run_dir: str, model_cfg):
    """The parameters of the latest checkpoint of the trained run ``run_dir``, for a model of
    ``model_cfg``'s shape (LoRA and adapters aside; a LoRA run's updates come merged into its
    weights); one clear line if the shapes differ."""
    trained, params, _ = read_trained_run(run_dir)
    base = lora.base_config(trained.model)
    mismatched = [f"{name}={getattr(base, name)!r} (here {getattr(model_cfg, name)!r})"
                  for name in SHAPE_FIELDS if getattr(base, name) != getattr(model_cfg, name)]
    if mismatched:
        raise ConfigError(f"init_from={run_dir} trained another model shape: "
                          f"{', '.join(mismatched)}; use the same model settings as that run",
                          field="run.init_from")
    return lora.merge(params, trained.model) if trained.model.lora_rank else params


def read_trained_run(run_dir: str):
    """``(config, parameters, step)`` of a run directory: its ``config.yaml``, and the
    parameters and step of its latest checkpoint (restored into the state that config
    describes)."""
    try:
        trained = build(TrainConfig, read_config_file(os.path.join(run_dir, "config.yaml")))
    except ConfigError as e:
        raise ConfigError(f"{run_dir} is not a readable run directory ({e}); pass the run_dir "
                          f"of a trained run", field="run.init_from") from None
    optimizer, _, _ = build_optimizer(trained.optimizer, batch_rows=trained.batch_rows(),
                                      total_steps=trained.run.steps)
    template = jax.eval_shape(
        lambda key: init_state(init_params(trained.model, key), optimizer, 0,
                               trained.make_loss_scale(), trained.policy(),
                               lora.trainable(trained.model)), jax.random.PRNGKey(0))
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"))
    try:
        state, _, step = checkpointer.restore(template, config={})
    finally:
        checkpointer.close()
    return trained, state.params, step


def resolve_run_dir(cfg: TrainConfig) -> str:
    """The run directory: the given one, the latest run (on resume) or a new timestamped one."""
    run_dir, resume = cfg.run.run_dir, cfg.run.resume
    if run_dir is not None:
        remove_unfinished_checkpoints(os.path.join(run_dir, "checkpoints"), cfg)
        if _saved_steps(run_dir) and not resume:
            raise ConfigError(f"run dir {run_dir} already holds checkpoints; set resume to "
                              f"continue it or choose another run_dir", field="run.resume")
        return run_dir
    if resume:
        earlier = sorted(glob.glob(os.path.join(RUNS_ROOT, "train-*", "checkpoints", "*")))
        if not earlier:
            raise ConfigError(f"resume found no earlier run under {RUNS_ROOT}/; pass its run_dir",
                              field="run.run_dir")
        return os.path.dirname(os.path.dirname(earlier[-1]))
    run_dir = os.path.join(RUNS_ROOT, time.strftime("train-%Y%m%d-%H%M%S"))
    suffix = 1
    while os.path.exists(run_dir):
        run_dir = os.path.join(RUNS_ROOT, time.strftime("train-%Y%m%d-%H%M%S") + f"-{suffix}")
        suffix += 1
    return run_dir


def run_environment(mesh_shape: dict) -> dict:
    """The run record's software and hardware: package versions, devices, processes, host."""
    import importlib.metadata
    versions = {}
    for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"versions": versions, "python": sys.version.split()[0],
            "device": hardware.describe(), "platform": jax.default_backend(),
            "device_count": jax.device_count(), "process_count": jax.process_count(),
            "mesh": format_mesh(mesh_shape), "host": os.uname().nodename,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _listdir(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


def _saved_steps(run_dir: str) -> list[int]:
    """The steps of the finished checkpoints in ``run_dir`` (read without creating anything)."""
    return [int(name) for name in _listdir(os.path.join(run_dir, "checkpoints"))
            if name.isdigit()]


def remove_unfinished_checkpoints(directory: str, cfg: TrainConfig):
    """Delete the temporary directories of checkpoints a run did not finish writing (killed,
    or a full disk), with a note: they are not checkpoints, and would keep the run from
    starting again or resuming."""
    if jax.process_index() != 0:
        return
    for name in _listdir(directory):
        if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            announce(cfg, f"removed {os.path.join(directory, name)}: a checkpoint that was not "
                          f"finished")


def check_outputs(cfg: TrainConfig):
    """ConfigError, before any work, for an output location this run cannot write: the run
    directory (or the nearest folder it would be made in) and the ``--json`` file's folder."""
    check_writable("run.run_dir", cfg.run.run_dir or RUNS_ROOT, may_create=True)
    check_json_outputs(cfg)


def stream_settings(cfg: TrainConfig, multiple: int) -> dict:
    """``DataStream``'s keyword arguments for this process; batches split into ``multiple``."""
    return dict(strategy=cfg.data.batching, seq_len=cfg.seq_len, seed=cfg.run.seed,
                process_index=jax.process_index(), process_count=jax.process_count(),
                data_parallel=multiple, **cfg.batching_options())


def open_stream(cfg: TrainConfig, documents, stream_args: dict, position: dict | None = None):
    """The training stream from ``position``: a ``DataStream``, or with ``data.sampling`` an
    importance-sampled one (``jaxaccel.sampling.SampledStream``)."""
    if cfg.data.sampling == "uniform":
        return DataStream(documents, position=position, **stream_args)
    d = cfg.data
    return SampledStream(documents, position=position, sampling=d.sampling,
                         power=d.sampling_power, floor=d.sampling_floor,
                         lag=sampling_lag(d.prefetch), **stream_args)


def resume_settings(cfg: TrainConfig, stream_args: dict, total_steps: int, multiple: int) -> dict:
    """The settings a checkpoint records and a resumed run must match, by field path."""
    settings = {f"{section}.{name}": value for section, fields in to_dict(cfg).items()
                if section in RESUME_SECTIONS for name, value in fields.items()}
    settings.update({path: field_value(cfg, path) for path in RESUME_FIELDS})
    settings = {k: v for k, v in settings.items()
                if k not in ADDED_SETTINGS or v != ADDED_SETTINGS[k]}
    if cfg.run.progressive_stack > 1:
        settings["run.stack_at"] = stacking.boundaries(total_steps, cfg.run.progressive_stack,
                                                       cfg.run.stack_at)
    settings.update({f"data.{k}": v for k, v in cfg.batching_options().items()},
                    **{"data.seq_len": stream_args["seq_len"], "run.steps": total_steps})
    if cfg.data.sampling != "uniform":          # the sampler's lag follows the prefetch depth
        settings["data.prefetch"] = cfg.data.prefetch
    if cfg.data.tokens_per_batch is not None:   # token budgets round batches to this multiple
        settings["data.batch_multiple"] = math.lcm(multiple, jax.process_count())
    return settings


def train_step_of(cfg: TrainConfig, model_cfg, optimizer, schedule=None):
    """The pure train step a config describes (``jaxaccel.train.lm_train_step``; with a pp
    strategy the pipelined gradient function of ``jaxaccel.pipeline``, ``accumulate``
    microbatches), for ``model_cfg`` (the config's model, or a variant of it)."""
    if pipelined(cfg.mesh.strategy):
        grad_fn = pipeline_grad_fn(model_cfg, cfg.optimizer.accumulate,
                                   cfg.mesh.pipeline_schedule, policy=cfg.policy())
        return make_train_step(grad_fn, optimizer, schedule)
    # rows of one document (every batching but pack) need no segment mask: causal suffices
    return lm_train_step(make_apply(model_cfg, segment_attention=cfg.data.batching == "pack"),
                         optimizer, schedule, policy=cfg.policy(),
                         accumulate=cfg.optimizer.accumulate,
                         trainable=lora.trainable(model_cfg),
                         observed=buffers.observed if model_cfg.fp8 else None,
                         update_buffers=buffers.updater(model_cfg), sampling=cfg.data.sampling)


def sharded_steps(cfg: TrainConfig, optimizer, schedule, shardings, mesh):
    """The train and eval steps of ``cfg`` as ``CompiledFn``s jitted over ``mesh``: the state in
    ``shardings`` (donated to the train step), the batch split over data x fsdp, metrics
    replicated."""
    layout, whole = batch_sharding(mesh), replicated(mesh)
    train_step = CompiledFn(train_step_of(cfg, cfg.model, optimizer, schedule),
                            in_shardings=(shardings, layout), out_shardings=(shardings, whole),
                            donate_argnums=0)
    if pipelined(cfg.mesh.strategy):
        evaluate = pipeline_eval_fn(cfg.model, eval_microbatches(cfg), policy=cfg.policy())
    else:
        evaluate = lm_eval_step(make_apply(cfg.model, segment_attention=False),  # fixed rows
                                cfg.policy())
    eval_step = CompiledFn(evaluate, in_shardings=(shardings, layout), out_shardings=whole)
    return train_step, eval_step


def eval_microbatches(cfg: TrainConfig) -> int:
    """Microbatches of an evaluation batch: the pipeline's (``accumulate``) with a pp strategy,
    else 1 (the whole batch at once)."""
    return cfg.optimizer.accumulate if pipelined(cfg.mesh.strategy) else 1


# =============================================================================================
# Phase 2: compile. Every batch shape the data can produce, before the clock starts.

@dataclasses.dataclass
class Steps:
    train: CompiledFn
    eval: CompiledFn
    warm_compiles: int


def compile_steps(run: Setup) -> Steps:
    announce(run.cfg, f"compiling the train step for {len(run.stream.global_shapes)} batch "
                      f"shape(s) and the eval step")
    train_step, eval_step = sharded_steps(run.cfg, run.optimizer, run.schedule, run.shardings,
                                          run.mesh)
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


def check_memory(cfg: TrainConfig, compiled_fns, limit: int | None):
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
            + ", or more devices with --sharding fsdp", field="run.eval_batch_size" if name == "eval"
            else "data.batch_size")


# =============================================================================================
# Phase 3: run. Steps, metrics, periodic evaluation and checkpoints, stopping on signals.

@dataclasses.dataclass
class Progress:
    state: object
    first_step: int
    totals: dict                # real tokens and token positions of the run's global batches
    history: list               # (loss, real tokens) per step
    train_s: float
    data_wait_s: float
    interrupted: str | None
    writer: MetricsWriter
    position: dict              # the loader's position after the last step
    profile: object = None      # --profile's ProfileReport, once its window has run
    recent_batches: list = dataclasses.field(default_factory=list)  # run.time_step's batches


def run_steps(run: Setup, steps: Steps, should_stop=None, previous: Progress | None = None,
              wall_start: float | None = None) -> Progress:
    """Train from the state's step to the end of the run, or of its progressive-stacking
    stage; ``previous`` is the progress of the stages before, which this one continues. The
    run's first step is waited for once, to time the start-up (``run.startup``) from
    ``wall_start`` (when ``train`` began)."""
    cfg = run.cfg
    state = run.state
    train_bits = run.corpus.bits_per_byte(1.0, "train")    # bits per byte of a nat per token
    start = int(state.step)
    end = min(stacking.stage_end(start, run.total_steps, run.stack_ends), run.stop_step)
    if previous is None:
        dropped = (truncate_metrics(os.path.join(run.run_dir, "metrics.jsonl"), start)
                   if cfg.run.resume and jax.process_index() == 0 else 0)
        if dropped:
            announce(cfg, f"metrics.jsonl: {dropped} record(s) after the checkpoint of step "
                          f"{start} removed (they are trained again)")
        trackers = (open_trackers(tracker_names(cfg.run.trackers), run.run_dir,
                                  config=to_dict(cfg), project=cfg.run.wandb_project,
                                  wandb_mode=cfg.run.wandb_mode)
                    if jax.process_index() == 0 else [])
        writer = MetricsWriter(run.run_dir, jax.process_index(), trackers=trackers)
        first_step, history, totals = start, [], {"real": 0, "positions": 0}
    else:
        writer, first_step = previous.writer, previous.first_step
        history, totals = previous.history, previous.totals
    watch = Stopwatch(previous.train_s if previous else 0.0)
    window = []         # the metrics of the steps since the last log step, not yet fetched
    late = []           # the last log step and its window: fetched at the next log step
    interrupted = None
    feed = DevicePrefetcher(run.stream, sharding=run.batch_layout, depth=cfg.data.prefetch)
    progress = _progress_bar(run.total_steps, first_step, cfg.run.progress)

    sampler = getattr(run.stream, "sampler", None)      # importance sampling's score table
    recent = collections.deque(maxlen=cfg.run.time_step)    # the batches step_alone replays
    profiler = (profiling.StepProfiler(profiling.parse_window(cfg.run.profile),
                                       os.path.join(run.run_dir, "profile"))
                if cfg.run.profile is not None else None)

    def position():
        """The loader's position after the last step, the sampler's scores with it."""
        if sampler is None:
            return feed.position
        sampler.flush()
        return {**feed.position, "sampler": sampler.state()}

    def log_late():
        """Write the window of the log step before: fetching it then waits for a step the
        device finished long ago (or, if the host ran far ahead, for one with later steps
        queued behind it), so the device's queue never drains at a log step. The seconds are
        those when its last step's metrics arrived."""
        if late:
            step, metrics = late.pop()
            jax.block_until_ready(metrics[-1])
            history.extend(_log_window(writer, step, metrics, totals, watch.elapsed(),
                                       progress, train_bits))

    def save(step):
        log_late()
        pending = [(float(loss), float(tokens)) for loss, tokens in
                   jax.device_get([(m["loss"], m["real_tokens"]) for m in window])]
        kept = (run.restored_history + history + pending)[-recent_steps(run.total_steps):]
        run.checkpointer.save(step, state, loader_position=position(),
                              config=run.resume_config, history=kept)

    watch.start()
    with stop_on_signals() as received:
        for step in range(start, end):
            batch, _ = next(feed)
            recent.append(batch)
            if profiler is not None:
                profiler.before(step, state)
            state, metrics = steps.train(state, batch)
            if profiler is not None:
                profiler.after(step, state)
            if previous is None and step == start and wall_start is not None:
                _time_first_step(run, metrics, wall_start, progress)
            if sampler is not None:
                sampler.submit(step, metrics)
            window.append(metrics)
            done = step + 1
            if done % max(cfg.run.log_every, 1) == 0 or done == run.total_steps:
                log_late()
                late.append((done, window))
                window = []
            if cfg.run.eval_every and done % cfg.run.eval_every == 0 and done < run.total_steps:
                watch.pause(state)
                log_late()
                loss, tokens = run_eval(run, steps, state, writer, done, cfg.run.eval_batches)
                announce(cfg, f"eval at step {done}: loss {loss:.4f}, "
                              f"{run.corpus.bits_per_byte(loss):.3f} bits per byte over "
                              f"{tokens:,} tokens",
                         progress)
                watch.start()
            stop = received.get("signum") or (should_stop is not None and should_stop(done)
                                              and STOP_REQUESTED)
            if jax.process_count() > 1:     # every process stops at the same step, or none
                at_log = done % max(cfg.run.log_every, 1) == 0 or done == end
                stop = agreed_stop(stop) if at_log else None
            if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or stop:
                watch.pause(state)
                save(done)
                watch.start()
            if stop:
                interrupted = ("requested" if stop == STOP_REQUESTED
                               else signal.Signals(stop).name)
                break
        watch.pause(state)
        log_late()
        if window:
            history += _log_window(writer, int(state.step), window, totals, watch.seconds,
                                   progress, train_bits)
        save(int(state.step))
    final_position = position()
    if profiler is not None:
        profiler.close()
    if sampler is not None:
        sampler.close()
    feed.close()
    if progress is not None:
        progress.close()
    waited = feed.wait_seconds + (previous.data_wait_s if previous else 0.0)
    report = (profiler.report if profiler is not None else None) or (
        previous.profile if previous is not None else None)
    return Progress(state, first_step, totals, history, watch.seconds, waited, interrupted,
                    writer, final_position, report, list(recent))


STOP_REQUESTED = -1      # ``should_stop`` asked for the stop (a signal: its number)


def agreed_stop(local: int | None) -> int | None:
    """The stop every process of a multi-process run agrees on, from each one's ``local``
    reason (a signal number, ``STOP_REQUESTED`` or None): a signal any process received (the
    highest number), else a requested stop, else None. A collective over the processes, so
    all call it at the same steps: the log steps, where the loop waits for the device anyway.
    SIGTERM to one host (a preemption notice) thus stops every host at the same step with a
    checkpoint, as JAX's preemption sync point would, and SIGINT likewise."""
    from jax.experimental import multihost_utils

    codes = np.asarray(multihost_utils.process_allgather(np.int32(local or 0))).reshape(-1)
    if (codes > 0).any():
        return int(codes.max())
    return STOP_REQUESTED if (codes == STOP_REQUESTED).any() else None


def grow_run(run: Setup, progress: Progress) -> Setup:
    """The next progressive-stacking stage: the model twice as deep, its state grown from the
    trained one (``stacking.grow``), the loader continuing from its position."""
    cfg = _with_layers(run.cfg, 2 * run.cfg.model.n_layers)
    state, shardings = abstract_sharded_state(cfg.model, run.optimizer, cfg.run.seed,
                                              cfg.make_loss_scale(), run.mesh, cfg.policy())
    state = jax.device_put(stacking.grow(progress.state, state, run.cfg.model.n_layers),
                           shardings)
    stream = open_stream(cfg, run.corpus.train, run.stream_args, progress.position)
    plan = run.plan
    if cfg.run.memory_budget is not None:
        cfg, plan = _plan_remat(cfg, run.optimizer, state, stream, run.batch_layout)
    progress.writer.write(int(state.step), "stack", {"n_layers": cfg.model.n_layers})
    return dataclasses.replace(run, cfg=cfg, state=state, shardings=shardings, stream=stream,
                               plan=plan, stages=[*run.stages, [int(state.step),
                                                                cfg.model.n_layers]])


def run_eval(run: Setup, steps: Steps, state, writer, step: int, max_batches):
    """Evaluate on the validation split and log it; (mean loss in nats, tokens)."""
    loss, tokens = evaluate(steps.eval, state, run.corpus.val, seq_len=run.cfg.seq_len,
                            batch_size=run.eval_batch_size, max_batches=max_batches,
                            sharding=run.batch_layout)
    writer.write(step, "eval", {"loss": loss, "bpb": run.corpus.bits_per_byte(loss),
                                "tokens": tokens})
    return loss, tokens


def evaluate(eval_step, state, documents, *, seq_len: int, batch_size: int,
             max_batches: int | None = None, sharding=None) -> tuple[float, int]:
    """Mean loss in nats per target token over the documents (in order), and the token count.

    With ``max_batches`` only that many batches count, spread evenly over the split (the same
    ones every time), so a partial evaluation samples all of it rather than its first files.
    Each process makes its own rows of every batch; ``sharding`` lays the global batch out.
    """
    def fixed_batches():
        return batches(documents, strategy="fixed", seq_len=seq_len, batch_size=batch_size,
                       shuffle=False, process_index=jax.process_index(),
                       process_count=jax.process_count())

    chosen = None
    if max_batches:
        count = sum(1 for _ in fixed_batches())
        chosen = set(np.linspace(0, count - 1, min(max_batches, count)).round().astype(int))
    loss_sum, weight_sum = 0.0, 0.0
    for i, batch in enumerate(fixed_batches()):
        if chosen is not None and i not in chosen:
            continue
        sums = eval_step(state, place_batch(batch, sharding))
        loss_sum, weight_sum = loss_sum + sums["loss_sum"], weight_sum + sums["weight_sum"]
    loss_sum, weight_sum = jax.device_get((loss_sum, weight_sum))
    return float(loss_sum) / max(float(weight_sum), 1.0), int(weight_sum)


@contextlib.contextmanager
def stop_on_signals():
    """Turn the first SIGINT/SIGTERM into a request to stop; a second SIGINT interrupts at once."""
    received = {}

    def handler(signum, frame):
        if signum == signal.SIGINT and received:
            raise KeyboardInterrupt
        received.setdefault("signum", signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Stopwatch:
    """Seconds of training only: paused around evaluation and checkpoints."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self._start = seconds, None

    def start(self):
        self._start = time.perf_counter()

    def pause(self, *pending):
        jax.block_until_ready(pending)
        self.seconds = self.elapsed()
        self._start = None

    def elapsed(self) -> float:
        running = time.perf_counter() - self._start if self._start is not None else 0.0
        return self.seconds + running


def _progress_bar(total_steps: int, first_step: int, enabled: bool):
    """A tqdm bar on a terminal; off one (a batch job, a pipe) plain lines (``LineProgress``)."""
    if not enabled:
        return None
    if not sys.stderr.isatty():
        return LineProgress(total_steps, first_step)
    from tqdm import tqdm
    return tqdm(total=total_steps, initial=first_step, desc="train", unit="step",
                dynamic_ncols=True)


class LineProgress:
    """Progress off a terminal: one plain line per logged step on stderr (step, loss, bits per
    byte, real tokens/s, elapsed training seconds), no carriage returns; tqdm's interface as
    the loop uses it."""

    def __init__(self, total: int, initial: int):
        self.total, self.n = total, initial

    def update(self, steps: int):
        self.n += steps

    def set_postfix(self, *, seconds: float | None = None, **values):
        fields = "  ".join(f"{key} {value}" for key, value in values.items())
        elapsed = f"  elapsed {seconds:.1f} s" if seconds is not None else ""
        self.write(f"step {self.n}/{self.total}  {fields}{elapsed}")

    @staticmethod
    def write(line: str):
        print(line, file=sys.stderr, flush=True)

    def close(self):
        pass


def _time_first_step(run: Setup, metrics, began: float, progress):
    """Wait for the run's first step; record and announce the start-up phases' seconds."""
    before = time.perf_counter()
    jax.block_until_ready(metrics)
    now = time.perf_counter()
    startup = run.startup
    startup["first_step"] = now - before
    startup["to_first_step"] = now - began
    age = _process_age()
    if age is not None:
        startup["command_to_first_step"] = age
    announce(run.cfg, "start-up: " + ", ".join(
        f"{name.replace('_', ' ')} {startup[name]:.1f} s" for name in STARTUP_PHASES
        if name in startup), progress)


# The start-up phases, in order: set-up before the corpus (mesh, distributed), corpus, the
# sharded initialisation, compiling the steps, the first step (dispatch to its result), train()
# to the first step's result, and the process's start (imports included) to it.
STARTUP_PHASES = ("before_set_up", "corpus", "init", "compile", "first_step", "to_first_step",
                  "command_to_first_step")


def _process_age() -> float | None:
    """Seconds since this process started (Linux /proc), None where that is not known."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def announce(cfg: TrainConfig, line: str, progress=None):
    """A phase of the run (set-up, compiling, evaluation) as one line on stdout where progress
    is shown (``run.progress``; process 0), past a terminal's bar while one is open; stderr
    keeps the progress lines and errors."""
    if not cfg.run.progress or jax.process_index() != 0:
        return
    if progress is not None and not isinstance(progress, LineProgress):
        progress.write(line, file=sys.stdout)
    else:
        print(line, flush=True)


def _log_window(writer, step, window, totals, seconds, progress, bits_per_nat: float
                ) -> list[tuple[float, float]]:
    """Write the mean metrics of the last steps; return their (loss, tokens) per step.
    ``bits_per_nat`` turns a loss per target token into bits per byte of the train text.

    ``totals`` counts the run's real tokens and token positions so far (of the global batches,
    as the step's metrics count them); ``seconds`` is the training time so far.
    """
    fetched = jax.device_get(window)
    losses = np.array([m["loss"] for m in fetched], dtype=np.float64)
    tokens = np.array([m["real_tokens"] for m in fetched], dtype=np.float64)
    padded = np.array([m["padded_tokens"] for m in fetched], dtype=np.float64)
    totals["real"] += int(tokens.sum())
    totals["positions"] += int(tokens.sum() + padded.sum())
    tokens_per_s = totals["real"] / max(seconds, 1e-9)
    loss = float(np.sum(losses * tokens) / max(tokens.sum(), 1.0))
    record = {
        "loss": loss, "bpb": loss * bits_per_nat,
        "grad_norm": float(fetched[-1]["grad_norm"]),
        "update_norm": float(fetched[-1]["update_norm"]),
        "loss_scale": float(fetched[-1]["loss_scale"]),
        "skipped_steps": int(fetched[-1]["skipped_steps"]),
        "learning_rate": float(fetched[-1]["learning_rate"]),
        "real_tokens": int(tokens.sum()),
        "padding_efficiency": float(tokens.sum() / max(tokens.sum() + padded.sum(), 1.0)),
        "real_tokens_per_s": tokens_per_s,
        "train_s": seconds,
    }
    writer.write(step, "train", record)
    if progress is not None:
        progress.update(step - progress.n)
        extra = {"seconds": seconds} if isinstance(progress, LineProgress) else {}
        progress.set_postfix(loss=f"{loss:.3f}", bpb=f"{record['bpb']:.2f}",
                             tok_s=f"{tokens_per_s:,.0f}", **extra)
    return list(zip(losses.tolist(), tokens.tolist()))


# =============================================================================================
# Phase 4: finish. Final evaluation, loss plot, the summary.

def finish(run: Setup, compiled: list, progress: Progress, wall_start: float,
           fp8_note: str | None = None) -> RunSummary:
    """The final evaluation, the plot and the summary; ``compiled`` holds the steps of every
    progressive-stacking stage (one without), the last being the model's final depth."""
    cfg, state, steps = run.cfg, progress.state, compiled[-1]
    final_step = int(state.step)
    paused = not progress.interrupted and final_step < run.total_steps    # run.stop_at
    if progress.interrupted or paused:
        val_loss, val_tokens = float("nan"), 0
    else:
        announce(cfg, f"final evaluation: {cfg.run.final_eval_batches or 'all'} validation "
                      f"batches of {run.eval_batch_size} rows")
        val_loss, val_tokens = run_eval(run, steps, state, progress.writer, final_step,
                                        cfg.run.final_eval_batches)
    progress.writer.close()
    run.checkpointer.close()
    unigram_bpb = run.corpus.unigram_bits_per_byte()
    if jax.process_index() == 0:
        plot_loss_curve(read_metrics(progress.writer.path), os.path.join(run.run_dir, "loss.png"),
                        unigram_bpb=unigram_bpb,
                        title=f"{describe_model(cfg.model)} on {cfg.data.path}, "
                              f"{cfg.data.batching}")
    totals, train_s = progress.totals, progress.train_s
    kept = sd_kept_fraction(cfg, run.mesh_shape)
    flops_token = run_flops_per_token(run, final_step, progress.first_step, kept)
    tokens_per_s = totals["real"] / train_s if train_s > 0 else float("nan")
    peak = hardware.peak_flops()
    stats = run.stream.stats
    summary = RunSummary(
        steps=final_step, steps_this_run=final_step - progress.first_step,
        interrupted=progress.interrupted, stopped_at=final_step if paused else None,
        total_steps=run.total_steps, run_dir=run.run_dir,
        batching=cfg.data.batching, shapes=[list(shape) for shape in run.stream.global_shapes],
        real_tokens=totals["real"],
        padding_efficiency=totals["real"] / max(totals["positions"], 1),
        epoch_padding_efficiency=stats["padding_efficiency"],
        split_documents=stats["split_documents"],
        empty_documents_skipped=run.corpus.stats["empty_documents_skipped"],
        inputs_skipped=skipped_inputs(run.corpus.stats),
        extended_from_steps=run.extended_from_steps,
        startup_s={k: round(v, 3) for k, v in run.startup.items()} or None,
        profile=dataclasses.asdict(progress.profile) if progress.profile else None,
        data_wait_s=progress.data_wait_s,
        train_bpb=_recent_bpb(run.restored_history + progress.history, final_step,
                              run.corpus.bits_per_byte(1.0, "train")),
        val_loss=val_loss,
        val_bpb=run.corpus.bits_per_byte(val_loss), val_tokens=val_tokens, unigram_bpb=unigram_bpb,
        real_tokens_per_s=tokens_per_s, flops_per_token=flops_token,
        achieved_flops_per_s=tokens_per_s * flops_token,
        mfu=tokens_per_s * flops_token / peak if peak else None,
        compiles=sum(c.train.compiles for c in compiled),
        compiles_after_warmup=sum(c.train.compiles - c.warm_compiles for c in compiled),
        compile_s=sum(c.train.compile_seconds for c in compiled),
        eval_compiles=sum(c.eval.compiles for c in compiled), step_memory_bytes=largest_memory_bytes(steps.train),
        peak_memory_bytes=hardware.peak_memory_bytes(),
        wall_s=time.perf_counter() - wall_start, train_s=train_s,
        model=describe_model(cfg.model), params=count_params(state.params),
        attention=cfg.model.attention, remat=cfg.model.remat,
        scan_layers=cfg.model.scan_layers,
        remat_plan=dataclasses.asdict(run.plan) if run.plan else None,
        precision=cfg.policy().name, matmul_precision=cfg.precision.matmul,
        loss_scale=float(state.loss_scale.loss_scale),
        skipped_steps=int(state.loss_scale.skipped_steps), optimizer=cfg.optimizer.name,
        learning_rate=run.hyperparameters["learning_rate"],
        weight_decay=run.hyperparameters["weight_decay"], batch_rows=cfg.batch_rows(),
        accumulate=cfg.optimizer.accumulate, optimizer_state_bytes=state_bytes(state.opt_state),
        sharding=cfg.mesh.strategy, mesh=run.mesh_shape, mesh_axis_types=cfg.mesh.axis_types,
        pipeline_schedule=cfg.mesh.pipeline_schedule if pipelined(cfg.mesh.strategy) else None,
        pipeline_bubble=bubble_fraction(run.mesh_shape["stage"], cfg.optimizer.accumulate)
        if pipelined(cfg.mesh.strategy) else None,
        init=cfg.model.init, stochastic_depth=cfg.model.stochastic_depth,
        stochastic_depth_kept=kept,
        progressive_stages=run.stages if cfg.run.progressive_stack > 1 else None,
        trainable_params=lora.count(state.params, cfg.model)[0], init_from=cfg.run.init_from,
        process_count=jax.process_count(),
        param_opt_bytes_per_device=bytes_per_device((state.params, state.opt_state)),
        device=hardware.describe(), jax_version=jax.__version__, fp8=fp8_note,
        fp8_gemms=fp8.fp8_gemms(steps.train.executables) if cfg.model.fp8 else None,
        sparsity=cfg.model.sparsity,
        sparsity_density=sparsity.density(state.params) if cfg.model.sparsity != "none" else None,
        sampling=cfg.data.sampling,
        diverged_at_step=diverged_at(progress.history, progress.first_step,
                                     None if progress.interrupted or paused else val_loss,
                                     final_step))
    if progress.recent_batches and not progress.interrupted:     # last: it consumes the state
        summary.step_alone = step_alone(steps, state, progress.recent_batches, tokens_per_s)
    return summary


def step_alone(steps: Steps, state, batches: list, loop_tokens_per_s: float) -> dict:
    """The compiled train step timed alone on ``batches`` (the run's last ones, already on the
    device, the step warm): no data loading, logging, evaluation or checkpoints in between, one
    wait at the end. Its real tokens/s, and the loop's as a share of it (issue 16's target:
    >= 95 % on a GPU). ``state`` is donated to the steps, so this is the last use of it."""
    jax.block_until_ready(state)
    begin = time.perf_counter()
    metrics = []
    for batch in batches:
        state, m = steps.train(state, batch)
        metrics.append(m["real_tokens"])
    jax.block_until_ready(state)
    seconds = time.perf_counter() - begin
    tokens = float(sum(jax.device_get(metrics)))
    alone = tokens / seconds
    return {"steps": len(batches), "real_tokens_per_s": alone, "seconds": seconds,
            "loop_share": loop_tokens_per_s / alone}


def diverged_at(history: list[tuple[float, float]], first_step: int, val_loss: float | None,
                final_step: int) -> int | None:
    """The step from which this run's training loss stayed NaN or inf to its end (``history``
    holds one (loss, tokens) per step from ``first_step``), else the final step if the final
    evaluation's loss (None: none ran) was not finite; None otherwise. A non-finite loss the
    run recovered from (a float16 overflow that dynamic loss scaling skipped) is no failure."""
    streak = None
    for i, (loss, _) in enumerate(history):
        if math.isfinite(loss):
            streak = None
        elif streak is None:
            streak = first_step + i + 1
    if streak is not None:
        return streak
    if val_loss is not None and not math.isfinite(val_loss):
        return final_step
    return None


def sd_kept_fraction(cfg: TrainConfig, mesh_shape: dict) -> float:
    """The share of block computation stochastic depth keeps, at the rows a step's model call
    sees (a microbatch), chosen per batch shard."""
    return kept_fraction(cfg.model.stochastic_depth, cfg.model.n_layers,
                         cfg.batch_rows() // cfg.optimizer.accumulate, batch_shards(mesh_shape))


def run_flops_per_token(run: Setup, final_step: int, first_step: int, kept: float) -> float:
    """Training FLOPs per token of this run's steps: a progressive-stacking run's stages each
    count at their depth, weighted by their steps."""
    starts = [start for start, _ in run.stages] + [final_step]
    weighted, total = 0.0, 0
    for (start, depth), end in zip(run.stages, starts[1:]):
        steps = max(end - max(start, first_step), 0)
        weighted += steps * flops_per_token(_with_layers(run.cfg, depth).model, run.cfg.seq_len,
                                            kept)
        total += steps
    if total == 0:
        return flops_per_token(run.cfg.model, run.cfg.seq_len, kept)
    return weighted / total


def recent_steps(steps: int) -> int:
    """How many of a run's last steps its train bits per byte covers: the last tenth, at least
    one (the checkpoints keep that many steps' losses)."""
    return max(1, steps // 10)


def _recent_bpb(history: list[tuple[float, float]], steps: int, bits_per_nat: float) -> float:
    """Token-weighted training bits per byte over the last tenth of the run's ``steps`` (at
    least one); ``history`` holds the (loss, real tokens) of the steps before the last, a
    resumed run's starting with those its checkpoint kept, so a resumed run reports what an
    uninterrupted one would."""
    if not history:
        return float("nan")
    recent = history[-recent_steps(steps):]
    loss = sum(l * t for l, t in recent) / max(sum(t for _, t in recent), 1.0)
    return loss * bits_per_nat

