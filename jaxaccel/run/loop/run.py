"""Phase 3 of a run, run: the steps, metrics, periodic evaluation and checkpoints, stopping on
signals; and growing the model between progressive-stacking stages."""

import collections
import contextlib
import dataclasses
import os
import signal
import time

import jax
import numpy as np

from jaxaccel.model import nn
from jaxaccel.run import profiling
from jaxaccel.techniques import registry as techniques
from jaxaccel.run.config import to_dict
from jaxaccel.data.batching import batches
from jaxaccel.data.loader import DevicePrefetcher, place_batch, prefetch_depth
from jaxaccel.run.loop.console import announce, log_window, note, progress_bar
from jaxaccel.run.loop.compile import plan_memory
from jaxaccel.run.loop.setup import Setup, open_stream
from jaxaccel.step.metrics import MetricsWriter, metrics_path, truncate_metrics
from jaxaccel.core.sharding import parse_axis_rules
from jaxaccel.step.state import abstract_sharded_state
from jaxaccel.run.trackers import open_trackers, parse as tracker_names


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
    target: dict | None = None  # run.target_bpb reached: the step, real tokens, training seconds
    last_eval: tuple | None = None      # (step, loss, tokens) of the last periodic evaluation
    saved_at: float | None = None       # time.monotonic() of the last checkpoint (or start)


def run_steps(run: Setup, steps, should_stop=None, previous: Progress | None = None,
              wall_start: float | None = None) -> Progress:
    """Train to the end of the run or of its stacking stage, continuing ``previous`` (the stages
    before); the start-up (``run.startup``) is timed to the first step from ``wall_start``."""
    stage = _open_stage(run, steps, previous, wall_start)
    leaves = jax.tree.leaves(run.state)     # what the step takes and gives (StateStep.on_leaves)
    log, watch = stage.log, stage.log.watch
    watch.start()
    with stop_on_signals() as received, closed_on_error(stage.feed, log.writer):
        leaves, window = _train(stage, leaves, received, should_stop)
        watch.pause(leaves)
        state = steps.train.state_of(leaves)
        log.log_late()
        if window:
            log.history += log_window(log.writer, int(state.step), window, log.totals,
                                      watch.seconds, log.bar, log.train_bits)
        stage.save(int(state.step), leaves, [])         # the window is in the history now
    final_position = stage.position()
    stage.close()
    waited = stage.feed.wait_seconds + (previous.data_wait_s if previous else 0.0)
    report = (stage.profiler.report if stage.profiler is not None else None) or (
        previous.profile if previous is not None else None)
    return Progress(state, stage.first_step, log.totals, log.history, watch.seconds, waited,
                    stage.interrupted, log.writer, final_position, report, list(stage.recent),
                    stage.reached, stage.last_eval, stage.saved_at)


def _train(stage: "_Stage", leaves: list, received: dict, should_stop) -> tuple[list, list]:
    """The steps from ``stage.start`` to ``stage.end`` (or a stop, or the target reached); the
    leaves after them and the metrics of the steps since the last log step, not yet fetched.
    The hot path: what every step reads is a local, the rest a call behind its condition."""
    run, cfg, train = stage.run, stage.run.cfg, stage.steps.train
    feed, recent, sampler, profiler, log = (stage.feed, stage.recent, stage.sampler,
                                            stage.profiler, stage.log)
    start, end, timed_from = stage.start, stage.end, stage.timed_from
    saved_at, reached = stage.saved_at, None
    window = []         # the metrics of the steps since the last log step, not yet fetched
    for step in range(start, end):
        batch, _ = next(feed)
        recent.append(batch)
        if profiler is not None and profiler.starts(step):    # the trace's set-up and
            stage.untimed(profiler.before, step, leaves)        # read-back are not training
        leaves, metrics = train.on_leaves(leaves, batch)
        if profiler is not None and profiler.stops(step):
            stage.untimed(profiler.after, step, leaves)
        if timed_from is not None and step == start:
            _time_first_step(run, metrics, timed_from, log.bar)
        if sampler is not None:
            sampler.submit(step, metrics)
        window.append(metrics)
        done = step + 1
        if done % max(cfg.run.log_every, 1) == 0 or done == run.total_steps:
            log.log_late()
            log.late.append((done, window))
            window = []
        if cfg.run.eval_every and done % cfg.run.eval_every == 0 and done < run.total_steps:
            reached = stage.evaluate(done, leaves)
        stop = stop_asked(received, should_stop, done)
        due = checkpoint_due(cfg.run, done, saved_at)
        if jax.process_count() > 1:     # every process stops (and saves) at the same step
            at_log = done % max(cfg.run.log_every, 1) == 0 or done == end
            stop, due = agreed(stop, due) if at_log else (None, False)
        if cfg.run.save_checkpoints and (due or stop):
            saved_at = stage.checkpoint(done, leaves, window)
        if reached:
            break
        if stop:
            stage.interrupted = stop_name(stop)
            break
    return leaves, window


@dataclasses.dataclass
class _Log:
    """The steps' metrics on their way to the metrics file (and ``history``)."""

    writer: MetricsWriter
    history: list               # (loss, real tokens) per step
    totals: dict                # real tokens and token positions of the run's global batches
    watch: "Stopwatch"
    bar: object                 # the progress bar, or None
    train_bits: float           # bits per byte of a nat per token
    late: list = dataclasses.field(default_factory=list)    # the last log step and its window

    def log_late(self):
        """Write the previous log step's window: fetched a log step late, the device is long done
        with it and its queue never drains; the seconds are those when its metrics arrived."""
        if self.late:
            step, metrics = self.late.pop()
            jax.block_until_ready(metrics[-1])
            self.history.extend(log_window(self.writer, step, metrics, self.totals,
                                           self.watch.elapsed(), self.bar, self.train_bits))


@dataclasses.dataclass
class _Stage:
    """One ``run_steps``: the steps ``start`` to ``end`` and what they share, their evaluations
    and checkpoints; how it ended (``interrupted``, ``reached``, ``last_eval``, ``saved_at``)."""

    run: Setup
    steps: object
    start: int
    end: int
    first_step: int             # the run's first step in this invocation
    timed_from: float | None    # the start-up's start, where this stage's first step ends it
    log: _Log
    feed: DevicePrefetcher
    sampler: object             # importance sampling's score table, or None
    profiler: object            # --profile's StepProfiler, or None
    recent: collections.deque   # the batches step_alone replays
    saved_at: float             # time.monotonic() of the last checkpoint (or start)
    interrupted: str | None = None
    reached: dict | None = None
    last_eval: tuple | None = None

    def position(self) -> dict:
        """The loader's position after the last step, the sampler's scores with it."""
        if self.sampler is None:
            return self.feed.position
        self.sampler.flush()
        return {**self.feed.position, "sampler": self.sampler.state()}

    def untimed(self, work, step: int, leaves):
        """``work(step, leaves)`` with the training clock paused."""
        self.log.watch.pause(leaves)
        work(step, leaves)
        self.log.watch.start()

    def save(self, step: int, leaves, window: list):
        """A checkpoint of ``leaves`` at ``step`` (with ``run.save_checkpoints``), with the
        loader's position and the last steps' losses, ``window``'s not yet logged included."""
        run = self.run
        if not run.cfg.run.save_checkpoints:
            return
        self.log.log_late()
        pending = [(float(loss), float(tokens)) for loss, tokens in
                   jax.device_get([(m["loss"], m["real_tokens"]) for m in window])]
        kept = (run.restored_history + self.log.history + pending)[-recent_steps(run.total_steps):]
        run.checkpointer.save(step, self.steps.train.state_of(leaves),
                              loader_position=self.position(), config=run.resume_config,
                              history=kept)

    def checkpoint(self, step: int, leaves, window: list) -> float:
        """``save`` in the loop, off the training clock; when it was (time.monotonic())."""
        self.log.watch.pause(leaves)
        self.save(step, leaves, window)
        self.saved_at = time.monotonic()
        self.log.watch.start()
        return self.saved_at

    def evaluate(self, step: int, leaves) -> dict | None:
        """The periodic evaluation after ``step``, off the training clock; ``reached``, the
        target's record, if this evaluation reached ``run.target_bpb`` or gave up on it."""
        run, cfg, log = self.run, self.run.cfg, self.log
        log.watch.pause(leaves)
        log.log_late()
        loss, tokens = run_eval(run, self.steps, self.steps.train.state_of(leaves), log.writer,
                                step, cfg.run.eval_batches)
        bpb, self.last_eval = run.corpus.bits_per_byte(loss), (step, loss, tokens)
        announce(cfg, f"eval at step {step}: loss {loss:.4f}, {bpb:.3f} bits per byte "
                      f"over {tokens:,} tokens", log.bar)
        seconds = log.watch.seconds
        if cfg.run.target_bpb is not None and bpb <= cfg.run.target_bpb:
            self.reached = target_record(cfg, step, bpb, log.totals, seconds)
            announce(cfg, f"target {cfg.run.target_bpb:g} bits per byte reached at "
                          f"step {step}: the run ends here", log.bar)
        elif cfg.run.target_seconds is not None and seconds >= cfg.run.target_seconds:
            self.reached = {"bpb": cfg.run.target_bpb, "reached": False, "step": step,
                            "val_bpb": bpb, "gave_up_after_s": seconds}
            announce(cfg, f"target {cfg.run.target_bpb:g} bits per byte not reached "
                          f"in {cfg.run.target_seconds:g} s of training: the run ends "
                          f"at step {step}", log.bar)
        log.watch.start()
        return self.reached

    def close(self):
        """The profiler, the sampler, the feed's thread and the progress bar closed."""
        if self.profiler is not None:
            self.profiler.close()
        if self.sampler is not None:
            self.sampler.close()
        self.feed.close()
        if self.log.bar is not None:
            self.log.bar.close()


def _open_stage(run: Setup, steps, previous: Progress | None, wall_start: float | None
                ) -> _Stage:
    """The stage from the run's state to the end of the run or of its stacking stage: the
    metrics log continuing ``previous``'s (else opened), the feed, the sampler, the profiler."""
    cfg = run.cfg
    train_bits = run.corpus.bits_per_byte(1.0, "train")    # bits per byte of a nat per token
    start = int(run.state.step)
    end = min(techniques.stage_end(start, run.total_steps, run.stack_ends), run.stop_step)
    if previous is None:
        drop_unsaved_records(run, start)
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
    feed = DevicePrefetcher(run.stream, sharding=run.batch_layout,
                            depth=prefetch_depth(cfg.data))
    bar = progress_bar(run.total_steps, first_step, cfg.run.progress)
    profiler = (profiling.StepProfiler(profiling.parse_window(cfg.run.profile),
                                       os.path.join(run.run_dir, "profile"))
                if cfg.run.profile is not None else None)
    return _Stage(run, steps, start, end, first_step,
                  timed_from=wall_start if previous is None else None,
                  log=_Log(writer, history, totals, watch, bar, train_bits), feed=feed,
                  sampler=getattr(run.stream, "sampler", None), profiler=profiler,
                  recent=collections.deque(maxlen=cfg.run.time_step),
                  saved_at=previous.saved_at if previous else time.monotonic())


def checkpoint_due(settings, step: int, saved_at: float) -> bool:
    """Whether a checkpoint is due after ``step``: every ``checkpoint_every`` steps, or once
    ``checkpoint_minutes`` have passed since the last one (``saved_at``, time.monotonic())."""
    every, minutes = settings.checkpoint_every, settings.checkpoint_minutes
    return bool((every and step % every == 0)
                or (minutes and time.monotonic() - saved_at >= 60 * minutes))


@contextlib.contextmanager
def closed_on_error(feed, writer):
    """A failed step or checkpoint ends the run: the feed's thread stopped, the metrics file
    (and its trackers) closed, before the error leaves."""
    try:
        yield
    except BaseException:
        feed.close()
        writer.close()
        raise


def drop_unsaved_records(run: Setup, start: int):
    """Cut this process's metrics file back to the checkpoint the run starts from (``start``; 0:
    none), saying so: on resume the records written after that checkpoint, in a new run those
    of an earlier run into the directory that saved no checkpoint (killed, a full disk). Its
    steps are trained again, so each is in the file once."""
    path = metrics_path(run.run_dir, jax.process_index())
    dropped = truncate_metrics(path, start)
    if dropped and start:
        note(run.cfg, f"{os.path.basename(path)}: {dropped} record(s) written after the "
                      f"checkpoint of step {start} removed (the resumed run writes them again)")
    elif dropped:
        note(run.cfg, f"{os.path.basename(path)}: {dropped} record(s) of an earlier run into "
                      f"{run.run_dir} that saved no checkpoint removed; this run starts at "
                      f"step 0")


def stop_name(stop: int | None) -> str | None:
    """The summary's ``interrupted`` for ``stop_asked``'s answer: the signal's name,
    ``"requested"`` (``should_stop``) or None."""
    if stop is None:
        return None
    return "requested" if stop == STOP_REQUESTED else signal.Signals(stop).name


def stop_asked(received: dict, should_stop, step: int) -> int | None:
    """Why the run should stop now: the signal ``stop_on_signals`` received, else
    ``STOP_REQUESTED`` if ``should_stop(step)``, else None."""
    return received.get("signum") or (should_stop is not None and should_stop(step)
                                       and STOP_REQUESTED) or None


def target_record(cfg, step: int, bpb: float, totals: dict, train_s: float) -> dict:
    """What the summary's ``target`` holds once ``run.target_bpb`` is reached: at which step
    and evaluation, after how many real tokens and seconds of training (this invocation's:
    a resumed run adds its earlier ones)."""
    return {"bpb": cfg.run.target_bpb, "reached": True, "step": step, "val_bpb": bpb,
            "real_tokens": totals["real"], "train_s": train_s}


STOP_REQUESTED = -1      # ``should_stop`` asked for the stop (a signal: its number)


def agreed_stop(local: int | None) -> int | None:
    """The stop all processes agree on (``agreed``'s first half)."""
    return agreed(local)[0]


def agreed(local: int | None, save_due: bool = False) -> tuple[int | None, bool]:
    """The stop and the checkpoint all processes agree on (a collective, at log steps) from each
    one's ``local`` reason to stop and ``save_due``: the highest signal any received, else
    ``STOP_REQUESTED`` from any, else None; so SIGTERM to one host (a preemption notice) stops
    all at one step, with a checkpoint. A checkpoint is due where it is due on any host (their
    clocks differ)."""
    from jax.experimental import multihost_utils

    codes = np.asarray(multihost_utils.process_allgather(
        np.array([local or 0, int(save_due)], np.int32))).reshape(-1, 2)
    stops, due = codes[:, 0], bool(codes[:, 1].any())
    if (stops > 0).any():
        return int(stops.max()), due
    return (STOP_REQUESTED if (stops == STOP_REQUESTED).any() else None), due


def grow_run(run: Setup, progress: Progress) -> Setup:
    """The next stage of a technique that grows the model (progressive stacking: twice as
    deep), its state grown from the trained one (``techniques.grown``), the loader continuing
    from its position."""
    cfg, old_depth = run.cfg, run.stages[-1][1]
    depth = techniques.next_depth(cfg, old_depth)
    model = techniques.abstract(cfg, depth=None if depth == run.full_layers else depth)
    state, shardings = abstract_sharded_state(
        techniques.variables(cfg, depth), run.optimizer, cfg.run.seed, cfg.make_loss_scale(),
        run.mesh, cfg.policy(), axis_rules=parse_axis_rules(cfg.mesh.axis_rules))
    state = jax.device_put(techniques.grown(cfg, progress.state, state, old_depth, model),
                           shardings)
    stream = open_stream(cfg, run.corpus.train, run.stream_args, progress.position)
    plan = run.plan
    if cfg.run.memory_budget is not None:
        cfg, model, plan = plan_memory(cfg, model, depth, run.optimizer, state, stream,
                                       run.batch_layout)
    progress.writer.write(int(state.step), "stack", {"n_layers": depth})
    return dataclasses.replace(run, cfg=cfg, model=model, state=state, shardings=shardings,
                               stream=stream, plan=plan,
                               stages=[*run.stages, [int(state.step), depth]])


def run_eval(run: Setup, steps, state, writer, step: int, max_batches, *, stop=None,
             final: bool = False):
    """Evaluate on the validation split and log it (``final``: the run's final evaluation,
    marked so); (mean loss in nats, tokens), or None if ``stop()`` cut it (nothing logged)."""
    result = evaluate(steps.eval, state, run.corpus.val, seq_len=run.cfg.seq_len,
                      batch_size=run.eval_batch_size, max_batches=max_batches,
                      sharding=run.batch_layout, stop=stop)
    if result is None:
        return None
    loss, tokens = result
    writer.write(step, "eval", {"loss": loss, "bpb": run.corpus.bits_per_byte(loss),
                                "tokens": tokens, **({"final": True} if final else {})})
    return loss, tokens


def evaluate(eval_step, state, documents, *, seq_len: int, batch_size: int,
             max_batches: int | None = None, sharding=None, stop=None
             ) -> tuple[float, int] | None:
    """Mean loss in nats per target token over the documents, and the token count; with
    ``max_batches`` that many batches, spread evenly. Each process makes its own rows.
    ``stop()``, asked before each batch, returning true ends it early with None (with several
    processes it must answer alike in all of them)."""
    loss_sum, weight_sum = 0.0, 0.0
    for batch in batches(documents, strategy="fixed", seq_len=seq_len, batch_size=batch_size,
                         shuffle=False, spread=max_batches or None,
                         process_index=jax.process_index(), process_count=jax.process_count()):
        if stop is not None and stop():
            return None
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
        self.seconds, self._start = self.elapsed(), None

    def elapsed(self) -> float:
        running = time.perf_counter() - self._start if self._start is not None else 0.0
        return self.seconds + running


def _time_first_step(run: Setup, metrics, began: float, progress):
    """Wait for the run's first step; record and announce the start-up phases' seconds."""
    before = time.perf_counter()
    jax.block_until_ready(metrics)
    now, age, startup = time.perf_counter(), _process_age(), run.startup
    startup.update(first_step=now - before, to_first_step=now - began)
    if age is not None:
        startup["command_to_first_step"] = age
    announce(run.cfg, "start-up: " + ", ".join(
        f"{name.replace('_', ' ')} {startup[name]:.1f} s" for name in STARTUP_PHASES
        if name in startup), progress)


# The start-up phases, in order: first_step runs from its dispatch to its result, to_first_step
# from train()'s start, command_to_first_step from the process's start (imports included).
STARTUP_PHASES = ("before_set_up", "corpus", "compile", "init", "first_step", "to_first_step",
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


def recent_steps(steps: int) -> int:
    """How many of a run's last steps its train bits per byte covers: the last tenth, at least
    one (the checkpoints keep that many steps' losses)."""
    return max(1, steps // 10)
