"""Phase 4 of a run, finish: the final evaluation, the loss plot, the FLOPs and the summary."""

import dataclasses
import math
import os
import time

import jax
import numpy as np
from flax import nnx

from jaxaccel.core import hardware
from jaxaccel.techniques import registry as techniques
from jaxaccel.model import contract as model_lib, nn
from jaxaccel.step import precision, trace
from jaxaccel.step.compiled import largest_memory_bytes
from jaxaccel.data.loader import abstract_batch, abstract_key, place_batch
from jaxaccel.run.loop.console import announce
from jaxaccel.run.loop.record import RunSummary
from jaxaccel.run.loop.run import Progress, agreed_stop, recent_steps, run_eval, stop_asked, \
    stop_name, stop_on_signals, target_record
from jaxaccel.run.loop.setup import Setup
from jaxaccel.step.metrics import plot_loss_curve, read_metrics
from jaxaccel.step.optim import state_bytes
from jaxaccel.data.corpus import skipped_inputs
from jaxaccel.core.sharding import bytes_per_device


def finish(run: Setup, compiled: list, progress: Progress, wall_start: float,
           notes: dict | None = None, should_stop=None) -> RunSummary:
    """The final evaluation, the plot and the summary; ``compiled`` holds the steps of every
    progressive-stacking stage (one without), the last being the model's final depth. The last
    checkpoint is finished first, so nothing here (the evaluation out of memory) can lose it; a
    signal (or ``should_stop``) here cuts the evaluation and makes the run ``interrupted``."""
    last_step = int(progress.state.step)     # read now: timing the step alone donates the state
    with stop_on_signals() as received:
        def stopped() -> int | None:
            return stop_asked(received, should_stop, last_step)

        try:
            return _finish(run, compiled, progress, wall_start, notes or {}, stopped)
        finally:
            progress.writer.close()


def _finish(run: Setup, compiled: list, progress: Progress, wall_start: float, notes: dict,
            stopped) -> RunSummary:
    """``finish`` with ``stopped()``: the signal (or STOP_REQUESTED) asking to stop, or None.
    With several processes the evaluation runs to its end and the stop is agreed after it."""
    cfg, state, steps = run.cfg, progress.state, compiled[-1]
    final_step = int(state.step)
    run.checkpointer.close()            # the last checkpoint written before anything else
    paused = (not progress.interrupted and progress.target is None     # run.stop_at
              and final_step < run.total_steps)
    if progress.interrupted or paused:
        val_loss, val_tokens = float("nan"), 0
    else:
        val_loss, val_tokens = _final_eval(run, steps, progress, final_step, stopped)
    stop = stopped() if jax.process_count() == 1 else agreed_stop(stopped())
    interrupted = progress.interrupted or stop_name(stop)
    target = progress.target
    if cfg.run.target_bpb is not None and target is None and not paused and \
            not interrupted:
        target = _final_target(run, progress, final_step, val_loss)
    unigram_bpb = run.corpus.unigram_bits_per_byte()
    name = model_lib.describe(cfg.model, cfg.gpt)
    if jax.process_index() == 0 and cfg.run.loss_plot:
        plot_loss_curve(read_metrics(progress.writer.path), os.path.join(run.run_dir, "loss.png"),
                        unigram_bpb=unigram_bpb,
                        title=f"{name} on {cfg.data.path}, {cfg.data.batching}")
    summary = _summary(run, compiled, progress, wall_start, notes, final_step=final_step,
                       interrupted=interrupted, paused=paused, target=target,
                       val_loss=val_loss, val_tokens=val_tokens, name=name,
                       unigram_bpb=unigram_bpb)
    if progress.recent_batches and not interrupted:     # last: it consumes the state
        placed = [place_batch(b, run.batch_layout) if isinstance(b["inputs"], np.ndarray)
                  else b for b in progress.recent_batches]     # on the device, as timed alone
        summary.step_alone = step_alone(steps, state, placed, summary.real_tokens_per_s)
    if jax.process_count() == 1:        # a signal in the last moments is said too
        summary.interrupted = interrupted or stop_name(stopped())
    return summary


def _final_eval(run: Setup, steps, progress: Progress, final_step: int, stopped
                ) -> tuple[float, int]:
    """The final evaluation's (mean loss, tokens): the last periodic one's where it evaluated
    the same batches at this step, else run now; (NaN, 0) if a signal cut it (one process)."""
    cfg = run.cfg
    if (progress.last_eval and progress.last_eval[0] == final_step
            and cfg.run.final_eval_batches == cfg.run.eval_batches):
        _, val_loss, val_tokens = progress.last_eval     # the same batches: evaluated already
        return val_loss, val_tokens
    announce(cfg, f"final evaluation: {cfg.run.final_eval_batches or 'all'} validation "
                  f"batches of {run.eval_batch_size} rows")
    alone = jax.process_count() == 1
    try:
        evaluated = run_eval(run, steps, progress.state, progress.writer, final_step,
                             cfg.run.final_eval_batches, final=True,
                             stop=(lambda: stopped() is not None) if alone else None)
    except Exception as e:
        if hardware.out_of_memory(e):   # its line names the evaluation's settings
            e.add_note(hardware.FINAL_EVAL_NOTE)
        raise
    return evaluated if evaluated is not None else (float("nan"), 0)


def _final_target(run: Setup, progress: Progress, final_step: int, val_loss: float) -> dict:
    """The summary's ``target`` where no periodic evaluation reached it: judged by the final
    evaluation."""
    cfg = run.cfg
    bpb = run.corpus.bits_per_byte(val_loss)
    if bpb <= cfg.run.target_bpb:
        return target_record(cfg, final_step, bpb, progress.totals, progress.train_s)
    return {"bpb": cfg.run.target_bpb, "reached": False, "step": final_step, "val_bpb": bpb}


def _summary(run: Setup, compiled: list, progress: Progress, wall_start: float, notes: dict, *,
             final_step: int, interrupted: str | None, paused: bool, target: dict | None,
             val_loss: float, val_tokens: int, name: str, unigram_bpb: float) -> RunSummary:
    """The run's summary, but for the step timed alone."""
    cfg, state, steps = run.cfg, progress.state, compiled[-1]
    totals, train_s = progress.totals, progress.train_s
    flops_token = run_flops_per_token(run, final_step, progress.first_step)
    tokens_per_s = totals["real"] / train_s if train_s > 0 else float("nan")
    peak = hardware.peak_flops()
    stats = run.stream.stats
    trainable, weights = nn.count_weights(state.params)
    return RunSummary(
        steps=final_step, steps_this_run=final_step - progress.first_step,
        interrupted=interrupted, stopped_at=final_step if paused else None,
        target=target,
        total_steps=run.total_steps, run_dir=run.run_dir, batching=cfg.data.batching,
        shapes=[list(shape) for shape in run.stream.global_shapes], real_tokens=totals["real"],
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
        val_loss=val_loss, val_bpb=run.corpus.bits_per_byte(val_loss), val_tokens=val_tokens,
        unigram_bpb=unigram_bpb, real_tokens_per_s=tokens_per_s, flops_per_token=flops_token,
        achieved_flops_per_s=tokens_per_s * flops_token,
        mfu=tokens_per_s * flops_token / peak if peak else None,
        compiles=sum(c.train.compiles for c in compiled),
        compiles_after_warmup=sum(c.train.compiles - c.warm_compiles for c in compiled),
        compile_s=sum(c.train.compile_seconds for c in compiled),
        eval_compiles=sum(c.eval.compiles for c in compiled),
        step_memory_bytes=largest_memory_bytes(steps.train),
        peak_memory_bytes=hardware.peak_memory_bytes(),
        param_opt_bytes_per_device=bytes_per_device((state.params, state.opt_state)),
        optimizer_state_bytes=state_bytes(state.opt_state),
        wall_s=time.perf_counter() - wall_start, train_s=train_s,
        model=name, params=weights, trainable_params=trainable,
        precision=cfg.policy().name, matmul_precision=cfg.precision.matmul,
        loss_scale=float(state.loss_scale.loss_scale),
        skipped_steps=int(state.loss_scale.skipped_steps), optimizer=cfg.optimizer.name,
        learning_rate=run.hyperparameters["learning_rate"],
        weight_decay=run.hyperparameters["weight_decay"], batch_rows=cfg.batch_rows(),
        accumulate=cfg.optimizer.accumulate, sharding=cfg.mesh.strategy, mesh=run.mesh_shape,
        mesh_axis_types=cfg.mesh.axis_types, process_count=jax.process_count(),
        device=hardware.describe(), jax_version=jax.__version__,
        techniques=techniques.report(cfg, state.params, run.mesh_shape, {
            **notes, "remat_plan": dataclasses.asdict(run.plan) if run.plan else None,
            "stages": run.stages, "executables": steps.train.executables,
            "flops_per_token": flops_token}),
        diverged_at_step=diverged_at(progress.history, progress.first_step,
                                     None if interrupted or paused else val_loss,
                                     final_step))


def flops_per_token(cfg, model) -> float:
    """Training FLOPs per token position of ``model`` under ``cfg``: 3 x the matmul FLOPs of one
    microbatch's forward pass in training (so token dropping's and stochastic depth's skipped
    work is not counted) at the longest batch shape, over its tokens (``jaxaccel.step.trace``)."""
    graphdef, state = nnx.split(model)
    apply = precision.cast(model_lib.make_apply(
        graphdef, segment_attention=cfg.data.batching == "pack"), cfg.policy())
    rows = max(1, cfg.batch_rows() // cfg.optimizer.accumulate)
    batch = dict(abstract_batch((rows, cfg.seq_len)))
    flops = trace.training_flops(apply, state, batch, abstract_key())
    return flops / (rows * cfg.seq_len)


def run_flops_per_token(run: Setup, final_step: int, first_step: int) -> float:
    """Training FLOPs per token of this run's steps, each stacking stage's at its depth."""
    starts = [start for start, _ in run.stages] + [final_step]
    weighted, total = 0.0, 0
    for (start, depth), end in zip(run.stages, starts[1:]):
        steps = max(end - max(start, first_step), 0)
        if steps:
            model = (run.model if depth == run.stages[-1][1]
                     else techniques.abstract(run.cfg, depth=depth))
            weighted += steps * flops_per_token(run.cfg, model)
            total += steps
    return weighted / total if total else flops_per_token(run.cfg, run.model)


def step_alone(steps, state, batches: list, loop_tokens_per_s: float) -> dict:
    """The warm train step timed alone on ``batches`` (the run's last, on the device): no data
    loading, logging, evaluation or checkpoints between, one wait at the end. Its real tokens/s
    and the loop's as a share of it (issue 16's target: >= 95 % on a GPU). Donates ``state``."""
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
    """The step from which the training loss (``history`` from ``first_step``) stayed NaN or inf
    to the end, else the final step if ``val_loss`` (None: not run) is not finite, else None. A
    recovered loss (a float16 overflow that dynamic loss scaling skipped) is no failure."""
    streak = None
    for i, (loss, _) in enumerate(history):
        if math.isfinite(loss):
            streak = None
        elif streak is None:
            streak = first_step + i + 1
    if streak is None and val_loss is not None and not math.isfinite(val_loss):
        return final_step
    return streak


def _recent_bpb(history: list[tuple[float, float]], steps: int, bits_per_nat: float) -> float:
    """Token-weighted training bits per byte over the last tenth of the ``steps`` (at least one):
    a resumed run's ``history`` starts with its checkpoint's, as an uninterrupted run's would."""
    if not history:
        return float("nan")
    recent = history[-recent_steps(steps):]
    loss = sum(l * t for l, t in recent) / max(sum(t for _, t in recent), 1.0)
    return loss * bits_per_nat
