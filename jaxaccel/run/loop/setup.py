"""Phase 1 of a run, set-up: the run directory, the data, the optimizer, the model's sharded
state (with every technique applied), the checkpoint (restored on resume)."""

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import glob
import math
import os
import shlex
import shutil
import socket
import sys
import time

import jax

from jaxaccel.model import contract as model_lib, nn
from jaxaccel.techniques import registry as techniques
from jaxaccel.run.checkpoint import Checkpointer
from jaxaccel.run.config import check_json_outputs, check_writable, field_value, override, \
    stop_step, to_dict, write_config
from jaxaccel.data.corpus import corpus_of
from jaxaccel.data.batching import DataStream
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import prefetch_depth
from jaxaccel.run.loop.compile import check_scores, compiled_steps, eval_microbatches, plan_memory
from jaxaccel.run.loop.console import announce, note
from jaxaccel.run.loop.record import base_weights, run_environment
from jaxaccel.step.optim import build_optimizer
from jaxaccel.core.report import dump_json
from jaxaccel.data.sampling import SampledStream, lag as sampling_lag
from jaxaccel.core.sections import absolute_name, is_preset
from jaxaccel.core.sharding import batch_shards, batch_sharding, format_mesh, param_shardings, \
    parse_axis_rules
from jaxaccel.step.state import compile_init, lower_state, state_maker

RUNS_ROOT = "runs"
LOCK_FILE = "run.lock"      # in the run directory: held (flock) by the run writing it
# Sections (techniques.resume_sections: the model's, the step's and the techniques' whose record
# says so) and fields a resumed run must share with its checkpoint: they shape the state, the
# data order or the optimizer's trajectory, so changing them would silently break the run.
RESUME_FIELDS = ("data.path", "data.batching", "run.seed", "run.init_from", "data.sampling",
                 "data.sampling_power", "data.sampling_floor", "mesh.axis_rules")


@dataclasses.dataclass
class Setup:
    cfg: object                 # remat.policy as the memory budget chose it
    mesh: object
    mesh_shape: dict
    run_dir: str
    corpus: object
    stream: object
    total_steps: int
    optimizer: object
    schedule: object
    hyperparameters: dict
    model: object               # the model of this stage, abstract: its graph and variables
    state: object
    shardings: object
    batch_layout: object
    plan: object
    resume_config: dict
    checkpointer: Checkpointer
    eval_batch_size: int
    stream_args: dict
    full_layers: int | None     # the stack's depth when every stacking stage has grown
    stack_ends: list            # the steps where progressive stacking doubles the depth
    stop_step: int              # the step this invocation ends at: run.stop_at, else the last
    stages: list                # [first step, depth] of each stage this run has trained
    extended_from_steps: int | None = None  # a resumed run given another length: the old one
    startup: dict = dataclasses.field(default_factory=dict)  # seconds of each start-up phase
    restored_history: list = dataclasses.field(default_factory=list)  # the checkpoint's losses
    precompiled: object = None  # the first stage's Steps, compiled before the state was made


def set_up(cfg, mesh, mesh_shape, full_model, run_dir: str) -> Setup:
    """Phase 1 in ``run_dir``, the directory ``claimed_run_dir`` locked for the run."""
    multiple = batch_shards(mesh_shape) * cfg.optimizer.accumulate
    _check_batch_split(cfg, mesh_shape, multiple)
    check_scores(cfg, full_model, cfg.run.eval_batch_size or cfg.batch_rows())
    began = time.perf_counter()
    corpus = corpus_of(cfg.data)
    startup = {"corpus": time.perf_counter() - began}
    _keep_tokenizer(cfg, corpus.tokenizer, run_dir)
    stream_args = stream_settings(cfg, multiple)
    stream = open_stream(cfg, corpus.train, stream_args)
    total_steps = cfg.run.steps
    if cfg.run.train_tokens is not None:
        total_steps = max(1, math.ceil(cfg.run.train_tokens
                                       / stream.stats["real_tokens_per_batch"]))
    optimizer, schedule, hyperparameters = build_optimizer(
        cfg.optimizer, batch_rows=cfg.batch_rows(), total_steps=total_steps)
    stop = _checked_stop_step(cfg, run_dir, total_steps)
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"),
                                max_to_keep=cfg.run.keep_checkpoints,
                                keep_period=cfg.run.keep_every_steps,
                                asynchronous=cfg.run.async_checkpoint)
    check_checkpoint_meta(cfg, checkpointer)
    first_step = (checkpointer.latest_step() or 0) if cfg.run.resume else 0
    full_layers, stack_ends, depth = techniques.growth(cfg, full_model, total_steps, first_step)
    model = full_model if depth in (None, full_layers) else techniques.abstract(cfg, depth=depth)
    # The steps are compiled, and their memory checked, from the state's shapes before the
    # state is made: a run that cannot fit is refused before it allocates anything large.
    planned = _plan_state(cfg, mesh, depth, optimizer)
    shapes, shardings = planned.shapes, planned.shardings
    plan, full_cfg = None, cfg
    resume_config = {**resume_settings(full_cfg, stream_args, total_steps, multiple),
                     "data.corpus_fingerprint": corpus.fingerprint}
    if cfg.run.resume:      # the checkpoint's settings and shapes, before any compile
        restoring = check_resumed_model(cfg, checkpointer, resume_config, shapes, run_dir)
    batch_layout = batch_sharding(mesh)
    if cfg.run.memory_budget is not None:
        cfg, model, plan = plan_memory(cfg, model, depth, optimizer, shapes, stream, batch_layout)
    eval_batch_size = _eval_batch_size(cfg, mesh_shape)
    steps, state = _compile_and_init(cfg, model, optimizer, schedule, mesh, planned,
                                     stream.global_shapes, eval_batch_size, startup)
    extended_from = None
    if cfg.run.resume:
        state, position, extended_from = _restore_checkpoint(
            cfg, checkpointer, state, resume_config, restoring, total_steps)
        stream = open_stream(cfg, corpus.train, stream_args, position)
    if jax.process_index() == 0:
        _write_run_record(full_cfg, run_dir, mesh_shape)
    depth_now = len(nn.the_stack(model, "")[1]) if nn.stacks(model) else None
    return Setup(cfg, mesh, mesh_shape, run_dir, corpus, stream, total_steps, optimizer,
                 schedule, hyperparameters, model, state, shardings, batch_layout, plan,
                 resume_config, checkpointer, eval_batch_size, stream_args, full_layers,
                 stack_ends, stop, [[int(state.step), depth_now]], extended_from,
                 restored_history=checkpointer.saved_history if cfg.run.resume else [],
                 startup=startup, precompiled=steps)


def _check_batch_split(cfg, mesh_shape: dict, multiple: int):
    """One ConfigError line if the batch does not split into ``multiple`` parts: the mesh's
    data x fsdp shards times the accumulated microbatches."""
    if cfg.data.batch_size is not None and cfg.data.batch_size % multiple:
        raise ConfigError(
            f"batch_size={cfg.data.batch_size} does not split over the mesh's data x fsdp axes "
            f"({batch_shards(mesh_shape)} parts, {format_mesh(mesh_shape)}) times accumulate="
            f"{cfg.optimizer.accumulate}; pass a batch size that is a multiple of {multiple}",
            field="data.batch_size")


def _keep_tokenizer(cfg, tokenizer, run_dir: str):
    """The corpus's tokenizer checked against the model's vocabulary (one ConfigError line) and
    saved in ``run_dir`` (made here)."""
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {cfg.data.tokenizer} has {tokenizer.vocab_size} "
                          f"ids, more than the model's vocab_size={cfg.model.vocab_size}; build "
                          f"the config with config.build, which sets vocab_size from the "
                          f"tokenizer", field="model.vocab_size")
    os.makedirs(run_dir, exist_ok=True)
    if jax.process_index() == 0:
        tokenizer.save(run_dir)         # the run keeps the tokenizer it trains with


def _checked_stop_step(cfg, run_dir: str, total_steps: int) -> int:
    """Before any work: the step this invocation stops at (``run.stop_at``, else the last), and
    ``run.profile``'s window checked to lie within its steps."""
    resumed = max(_saved_steps(run_dir), default=0) if cfg.run.resume else 0
    stop = (stop_step(cfg.run.stop_at, total_steps, resumed) if cfg.run.stop_at is not None
            else total_steps)
    if cfg.run.profile is not None:
        from jaxaccel.run import profiling
        profiling.check_window(cfg.run.profile, resumed, stop)
    return stop


@dataclasses.dataclass
class _StatePlan:
    """The state at one depth, before it is made."""
    make: object        # state_maker's function
    shapes: object      # ShapeDtypeStructs carrying their shardings
    shardings: object
    base: tuple         # the weights it starts from (run.init_from's, on the mesh), else ()


def _plan_state(cfg, mesh, depth, optimizer) -> _StatePlan:
    """The state at ``depth`` (``state_maker``), not made: its shapes are what the steps
    compile for."""
    base, rules = (), parse_axis_rules(cfg.mesh.axis_rules)
    if cfg.run.init_from is not None and not cfg.run.resume:
        weights = base_weights(cfg.run.init_from, cfg)
        base = (jax.device_put(weights, param_shardings(mesh, weights, rules)),)
    make_state, shapes, shardings = state_maker(techniques.variables(cfg, depth), optimizer,
                                                cfg.run.seed, cfg.make_loss_scale(), mesh,
                                                cfg.policy(), rules, base)
    shapes = jax.tree.map(lambda s, x: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), x), shardings, shapes)
    return _StatePlan(make_state, shapes, shardings, base)


def _compile_and_init(cfg, model, optimizer, schedule, mesh, planned: _StatePlan,
                      batch_shapes, eval_batch_size: int, startup: dict):
    """The compiled steps and the state made, the seconds of each in ``startup``."""
    begin = time.perf_counter()
    # The state's initialisation compiles on a thread of its own while the steps compile (XLA
    # leaves the GIL while it compiles); it runs once the steps' memory has been checked.
    init = lower_state(planned.make, planned.shardings, cfg.run.seed, planned.base)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        init = pool.submit(compile_init, init)
        steps = compiled_steps(cfg, model, optimizer, schedule, planned.shardings, mesh,
                               planned.shapes, batch_shapes, eval_batch_size)
        startup["compile"] = time.perf_counter() - begin
        begin = time.perf_counter()
        state = init.result()(jax.random.PRNGKey(cfg.run.seed), *planned.base)
    jax.block_until_ready(state)
    startup["init"] = time.perf_counter() - begin
    return steps, state


def _eval_batch_size(cfg, mesh_shape: dict) -> int:
    """The evaluation's rows: ``run.eval_batch_size`` (else the training batch's) rounded up to
    split over the batch shards, the evaluation's microbatches and the processes."""
    eval_multiple = math.lcm(batch_shards(mesh_shape) * eval_microbatches(cfg),
                             jax.process_count())
    eval_batch_size = cfg.run.eval_batch_size or cfg.batch_rows()
    return -(-eval_batch_size // eval_multiple) * eval_multiple


def _restore_checkpoint(cfg, checkpointer: Checkpointer, state, resume_config: dict,
                       restoring: dict, total_steps: int):
    """On resume: the checkpoint's (state, loader position) restored into ``state``, and the
    run's former length if it changes (else None); ConfigError if it is cut below the step."""
    state, position, restored = checkpointer.restore(state, config=resume_config, **restoring)
    saved_steps = checkpointer.saved_config.get("run.steps", total_steps)
    if saved_steps == total_steps:
        return state, position, None
    if total_steps < restored:
        raise ConfigError(f"steps={total_steps} is below the checkpoint's step "
                          f"{restored}; resume with at least that many steps",
                          field="run.steps")
    announce(cfg, f"the run's length changes from {saved_steps} to {total_steps} "
                  f"steps: the learning-rate schedule follows the new length")
    return state, position, saved_steps


def _write_run_record(cfg, run_dir: str, mesh_shape: dict):
    """The run's config (without ``run.stop_at``: a pause is not the run's setting) and its
    environment, in ``run_dir``."""
    write_config(override(cfg, {"run.stop_at": None}), run_dir, shlex.join(sys.orig_argv))
    dump_json(os.path.join(run_dir, "environment.json"), run_environment(mesh_shape))


def check_checkpoint_meta(cfg, checkpointer: Checkpointer):
    """Before any work: one ConfigError line if the metadata of the checkpoint that the run
    resumes from, or of the latest one of the run ``init_from`` names, is not JSON or lacks
    what a restore reads (``Checkpointer.check_meta``)."""
    if cfg.run.resume:
        checkpointer.check_meta()
    elif cfg.run.init_from is not None and os.path.isdir(
            os.path.join(cfg.run.init_from, "checkpoints")):
        base = Checkpointer(os.path.join(cfg.run.init_from, "checkpoints"))
        try:
            base.check_meta(field="run.init_from")
        finally:
            base.close()


def check_resumed_model(cfg, checkpointer: Checkpointer, resume_config: dict, shapes,
                        run_dir: str) -> dict:
    """Before any work on resume: one ConfigError line if the latest checkpoint was written
    with other settings, or if its arrays do not fit the state's ``shapes`` (the parameters
    that differ, the model's file: the checkpoints are intact); else a warning line if the
    model's source changed since. A factory's file may have moved (the same function, its
    source compared). Returns ``Checkpointer.restore``'s keyword arguments for this run."""
    saved = (checkpointer.check_meta() or {}).get("config", {}).get("model.name")
    name = resume_config["model.name"]
    moved = (saved is not None and not is_preset(saved) and not is_preset(name)
             and saved.rpartition(":")[2] == name.rpartition(":")[2])
    may_differ = ("run.steps", "model.source", *(("model.name",) if moved else ()))
    step, meta = checkpointer.check_settings(resume_config, may_differ)
    recorded = meta["config"].get("model.source")
    file = (model_lib.source_of(name) or {}).get("file")
    restoring = dict(may_differ=may_differ, model=model_lib.describe_source(name, recorded),
                     fix=(f"restore {file} as it was when the run trained, or start a new "
                          f"run_dir" if file else
                          "restore the model as it was when the run trained, or start a new "
                          "run_dir"))
    checkpointer.check_fits(shapes, step, model=restoring["model"], fix=restoring["fix"])
    warning = model_lib.source_warning(recorded, name, run_dir)
    if warning and jax.process_index() == 0:
        print(warning, file=sys.stderr)
    return restoring


@contextlib.contextmanager
def claimed_run_dir(cfg):
    """The run directory (``resolve_run_dir``), locked while the run writes it (process 0:
    ``lock_run_dir``) and checked under the lock: an unfinished checkpoint a killed run left is
    removed, said; a new run is refused where another run left checkpoints or its summary."""
    run_dir = resolve_run_dir(cfg)
    lock = lock_run_dir(run_dir) if jax.process_index() == 0 else None
    try:
        remove_unfinished_checkpoints(os.path.join(run_dir, "checkpoints"), cfg)
        if not cfg.run.resume:
            check_new_run_dir(run_dir)
        yield run_dir
    finally:
        if lock is not None:
            lock.close()        # the kernel drops the flock with the file (and with the process)


def resolve_run_dir(cfg) -> str:
    """The run directory: the given one, the latest run (on resume) or a new timestamped one,
    made here so that no other run can take the same name."""
    run_dir, resume = cfg.run.run_dir, cfg.run.resume
    if run_dir is not None:
        return run_dir
    if resume:
        earlier = sorted(glob.glob(os.path.join(RUNS_ROOT, "train-*", "checkpoints", "*")))
        if not earlier:
            raise ConfigError(f"resume found no earlier run under {RUNS_ROOT}/; pass its run_dir",
                              field="run.run_dir")
        return os.path.dirname(os.path.dirname(earlier[-1]))
    stamp, suffix = time.strftime("train-%Y%m%d-%H%M%S"), 0
    if jax.process_count() > 1:     # every process names the same folder
        return os.path.join(RUNS_ROOT, stamp)
    os.makedirs(RUNS_ROOT, exist_ok=True)
    while True:
        run_dir = os.path.join(RUNS_ROOT, stamp + (f"-{suffix}" if suffix else ""))
        try:
            os.mkdir(run_dir)
            return run_dir
        except FileExistsError:
            suffix += 1


def lock_run_dir(run_dir: str):
    """Make ``run_dir`` and take its lock (an exclusive ``flock`` of ``run.lock``, which then
    names this process and host); the open file returned holds it. One ConfigError line naming
    the holder if another run holds it. The kernel releases it when the process ends, however it
    ends (a SIGKILL included), so no stale lock is ever left."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"cannot lock {path} ({e.strerror}); choose a run_dir on a file "
                              f"system that supports locks", field="run.run_dir") from None
        raise ConfigError(f"run dir {run_dir} is in use by another run ({holder}); wait for it "
                          f"to end, or choose another run_dir", field="run.run_dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()} since "
               f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    return lock


def check_new_run_dir(run_dir: str):
    """A new run (not resume) does not write into another run's record: ConfigError if
    ``run_dir`` holds checkpoints (continue it with resume) or a finished run's summary. The
    records of a run that saved no checkpoint are cut when the steps begin
    (``run.drop_unsaved_records``, said): that run cannot be continued, this one starts over."""
    if _saved_steps(run_dir):
        raise ConfigError(f"run dir {run_dir} already holds checkpoints; set resume to "
                          f"continue it or choose another run_dir", field="run.resume")
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        raise ConfigError(f"run dir {run_dir} holds the summary.json of a finished run (its "
                          f"checkpoints are gone); choose another run_dir", field="run.run_dir")


def _listdir(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


def _saved_steps(run_dir: str) -> list[int]:
    """The steps of the finished checkpoints in ``run_dir`` (read without creating anything)."""
    return [int(name) for name in _listdir(os.path.join(run_dir, "checkpoints"))
            if name.isdigit()]


def remove_unfinished_checkpoints(directory: str, cfg):
    """Delete, saying so, the temporary directories of checkpoints a run did not finish
    writing (killed, a full disk): they would keep the run from starting again or resuming.
    Called under the run directory's lock, so no running run is writing them."""
    if jax.process_index() != 0:
        return
    for name in _listdir(directory):
        if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            note(cfg, f"removed {os.path.join(directory, name)}: a checkpoint that was not "
                      f"finished (its run was stopped while writing it)")


def check_outputs(cfg):
    """ConfigError, before any work, for an output location this run cannot write: the run
    directory (or the nearest folder it would be made in) and the ``--json`` file's folder."""
    check_writable("run.run_dir", cfg.run.run_dir or RUNS_ROOT, may_create=True)
    checkpoints = os.path.join(cfg.run.run_dir or "", "checkpoints")
    if cfg.run.run_dir is not None and os.path.isdir(checkpoints):
        check_writable("run.run_dir", checkpoints, may_create=False)
    check_json_outputs(cfg)


def stream_settings(cfg, multiple: int) -> dict:
    """``DataStream``'s keyword arguments for this process; batches split into ``multiple``."""
    return dict(strategy=cfg.data.batching, seq_len=cfg.seq_len, seed=cfg.run.seed,
                process_index=jax.process_index(), process_count=jax.process_count(),
                data_parallel=multiple, **cfg.batching_options())


def open_stream(cfg, documents, stream_args: dict, position: dict | None = None):
    """The training stream from ``position``: a ``DataStream``, or a ``SampledStream``."""
    if cfg.data.sampling == "uniform":
        return DataStream(documents, position=position, **stream_args)
    d = cfg.data
    return SampledStream(documents, position=position, sampling=d.sampling,
                         power=d.sampling_power, floor=d.sampling_floor,
                         lag=sampling_lag(prefetch_depth(d)), **stream_args)


def resume_settings(cfg, stream_args: dict, total_steps: int, multiple: int) -> dict:
    """The settings a checkpoint records and a resumed run must match, by field path."""
    settings = {f"{section}.{name}": value for section, fields in to_dict(cfg).items()
                if section in techniques.resume_sections() for name, value in fields.items()}
    if not is_preset(cfg.model.name):   # where its factory is, and what its source was
        settings.update({"model.name": absolute_name(cfg.model.name),
                         "model.source": model_lib.source_of(cfg.model.name)})
    settings.update({path: field_value(cfg, path) for path in RESUME_FIELDS})
    settings.update(techniques.resume_values(cfg, total_steps))
    settings.update({f"data.{k}": v for k, v in cfg.batching_options().items()},
                    **{"data.seq_len": stream_args["seq_len"], "run.steps": total_steps})
    if cfg.data.sampling != "uniform":          # the sampler's lag follows the prefetch depth
        settings["data.prefetch"] = prefetch_depth(cfg.data)
    if cfg.data.tokens_per_batch is not None:   # token budgets round batches to this multiple
        settings["data.batch_multiple"] = math.lcm(multiple, jax.process_count())
    return settings
