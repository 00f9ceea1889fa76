"""The training loop: data -> jitted pure step -> metrics, evaluation and checkpoints.

``train(config)`` runs one training run and returns its summary. It is deterministic: a run
resumed from a checkpoint continues with the same state, the same batches and the same keys, so
on the CPU it ends bitwise identical to an uninterrupted run. SIGINT and SIGTERM finish the step
in flight, save a checkpoint and return with ``summary["interrupted"]`` set.

The run happens on a device mesh (``jaxaccel.sharding``; one device is a mesh of one): the state
is created sharded, the steps are jitted with the state's and the batch's shardings, and with
several processes each loads and places only its own rows of every batch.
"""

import contextlib
import dataclasses
import glob
import math
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccel import hardware
from jaxaccel.checkpoint import Checkpointer
from jaxaccel.compiled import CompiledFn, abstract, largest_memory_bytes
from jaxaccel.config import TrainConfig
from jaxaccel.corpus import load_corpus
from jaxaccel.data import DataStream, batches
from jaxaccel.errors import ConfigError
from jaxaccel.loader import DevicePrefetcher, abstract_batch, place_batch
from jaxaccel.metrics import BITS_PER_NAT, MetricsWriter, plot_loss_curve, read_metrics
from jaxaccel.model import count_params, flops_per_token, init_params, make_apply, param_axes
from jaxaccel.optim import (decay_mask, make_optimizer, make_schedule, resolve_defaults,
                            scale_learning_rate, state_bytes)
from jaxaccel.planner import plan_remat
from jaxaccel.sharding import (batch_shards, batch_sharding, build_mesh, bytes_per_device,
                               format_mesh, initialize_distributed, param_shardings,
                               replicated, state_shardings)
from jaxaccel.train import init_state, make_eval_step, make_train_step

RUNS_ROOT = "runs"

# Settings a resumed run must share with its checkpoint: they shape the state, the data order or
# the optimizer's trajectory, so changing them would silently break the continuation.
RESUME_KEYS = ("data", "batching", "optimizer", "learning_rate", "schedule", "warmup_steps",
               "lr_scaling", "base_batch_size", "weight_decay", "no_decay", "clip_norm",
               "accumulate", "optimizer_state_dtype", "precision", "loss_scale",
               "loss_scale_init", "loss_scale_growth_interval", "loss_scale_growth_factor",
               "loss_scale_backoff", "loss_scale_min", "matmul_precision", "seed")


def resolve_run_dir(cfg: TrainConfig) -> str:
    """The run directory: the given one, the latest run (on --resume) or a new timestamped one."""
    if cfg.run_dir is not None:
        has_checkpoint = bool(glob.glob(os.path.join(cfg.run_dir, "checkpoints", "*")))
        if has_checkpoint and not cfg.resume:
            raise ConfigError(
                f"run dir {cfg.run_dir} already holds checkpoints; pass --resume to continue it or "
                f"choose another --run-dir")
        return cfg.run_dir
    if cfg.resume:
        earlier = sorted(glob.glob(os.path.join(RUNS_ROOT, "train-*", "checkpoints", "*")))
        if not earlier:
            raise ConfigError(f"--resume found no earlier run under {RUNS_ROOT}/; pass --run-dir")
        return os.path.dirname(os.path.dirname(earlier[-1]))
    run_dir = os.path.join(RUNS_ROOT, time.strftime("train-%Y%m%d-%H%M%S"))
    suffix = 1
    while os.path.exists(run_dir):
        run_dir = os.path.join(RUNS_ROOT, time.strftime("train-%Y%m%d-%H%M%S") + f"-{suffix}")
        suffix += 1
    return run_dir


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


class Stopwatch:
    """Seconds of training only: paused around evaluation and checkpoints."""

    def __init__(self):
        self.seconds, self._start = 0.0, None

    def start(self):
        self._start = time.perf_counter()

    def pause(self, *pending):
        jax.block_until_ready(pending)
        self.seconds = self.elapsed()
        self._start = None

    def elapsed(self) -> float:
        running = time.perf_counter() - self._start if self._start is not None else 0.0
        return self.seconds + running


def train(cfg: TrainConfig, *, should_stop=None) -> dict:
    """Run training as configured; return the summary dict (see ``experiments.train``).

    ``should_stop(step)`` is polled after every step; returning True stops the run as a signal
    would (checkpoint saved, ``interrupted`` set). Tests use it to cut a run short.

    With ``--coordinator`` (or ``--distributed``) this process first joins the others through
    ``jax.distributed``; then every process runs this same function on its share of the data.
    """
    wall_start = time.perf_counter()
    if not jax.distributed.is_initialized():
        initialize_distributed(cfg.coordinator, cfg.num_processes, cfg.process_id,
                               auto=cfg.distributed, timeout_s=cfg.distributed_timeout)
    model_cfg = cfg.validate()
    mesh, mesh_shape = build_mesh(cfg.sharding, cfg.mesh, cfg.mesh_axis_types, model_cfg,
                                  cfg.num_devices)
    with jax.default_matmul_precision(cfg.matmul_precision), jax.set_mesh(mesh):
        return _train(cfg, model_cfg, mesh, mesh_shape, should_stop, wall_start)


def _train(cfg: TrainConfig, model_cfg, mesh, mesh_shape, should_stop, wall_start) -> dict:
    seq_len = cfg.resolved_seq_len(model_cfg)
    multiple = batch_shards(mesh_shape) * cfg.accumulate
    if cfg.batch_size is not None and cfg.batch_size % multiple:
        raise ConfigError(
            f"batch_size={cfg.batch_size} does not split over the mesh's data x fsdp axes "
            f"({batch_shards(mesh_shape)} parts, {format_mesh(mesh_shape)}) times --accumulate "
            f"{cfg.accumulate}; pass a --batch-size that is a multiple of {multiple}")
    run_dir = resolve_run_dir(cfg)
    corpus = load_corpus(cfg.data, cache_dir=cfg.cache_dir)
    os.makedirs(run_dir, exist_ok=True)

    stream_args = dict(strategy=cfg.batching, seq_len=seq_len, seed=cfg.seed,
                       process_index=jax.process_index(), process_count=jax.process_count(),
                       data_parallel=multiple,
                       **cfg.batching_options())
    stream = DataStream(corpus.train, **stream_args)
    total_steps = cfg.steps
    if cfg.train_tokens is not None:
        total_steps = max(1, math.ceil(cfg.train_tokens / stream.stats["real_tokens_per_batch"]))
    optimizer, schedule, hyperparameters = build_optimizer(cfg, seq_len, total_steps)
    policy = cfg.policy()
    state, shardings = init_sharded_state(model_cfg, optimizer, cfg.seed, cfg.make_loss_scale(),
                                          mesh)
    batch_layout = batch_sharding(mesh)
    whole = replicated(mesh)
    plan = None
    if cfg.memory_budget is not None:
        model_cfg, plan = choose_remat(cfg, model_cfg, state, optimizer, policy,
                                       stream.global_shapes, batch_layout)
    resume_config = {**dataclasses.asdict(model_cfg),
                     **{k: getattr(cfg, k) for k in RESUME_KEYS},
                     **cfg.batching_options(), "seq_len": seq_len, "steps": total_steps}
    if cfg.tokens_per_batch is not None:   # token budgets round batches to this multiple
        resume_config["batch_multiple"] = math.lcm(multiple, jax.process_count())
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"))
    if cfg.resume:
        state, position, _ = checkpointer.restore(state, config=resume_config)
        stream = DataStream(corpus.train, position=position, **stream_args)

    apply_fn = make_apply(model_cfg)
    train_step = CompiledFn(
        make_train_step(apply_fn, optimizer, schedule, dropout=model_cfg.dropout > 0,
                        accumulate=cfg.accumulate, policy=policy),
        in_shardings=(shardings, batch_layout), out_shardings=(shardings, whole),
        donate_argnums=0)
    eval_step = CompiledFn(make_eval_step(apply_fn, policy),
                           in_shardings=(shardings, batch_layout), out_shardings=whole)
    eval_multiple = math.lcm(batch_shards(mesh_shape), jax.process_count())
    eval_batch_size = (cfg.eval_batch_size or stream_args["batch_size"]
                       or max(1, stream_args["tokens_per_batch"] // seq_len))
    eval_batch_size = -(-eval_batch_size // eval_multiple) * eval_multiple
    abstract_state = abstract(state)
    for shape in stream.global_shapes:
        train_step.compile(abstract_state, abstract_batch(shape))
    eval_step.compile(abstract_state, abstract_batch((eval_batch_size, seq_len)))
    warm_compiles = train_step.compiles

    writer = MetricsWriter(run_dir, jax.process_index())
    first_step = int(state.step)
    watch = Stopwatch()
    window, history = [], []
    totals = {"real": 0, "positions": 0}
    interrupted = None
    feed = DevicePrefetcher(stream, sharding=batch_layout, depth=cfg.prefetch)

    def save(step):
        checkpointer.save(step, state, loader_position=feed.position, config=resume_config)

    def run_eval(step, max_batches):
        loss, tokens = evaluate(eval_step, state, corpus.val, seq_len=seq_len,
                                batch_size=eval_batch_size, max_batches=max_batches,
                                sharding=batch_layout)
        writer.write(step, "eval", {"loss": loss, "bpb": loss * BITS_PER_NAT, "tokens": tokens})
        return loss, tokens

    progress = _progress_bar(total_steps, first_step, cfg.progress)
    watch.start()
    with stop_on_signals() as received:
        for step in range(first_step, total_steps):
            batch, _ = next(feed)
            state, metrics = train_step(state, batch)
            window.append(metrics)
            done = step + 1
            if done % max(cfg.log_every, 1) == 0 or done == total_steps:
                jax.block_until_ready(window[-1])
                history += _log_window(writer, done, window, totals, watch.elapsed(), progress)
                window = []
            if cfg.eval_every and done % cfg.eval_every == 0 and done < total_steps:
                watch.pause(state)
                run_eval(done, cfg.eval_batches)
                watch.start()
            stop = received.get("signum") or (should_stop is not None and should_stop(done))
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or stop:
                watch.pause(state)
                save(done)
                watch.start()
            if stop:
                interrupted = signal.Signals(received["signum"]).name if received else "requested"
                break
        watch.pause(state)
        if window:
            history += _log_window(writer, int(state.step), window, totals, watch.seconds,
                                   progress)
        final_step = int(state.step)
        save(final_step)
    feed.close()
    if progress is not None:
        progress.close()

    if interrupted:
        val_loss, val_tokens = float("nan"), 0
    else:
        val_loss, val_tokens = run_eval(final_step, cfg.final_eval_batches)
    writer.close()
    checkpointer.close()
    unigram_bpb = corpus.unigram_bits_per_token()
    if jax.process_index() == 0:
        plot_loss_curve(read_metrics(writer.path), os.path.join(run_dir, "loss.png"),
                        unigram_bpb=unigram_bpb,
                        title=f"{cfg.model} on {cfg.data}, {cfg.batching}")

    flops_token = flops_per_token(model_cfg, seq_len)
    tokens_per_s = totals["real"] / watch.seconds if watch.seconds > 0 else float("nan")
    peak = hardware.peak_flops()
    return {
        "steps": final_step,
        "steps_this_run": final_step - first_step,
        "batching": cfg.batching,
        "real_tokens": totals["real"],
        "real_tokens_per_s": tokens_per_s,
        "padding_efficiency": totals["real"] / max(totals["positions"], 1),
        "epoch_padding_efficiency": stream.stats["padding_efficiency"],
        "shapes": [list(shape) for shape in stream.global_shapes],
        "train_bpb": _recent_bpb(history),
        "val_loss": val_loss,
        "val_bpb": val_loss * BITS_PER_NAT,
        "val_tokens": val_tokens,
        "unigram_bpb": unigram_bpb,
        "compiles": train_step.compiles,
        "compiles_after_warmup": train_step.compiles - warm_compiles,
        "compile_s": train_step.compile_seconds,
        "eval_compiles": eval_step.compiles,
        "data_wait_s": feed.wait_seconds,
        "wall_s": time.perf_counter() - wall_start,
        "train_s": watch.seconds,
        "params": count_params(state.params),
        "precision": policy.name,
        "matmul_precision": cfg.matmul_precision,
        "loss_scale": float(state.loss_scale.loss_scale),
        "skipped_steps": int(state.loss_scale.skipped_steps),
        "optimizer": cfg.optimizer,
        **hyperparameters,
        "batch_rows": cfg.batch_rows(seq_len),
        "accumulate": cfg.accumulate,
        "optimizer_state_bytes": state_bytes(state.opt_state),
        "sharding": cfg.sharding,
        "mesh": mesh_shape,
        "mesh_axis_types": cfg.mesh_axis_types,
        "process_count": jax.process_count(),
        "param_opt_bytes_per_device": bytes_per_device((state.params, state.opt_state)),
        "flops_per_token": flops_token,
        "achieved_flops_per_s": tokens_per_s * flops_token,
        "mfu": tokens_per_s * flops_token / peak if peak else None,
        "attention": model_cfg.attention,
        "remat": model_cfg.remat,
        "scan_layers": model_cfg.scan_layers,
        "remat_plan": dataclasses.asdict(plan) if plan else None,
        "step_memory_bytes": largest_memory_bytes(train_step),
        "peak_memory_bytes": hardware.peak_memory_bytes(),
        "split_documents": stream.stats["split_documents"],
        "empty_documents_skipped": corpus.stats["empty_documents_skipped"],
        "device": hardware.describe(),
        "jax_version": jax.__version__,
        "run_dir": run_dir,
        "interrupted": interrupted,
    }


def init_sharded_state(model_cfg, optimizer, seed: int, loss_scale, mesh):
    """The initial TrainState, created already sharded over ``mesh`` (the initialisation is
    jitted with the state's shardings as its outputs, so no device holds more than its shard),
    and those shardings."""

    def make_state():
        return init_state(init_params(model_cfg, jax.random.PRNGKey(seed)), optimizer, seed,
                          loss_scale=loss_scale)

    abstract_state = jax.eval_shape(make_state)
    shardings = state_shardings(mesh, abstract_state,
                                param_shardings(mesh, param_axes(abstract_state.params)))
    return jax.jit(make_state, out_shardings=shardings)(), shardings


def choose_remat(cfg: TrainConfig, model_cfg, state, optimizer, policy, shapes, batch_layout):
    """The model config with the remat policy that ``--memory-budget`` chooses, and the plan.

    Planned at the batch shape with the most tokens (the longest among those); every policy's
    step is compiled once ahead of time, nothing runs. The largest batch per policy is left to
    ``experiments.remat`` (``plan_remat(search=True)``): its search costs several compiles
    per policy, too long a start for a training run.
    """
    rows, seq_len = max(shapes, key=lambda shape: (shape[0] * shape[1], shape[1]))

    def make_step(name):
        apply_fn = make_apply(dataclasses.replace(model_cfg, remat=name))
        return make_train_step(apply_fn, optimizer, dropout=model_cfg.dropout > 0,
                               accumulate=cfg.accumulate, policy=policy)

    abstract_state = abstract(state)
    plan = plan_remat(make_step, abstract_state, seq_len=seq_len, batch_size=rows,
                      budget=cfg.memory_budget, search=False, batch_sharding=batch_layout)
    return dataclasses.replace(model_cfg, remat=plan.policy), plan


def build_optimizer(cfg: TrainConfig, seq_len: int, total_steps: int):
    """The run's optimizer, its learning-rate schedule, and its hyperparameters as resolved (the
    optimizer's defaults filled in, the peak learning rate scaled to the batch size)."""
    base_lr, weight_decay = resolve_defaults(cfg.optimizer, cfg.learning_rate, cfg.weight_decay)
    learning_rate = scale_learning_rate(base_lr, cfg.lr_scaling, cfg.batch_rows(seq_len),
                                        cfg.base_batch_size)
    patterns = cfg.no_decay_patterns()
    optimizer = make_optimizer(
        cfg.optimizer, learning_rate=learning_rate, weight_decay=weight_decay,
        schedule=cfg.schedule, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
        clip_norm=cfg.clip_norm, mask=lambda params: decay_mask(params, patterns),
        state_dtype=jnp.dtype(cfg.optimizer_state_dtype))
    schedule = make_schedule(cfg.schedule, learning_rate, warmup_steps=cfg.warmup_steps,
                             total_steps=total_steps)
    return optimizer, schedule, {"learning_rate": learning_rate, "weight_decay": weight_decay}


def _progress_bar(total_steps: int, first_step: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total_steps, initial=first_step, desc="train", unit="step",
                dynamic_ncols=True)


def _log_window(writer, step, window, totals, seconds, progress) -> list[tuple[float, float]]:
    """Write the mean metrics of the last steps; return their (loss, tokens) per step.

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
        "loss": loss, "bpb": loss * BITS_PER_NAT,
        "grad_norm": float(fetched[-1]["grad_norm"]),
        "update_norm": float(fetched[-1]["update_norm"]),
        "loss_scale": float(fetched[-1]["loss_scale"]),
        "skipped_steps": int(fetched[-1]["skipped_steps"]),
        "learning_rate": float(fetched[-1]["learning_rate"]),
        "real_tokens": int(tokens.sum()),
        "padding_efficiency": float(tokens.sum() / max(tokens.sum() + padded.sum(), 1.0)),
        "real_tokens_per_s": tokens_per_s,
    }
    writer.write(step, "train", record)
    if progress is not None:
        progress.update(step - progress.n)
        progress.set_postfix(loss=f"{loss:.3f}", bpb=f"{record['bpb']:.2f}",
                             tok_s=f"{tokens_per_s:,.0f}")
    return list(zip(losses.tolist(), tokens.tolist()))


def _recent_bpb(history: list[tuple[float, float]]) -> float:
    """Token-weighted training bits per byte over the last tenth of the steps (at least one)."""
    if not history:
        return float("nan")
    recent = history[-max(1, len(history) // 10):]
    loss = sum(l * t for l, t in recent) / max(sum(t for _, t in recent), 1.0)
    return loss * BITS_PER_NAT
