"""The training loop: ``train(cfg)`` runs one training run of any model and returns its summary.

One file per phase, in the order they run:

0. here: join the other processes, check the settings, build the model abstractly with every
   technique and check it (``jaxaccel.model.nn``'s contract, remat tags, matmuls, the mesh's
   splits);
1. ``setup``: run directory, corpus, stream, optimizer, the sharded state, the checkpoint;
2. ``compile``: the train and eval steps for every batch shape, the OOM pre-flight;
3. ``run``: steps, metrics, evaluations, checkpoints, signals; progressive stacking's growth;
4. ``finish``: final evaluation, plot, summary (``record.RunSummary``); ``console``: the output.

A resumed run continues with the same state, batches and keys (on the CPU, bitwise as if never
interrupted). SIGINT and SIGTERM save a checkpoint and return with ``interrupted`` set, in the
final evaluation too. The run directory is locked while the run writes it, and its metrics hold
each step once. The state is sharded over a device mesh; each process loads only its own rows
of every batch.
"""

import contextlib
import dataclasses
import os
import sys
import time

import jax
from flax import nnx

from jaxaccel.run import compile_cache, probe
from jaxaccel.techniques import registry as techniques
from jaxaccel.core import hardware
from jaxaccel.model import contract as model_lib, nn
from jaxaccel.step import precision, trace
from jaxaccel.run.checkpoint import CheckpointWriteError
from jaxaccel.run.config import TrainConfig
from jaxaccel.data.loader import abstract_batch, abstract_key
from jaxaccel.run.loop.compile import Steps, compile_steps, memory_budget_bytes, sharded_steps, \
    train_step_of
from jaxaccel.run.loop.console import announce
from jaxaccel.run.loop.finish import diverged_at, finish
from jaxaccel.run.loop.record import RunSummary, read_config, read_trained_run
from jaxaccel.run.loop.run import STOP_REQUESTED, Progress, agreed_stop, evaluate, grow_run, \
    run_steps, stop_on_signals
from jaxaccel.run.loop.setup import RUNS_ROOT, Setup, check_outputs, claimed_run_dir, \
    resume_settings, set_up
from jaxaccel.techniques.pipeline import check as check_pipeline, check_layers
from jaxaccel.core.report import dump_json
from jaxaccel.core.sharding import build_mesh, check_split, format_mesh, initialize_distributed, \
    parse_axis_rules, pipelined, say_whole

__all__ = ["train", "RunSummary", "Setup", "Steps", "Progress", "evaluate", "preflight",
           "read_trained_run", "read_config", "resume_settings", "sharded_steps",
           "train_step_of", "diverged_at", "agreed_stop", "stop_on_signals", "STOP_REQUESTED",
           "RUNS_ROOT", "memory_budget_bytes"]


def train(cfg: TrainConfig, *, should_stop=None) -> RunSummary:
    """Run training as configured; return its summary. ``should_stop(step)`` returning True
    stops the run as a signal would. With ``mesh.coordinator`` (or ``mesh.distributed``) the
    processes first join through ``jax.distributed``, then each trains on its share."""
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
    notes = techniques.device_notes(cfg)
    mesh, mesh_shape = build_mesh(m.strategy, m.shape, m.axis_types, m.num_devices)
    if pipelined(m.strategy):
        check_pipeline(m.pipeline_schedule, mesh_shape["stage"], cfg.optimizer.accumulate)
    with jax.default_matmul_precision(cfg.precision.matmul), jax.set_mesh(mesh):
        model = preflight(cfg, mesh_shape)
        with claimed_run_dir(cfg) as run_dir:       # locked while this run writes it
            summary = _train_in(run_dir, cfg, mesh, mesh_shape, model, should_stop, wall_start,
                                notes)
            if jax.process_index() == 0:    # the run record: every run directory has its summary
                dump_json(os.path.join(run_dir, "summary.json"), dataclasses.asdict(summary))
    return summary


def _train_in(run_dir: str, cfg: TrainConfig, mesh, mesh_shape: dict, model, should_stop,
              wall_start: float, notes: dict) -> RunSummary:
    """Phases 1 to 4 in ``run_dir``. Whatever fails (a step, the final evaluation out of
    memory), a checkpoint being written is finished, not left a temporary directory, before the
    failure reaches the caller (a write failing then too is the unfinished checkpoint the next
    run removes, saying so)."""
    announce(cfg, f"set-up: corpus {cfg.data.path}, {model_lib.describe(cfg.model, cfg.gpt)} "
                  f"model, mesh {format_mesh(mesh_shape)}"
                  + (", resuming" if cfg.run.resume else ""))
    set_up_began = time.perf_counter()
    run = set_up(cfg, mesh, mesh_shape, model, run_dir)
    run.startup["before_set_up"] = set_up_began - wall_start
    try:
        progress, compiled = None, []
        while True:         # one stage, unless progressive stacking grows the model
            begin = time.perf_counter()
            compiled.append(compile_steps(run))
            run.startup.setdefault("compile", time.perf_counter() - begin)
            progress = run_steps(run, compiled[-1], should_stop, previous=progress,
                                 wall_start=wall_start)
            if (progress.interrupted or progress.target
                    or int(progress.state.step) >= run.stop_step):
                break
            run = grow_run(run, progress)
        return finish(run, compiled, progress, wall_start, notes, should_stop)
    except BaseException:
        with contextlib.suppress(CheckpointWriteError):
            run.checkpointer.close()
        raise


def preflight(cfg: TrainConfig, mesh_shape: dict):
    """The run's model, abstract, checked before any work (contract, mesh splits, remat tags: a
    ConfigError line for what does not fit; weights tensor parallelism keeps whole, and float32
    matmuls under a 16-bit policy: a warning line each); a model of one's own also by its first
    forward and backward (``jaxaccel.run.probe``)."""
    model = techniques.abstract(cfg)
    model_lib.check(model, cfg.model.name, vocab_size=cfg.model.vocab_size,
                    packed=cfg.data.batching == "pack", pipelined=pipelined(cfg.mesh.strategy))
    check_split(mesh_shape, nnx.state(model), parse_axis_rules(cfg.mesh.axis_rules),
                cfg.mesh.strategy)
    say_whole(mesh_shape, nnx.state(model), parse_axis_rules(cfg.mesh.axis_rules))
    if pipelined(cfg.mesh.strategy):
        check_layers(model, mesh_shape["stage"])
    graphdef, state = nnx.split(model)
    apply = precision.cast(model_lib.make_apply(
        graphdef, segment_attention=cfg.data.batching == "pack"), cfg.policy())
    rows = max(1, cfg.batch_rows() // cfg.optimizer.accumulate)
    jaxpr = jax.make_jaxpr(apply)(state, dict(abstract_batch((rows, min(cfg.seq_len, 64)))),
                                  abstract_key())
    techniques.check_model(cfg, model, trace.tags(jaxpr))
    warning = precision.float32_warning(trace.float32_matmuls(jaxpr), cfg.policy())
    if warning and jax.process_index() == 0:
        print(warning, file=sys.stderr)
    if not model_lib.is_preset(cfg.model.name):     # the presets' start-up is benchmarked
        probe_own_model(cfg, state)
    return model


def probe_own_model(cfg: TrainConfig, abstract_state) -> None:
    """``probe.check`` of the model of one's own, unless its weights would crowd one device
    (the probe holds them, unsharded, with their gradient): then said, and skipped."""
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_state))
    limit = hardware.memory_limit_bytes()
    if limit is not None and 3 * weight_bytes > limit // 2:
        if jax.process_index() == 0:
            print(f"note: the model's {weight_bytes:,} bytes of weights are too many for its "
                  f"first forward and backward on one device before the run, so its logits and "
                  f"gradient are not checked before the first step", file=sys.stderr)
        return
    probe.check(cfg.model, cfg.gpt, seq_len=cfg.seq_len, packed=cfg.data.batching == "pack",
                seed=cfg.run.seed)
