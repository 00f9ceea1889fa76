"""The training loop: data -> jitted pure step -> metrics, evaluation and checkpoints.

``train(config)`` runs one training run and returns its summary. It is deterministic: a run
resumed from a checkpoint continues with the same state, the same batches and the same keys, so
on the CPU it ends bitwise identical to an uninterrupted run. SIGINT and SIGTERM finish the step
in flight, save a checkpoint and return with ``summary["interrupted"]`` set.
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
from jaxaccel.compiled import CompiledFn, abstract, memory_bytes
from jaxaccel.config import TrainConfig
from jaxaccel.corpus import load_corpus
from jaxaccel.data import DataStream, batches
from jaxaccel.errors import ConfigError
from jaxaccel.loader import DevicePrefetcher, abstract_batch, place_batch
from jaxaccel.metrics import BITS_PER_NAT, MetricsWriter, plot_loss_curve, read_metrics
from jaxaccel.model import count_params, flops_per_token, init_params, make_apply
from jaxaccel.optim import (decay_mask, make_optimizer, make_schedule, resolve_defaults,
                            scale_learning_rate, state_bytes)
from jaxaccel.planner import plan_remat
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
             max_batches: int | None = None) -> tuple[float, int]:
    """Mean loss in nats per target token over the documents (in order), and the token count."""
    loss_sum, weight_sum = 0.0, 0.0
    for i, batch in enumerate(batches(documents, strategy="fixed", seq_len=seq_len,
                                      batch_size=batch_size, shuffle=False)):
        if max_batches and i >= max_batches:
            break
        sums = eval_step(state, place_batch(batch))
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
    """
    with jax.default_matmul_precision(cfg.matmul_precision):
        return _train(cfg, should_stop)


def _train(cfg: TrainConfig, should_stop) -> dict:
    wall_start = time.perf_counter()
    if jax.process_count() > 1:
        raise ConfigError(
            "training across several processes is not supported yet: the train step is compiled "
            "for one process's devices; run a single process")
    model_cfg = cfg.validate()
    seq_len = cfg.resolved_seq_len(model_cfg)
    run_dir = resolve_run_dir(cfg)
    corpus = load_corpus(cfg.data, cache_dir=cfg.cache_dir)
    os.makedirs(run_dir, exist_ok=True)

    stream_args = dict(strategy=cfg.batching, seq_len=seq_len, seed=cfg.seed,
                       process_index=jax.process_index(), process_count=jax.process_count(),
                       data_parallel=jax.device_count() * cfg.accumulate,
                       **cfg.batching_options())
    stream = DataStream(corpus.train, **stream_args)
    total_steps = cfg.steps
    if cfg.train_tokens is not None:
        total_steps = max(1, math.ceil(cfg.train_tokens / stream.stats["real_tokens_per_batch"]))
    optimizer, schedule, hyperparameters = build_optimizer(cfg, seq_len, total_steps)
    policy = cfg.policy()
    state = init_state(init_params(model_cfg, jax.random.PRNGKey(cfg.seed)), optimizer, cfg.seed,
                       loss_scale=cfg.make_loss_scale())
    plan = None
    if cfg.memory_budget is not None:
        model_cfg, plan = choose_remat(cfg, model_cfg, state, optimizer, policy, stream.shapes)
    resume_config = {**dataclasses.asdict(model_cfg),
                     **{k: getattr(cfg, k) for k in RESUME_KEYS},
                     **cfg.batching_options(), "seq_len": seq_len, "steps": total_steps}
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"))
    if cfg.resume:
        state, position, _ = checkpointer.restore(state, config=resume_config)
        stream = DataStream(corpus.train, position=position, **stream_args)

    apply_fn = make_apply(model_cfg)
    train_step = CompiledFn(
        make_train_step(apply_fn, optimizer, schedule, dropout=model_cfg.dropout > 0,
                        accumulate=cfg.accumulate, policy=policy),
        donate_argnums=0)
    eval_step = CompiledFn(make_eval_step(apply_fn, policy))
    eval_batch_size = stream_args["batch_size"] or max(1, stream_args["tokens_per_batch"] // seq_len)
    abstract_state = abstract(state)
    for shape in stream.shapes:
        train_step.compile(abstract_state, abstract_batch(shape))
    eval_step.compile(abstract_state, abstract_batch((eval_batch_size, seq_len)))
    warm_compiles = train_step.compiles

    writer = MetricsWriter(run_dir)
    first_step = int(state.step)
    watch = Stopwatch()
    window, history = [], []
    totals = {"real": 0, "positions": 0}
    interrupted = None
    feed = DevicePrefetcher(stream, depth=cfg.prefetch)

    def save(step):
        checkpointer.save(step, state, loader_position=feed.position, config=resume_config)

    def run_eval(step, max_batches):
        loss, tokens = evaluate(eval_step, state, corpus.val, seq_len=seq_len,
                                batch_size=eval_batch_size, max_batches=max_batches)
        writer.write(step, "eval", {"loss": loss, "bpb": loss * BITS_PER_NAT, "tokens": tokens})
        return loss, tokens

    progress = _progress_bar(total_steps, first_step, cfg.progress)
    watch.start()
    with stop_on_signals() as received:
        for step in range(first_step, total_steps):
            batch, counts = next(feed)
            state, metrics = train_step(state, batch)
            totals["real"] += counts["real_tokens"]
            totals["positions"] += counts["real_tokens"] + counts["padded_tokens"]
            window.append(metrics)
            done = step + 1
            if done % max(cfg.log_every, 1) == 0 or done == total_steps:
                jax.block_until_ready(window[-1])
                rate = totals["real"] / max(watch.elapsed(), 1e-9)
                history += _log_window(writer, done, window, rate, progress)
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
            rate = totals["real"] / max(watch.seconds, 1e-9)
            history += _log_window(writer, int(state.step), window, rate, progress)
        final_step = int(state.step)
        save(final_step)
    feed.close()
    if progress is not None:
        progress.close()

    if interrupted:
        val_loss, val_tokens = float("nan"), 0
    else:
        val_loss, val_tokens = run_eval(final_step, None)
    writer.close()
    checkpointer.close()
    unigram_bpb = corpus.unigram_bits_per_token()
    plot_loss_curve(read_metrics(writer.path), os.path.join(run_dir, "loss.png"),
                    unigram_bpb=unigram_bpb, title=f"{cfg.model} on {cfg.data}, {cfg.batching}")

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
        "shapes": [list(shape) for shape in stream.shapes],
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
        "flops_per_token": flops_token,
        "achieved_flops_per_s": tokens_per_s * flops_token,
        "mfu": tokens_per_s * flops_token / peak if peak else None,
        "remat": model_cfg.remat,
        "scan_layers": model_cfg.scan_layers,
        "remat_plan": dataclasses.asdict(plan) if plan else None,
        "step_memory_bytes": memory_bytes(train_step.last),
        "peak_memory_bytes": hardware.peak_memory_bytes(),
        "split_documents": stream.stats["split_documents"],
        "empty_documents_skipped": corpus.stats["empty_documents_skipped"],
        "device": hardware.describe(),
        "jax_version": jax.__version__,
        "run_dir": run_dir,
        "interrupted": interrupted,
    }


def choose_remat(cfg: TrainConfig, model_cfg, state, optimizer, policy, shapes):
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
                      budget=cfg.memory_budget, search=False)
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


def _log_window(writer, step, window, tokens_per_s, progress) -> list[tuple[float, float]]:
    """Write the mean metrics of the last steps; return their (loss, tokens) per step.

    ``tokens_per_s`` is the run's mean real tokens per second of training so far.
    """
    fetched = jax.device_get(window)
    losses = np.array([m["loss"] for m in fetched], dtype=np.float64)
    tokens = np.array([m["real_tokens"] for m in fetched], dtype=np.float64)
    padded = np.array([m["padded_tokens"] for m in fetched], dtype=np.float64)
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
