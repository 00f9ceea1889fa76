"""What the experiment modules share: the command-line wrapper, list flags, JSON, loss curves,
batch sizes matched across batching strategies, and what an experiment reads of any model (its
GPT shape if it is a preset, its stack's depth, what each technique did in a run's summary).

This module imports no jax (nor flax, orbax), so that an experiment whose own imports are as
light answers ``--help`` fast; what trains or measures imports jax where it runs."""

import contextlib
import dataclasses
import functools
import os
import re
import shlex
import signal
import statistics
import sys
import threading
import time
from typing import Callable

import numpy as np

from jaxaccel.run.config import TrainConfig, describe_error, override, parse
from jaxaccel.data.batching import DataStream
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.hardware import FINAL_EVAL_NOTE, out_of_memory
from jaxaccel.step.metrics import plot_curves, read_metrics, token_curve
from jaxaccel.core.report import dump_json, format_table
from jaxaccel.core.sections import describe, is_preset, preset


def command(config_cls=TrainConfig):
    """Wrap an experiment's ``main(argv) -> exit code``: a ConfigError becomes one line
    ``error: <message> [<flag> / <field>]`` on stderr and exit code 2; SIGINT and SIGTERM stop
    the whole experiment (``stop_on_signals``): an ``Interrupted`` the experiment does not
    handle itself, or a second Ctrl-C, becomes one line ``stopped by SIGINT ...`` and the
    shell's exit code for the signal (130, 143), never a traceback; so does a closed standard
    output (``output_closed``: 141)."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv=None) -> int:
            die_with_parent()
            with stop_on_signals():
                try:
                    return main(argv)
                except ConfigError as e:
                    print(describe_error(e, config_cls), file=sys.stderr)
                    return 2
                except Interrupted as e:
                    print(f"stopped by {e.signal} before the experiment finished; its table "
                          f"is incomplete and was not written", file=sys.stderr)
                    return exit_code(e.signal)
                except Unmeasurable as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 1
                except BrokenPipeError:
                    return output_closed()
                except Exception as e:      # noqa: BLE001 - only allocation failures are ours
                    if peer_lost(e):
                        print(describe_peer_lost(e), file=sys.stderr, flush=True)
                        sys.stdout.flush()
                        os._exit(PEER_LOST)     # jax's exit handler would wait ~100 s, abort
                    if not out_of_memory(e):
                        raise
                    print(describe_out_of_memory(e), file=sys.stderr)
                    return 2
                except KeyboardInterrupt:
                    print("stopped by SIGINT (a second Ctrl-C): at once, nothing more written",
                          file=sys.stderr)
                    return exit_code("SIGINT")

        return run

    return wrap


def output_closed() -> int:
    """What a command does when its standard output's reader has gone (``| head`` that exited):
    stop, as a program killed by SIGPIPE would, with one line on stderr and exit code 141; what
    it wrote stays (a run directory keeps its last checkpoint, ``--resume`` goes on from it).
    Standard output then points at the null device, so that nothing fails again at exit."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
    print("stopped: standard output was closed by its reader (a pipe such as | head exited); "
          "what was written before stays", file=sys.stderr, flush=True)
    return 128 + signal.SIGPIPE


@contextlib.contextmanager
def settings_named():
    """A library function's ConfigError names its argument (``run_dir``); an experiment's
    settings are ``experiment.<name>``: the error names that, so its line shows the flag."""
    try:
        yield
    except ConfigError as e:
        if e.field and "." not in e.field:
            raise ConfigError(str(e), field=f"experiment.{e.field}") from None
        raise


PEER_LOST = 3       # exit code: another process of a multi-process run failed


def peer_lost(error: BaseException) -> bool:
    """A collective that failed because another process of the run went away (gloo's
    connection closed by the peer, the coordination service's heartbeat or barrier errors)."""
    import jax
    if not jax.distributed.is_initialized():
        return False
    text = str(error)       # a JaxRuntimeError from a step, a ValueError from an all-gather
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                         "Gloo", "heartbeat timeout", "Barrier failed"))


def describe_peer_lost(error: BaseException) -> str:
    """The one line for a run whose peer process went away."""
    first = (str(error).splitlines() or [type(error).__name__])[0].strip()[:160]
    return (f"error: another process of this run stopped ({first}); every process stops: "
            f"restart all of them with --resume to continue from the last checkpoint "
            f"(exit code {PEER_LOST})")


def describe_out_of_memory(error: BaseException) -> str:
    """The one line for an allocation failure: what ran out and the settings that fix it."""
    first = (str(error).splitlines() or [type(error).__name__])[0].strip()[:200]
    if FINAL_EVAL_NOTE in getattr(error, "__notes__", ()):
        return (f"error: out of memory in the final evaluation ({first or 'MemoryError'}); "
                f"the last checkpoint is saved: run again with --resume and a smaller "
                f"--eval-batch-size (or fewer --final-eval-batches) to evaluate it")
    return (f"error: out of memory ({first or 'MemoryError'}): the batch, sequence or model "
            f"is too large for this device's (or host's) memory; lower --batch-size (or "
            f"--tokens-per-batch), --seq-len, --d-model / --n-layers, or use --remat full, "
            f"--memory-budget auto, --accumulate N")


# ---------------------------------------------------------------------------------------------
# Stopping a whole experiment on a signal.

class Unmeasurable(Exception):
    """A measurement that leaves nothing to compare against (the baseline failed, or missed
    its target): one line ``error: <message>`` and exit code 1, no table."""


class Interrupted(Exception):
    """A signal stopped the experiment; ``signal`` is its name (``"SIGTERM"``)."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal = signal_name


_received: dict = {}        # {"signal": name} once SIGINT or SIGTERM arrived
_forwards: list = []        # callables(signum) that pass a signal on (to a row's process)


def _record(signum, frame):
    if signum == signal.SIGINT and _received:
        raise KeyboardInterrupt
    _received.setdefault("signal", signal.Signals(signum).name)
    for forward in list(_forwards):
        forward(signum)


@contextlib.contextmanager
def stop_on_signals():
    """For the experiment's whole run: the first SIGINT/SIGTERM is recorded (``stop_requested``),
    passed on to any row process being waited for, and stops the rows (``check_stop``,
    ``train_row``); a second SIGINT interrupts at once. ``loop.train`` installs its own handler
    while a row trains and reads ours through ``should_stop``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = {s: signal.signal(s, _record) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _received.clear()


PARENT_PID = "JAXACCEL_PARENT_PID"   # set for a row process: the experiment that runs it


def die_with_parent():
    """In a row process (``PARENT_PID`` set): get SIGTERM, and so stop with a checkpoint, when
    the experiment that started it dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing); exit at
    once if it is gone already."""
    parent = os.environ.pop(PARENT_PID, None)
    if parent is None:
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):
        raise SystemExit(f"stopped: the experiment that started this run (pid {parent}) is "
                         f"gone")


@contextlib.contextmanager
def passing_signals_to(forward):
    """While inside, a SIGINT/SIGTERM the experiment receives is also given to
    ``forward(signum)`` (e.g. a row process's ``send_signal``)."""
    _forwards.append(forward)
    try:
        yield
    finally:
        _forwards.remove(forward)


def stop_requested() -> str | None:
    """The name of the signal that asked the experiment to stop, or None."""
    return _received.get("signal")


def check_stop():
    """Raise ``Interrupted`` if a signal asked the experiment to stop (call between rows)."""
    if _received:
        raise Interrupted(_received["signal"])


def train_until_stopped(cfg: TrainConfig):
    """``loop.train(cfg)`` as one row of an experiment: the run also stops (its checkpoint
    saved) at a signal the experiment received before it started or between its steps, and its
    summary's ``interrupted`` then names that signal."""
    from jaxaccel.run.loop import train
    summary = train(cfg, should_stop=lambda step: stop_requested() is not None)
    if summary.interrupted:
        _received.setdefault("signal", summary.interrupted)
        summary = dataclasses.replace(summary, interrupted=_received["signal"])
    return summary


def train_row(cfg: TrainConfig):
    """``train_until_stopped(cfg)``, raising ``Interrupted`` for a row cut by a signal (and for
    one asked for after the signal), so that a cut row is never reported as a result."""
    check_stop()
    summary = train_until_stopped(cfg)
    if summary.interrupted:
        raise Interrupted(summary.interrupted)
    return summary


# Exit code of a run (or an experiment with a row) whose loss became NaN or inf: the run
# finished but failed; 2 is bad input, 128 + N a signal.
DIVERGED = 1


def exit_code(interrupted: str | None) -> int:
    """0, or for a run stopped by the signal named ``interrupted`` (``"SIGINT"``) the shell's
    128 + its number (1 for another reason)."""
    if not interrupted:
        return 0
    signum = getattr(signal.Signals, interrupted, None)
    return 128 + signum if signum else 1


def parse_list(text: str, field: str, *, valid=None, kind=str, within=None,
               example: str = "1024,2048") -> list:
    """The comma-separated items of the setting ``field``: names from ``valid``; or (``kind=int``)
    positive integers; or (``kind=float``) finite numbers, each ``within(value)`` if given (a
    predicate with a ``__doc__`` saying what it wants, e.g. "in [0, 1)"), each item once.
    ConfigError naming the field otherwise, with ``example`` as the fix."""
    items = [item.strip() for item in (text or "").split(",") if item.strip()]
    name = field.rpartition(".")[2]
    if kind in (int, float):
        try:
            values = [kind(item) for item in items]
        except ValueError:
            values = []
        words = "positive integers" if kind is int else "numbers"
        if not values or (kind is int and min(values) < 1) or not all(
                abs(v) < float("inf") for v in values):
            raise ConfigError(f"{name}={text!r} is not a comma-separated list of {words}; "
                              f"write e.g. {example}", field=field)
        bad = [v for v in values if within is not None and not within(v)]
        if bad:
            raise ConfigError(f"{name}: {bad[0]:g} is not {within.__doc__}; write e.g. "
                              f"{example}", field=field)
        return once(values, items, name, field)
    unknown = [item for item in items if valid is not None and item not in valid]
    if unknown or not items:
        raise ConfigError((f"unknown {name} {unknown}" if unknown else f"no {name} given")
                          + (f"; choose from {', '.join(valid)}" if valid is not None else
                             f"; write e.g. {example}"), field=field)
    return once(items, items, name, field)


def once(values: list, items: list[str], name: str, field: str) -> list:
    """``values``, each once; else ConfigError. A row listed twice would be measured twice, and
    a training experiment's second run of it would land on the first one's checkpoints."""
    for i, value in enumerate(values):
        if value in values[:i]:
            first = items[values.index(value)]
            same = "" if first == items[i] else f" (as {first!r} and {items[i]!r})"
            raise ConfigError(f"{name} lists {first}{same} twice; list each once",
                              field=field)
    return values


def median_seconds(fn, args, warmup: int, iters: int) -> float:
    """The median wall time of ``iters`` calls ``fn(*args)`` after ``warmup`` untimed ones, each
    ended with ``block_until_ready`` (a signal stops between calls)."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(iters):
        check_stop()
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def environment() -> dict:
    """The device, jax version and date that every result's meta records."""
    import jax
    return {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
            "date": time.strftime("%Y-%m-%d")}


def write_json(path: str | None, rows: list[dict], meta: dict):
    """``{"rows": rows, "meta": meta}`` to ``path`` (nothing without a path)."""
    if path:
        dump_json(path, {"rows": rows, "meta": meta})


def random_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int) -> dict:
    """One packed-style batch of random tokens: every position real, one document per row."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, (batch_size, seq_len + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((batch_size, seq_len), np.float32),
            "segment_ids": np.ones((batch_size, seq_len), np.int32),
            "positions": np.tile(np.arange(seq_len, dtype=np.int32), (batch_size, 1))}


def plot_loss_curves(path: str, run_dirs: dict[str, str], title: str):
    """Train bits per byte against real tokens, one line per run directory (none: no plot)."""
    if not run_dirs:
        return
    curves = {label: token_curve(read_metrics(os.path.join(run_dir, "metrics.jsonl")))
              for label, run_dir in run_dirs.items()}
    plot_curves(path, curves, xlabel="real tokens", title=title)


def matched_batch(documents, cfg: TrainConfig, strategy: str, match: bool = True,
                  multiple: int = 1) -> dict:
    """Batch settings for ``strategy`` whose batches hold about as many real tokens as fixed
    padding's ``data.batch_size`` rows of ``data.seq_len`` do, so all take the same optimizer
    steps, as ``{"data.batch_size": ..., "data.tokens_per_batch": ...}``.

    Without matching, the strategies that cut padding would also take fewer, larger steps for
    the same tokens, and a short run's loss would measure the step count, not the padding.
    Batches whose rows must be a ``multiple`` (devices x microbatches) get the nearest one.
    """
    data = cfg.data

    def real_per_batch(**batching):
        strategy = batching.pop("strategy")
        stream = DataStream(documents, strategy=strategy, seq_len=cfg.seq_len,
                            pad_multiple=data.pad_multiple, num_buckets=data.buckets,
                            data_parallel=multiple if strategy == "bucket" else 1, **batching)
        return stream.stats["real_tokens_per_batch"]

    target = real_per_batch(strategy="fixed", batch_size=data.batch_size)
    if strategy == "bucket":
        budget = max(data.batch_size * cfg.seq_len, cfg.seq_len * multiple)
        if match:
            budget = _matched_budget(lambda b: real_per_batch(strategy="bucket",
                                                              tokens_per_batch=b),
                                     target, cfg.seq_len * multiple,
                                     4 * max(data.batch_size, multiple) * cfg.seq_len)
        return {"data.batch_size": None, "data.tokens_per_batch": budget}
    batch_size = data.batch_size
    if match:
        ratio = target / real_per_batch(strategy=strategy, batch_size=data.batch_size)
        batch_size = max(1, round(data.batch_size * ratio))
    batch_size = max(multiple, round(batch_size / multiple) * multiple)
    return {"data.batch_size": batch_size, "data.tokens_per_batch": None}


def _matched_budget(real_per_batch, target: float, low: int, high: int) -> int:
    """The token budget in [low, high] whose batches hold the real tokens per batch closest to
    ``target``. Real tokens per batch grow with the budget in steps (each bucket's rows round
    down to the batch multiple), so the budget is bisected, keeping the closest one seen.
    ``low``: every bucket needs ``multiple`` rows of its length, the longest up to seq_len."""
    closest = None
    while low <= high:
        middle = (low + high) // 2
        real = real_per_batch(middle)
        if closest is None or abs(real - target) < abs(closest[1] - target):
            closest = (middle, real)
        if real < target:
            low = middle + 1
        else:
            high = middle - 1
    return closest[0]


# ---------------------------------------------------------------------------------------------
# Any model: a preset of jaxaccel's GPT or a factory of one's own (--model FILE.py:FUNCTION).

def parse_experiment(argv, cls, *, defaults: dict, **kwargs):
    """``config.parse`` with an experiment's ``defaults``; when ``--model`` (or ``--config``)
    names a factory of one's own, the defaults of jaxaccel's GPT fields (``gpt.*``: a preset's
    shape, which a factory takes as ``--model-args`` instead) are left out."""
    cfg = parse(argv, cls, defaults=defaults, **kwargs)
    gpt_defaults = [k for k in defaults if k.startswith("gpt.")]
    if not gpt_defaults or is_preset(cfg.model.name):
        return cfg
    return parse(argv, cls, defaults={k: v for k, v in defaults.items()
                                      if k not in gpt_defaults}, **kwargs)


def gpt_shape(cfg):
    """The resolved shape (``gpt.GPTConfig``) of a config's GPT preset; None for a factory."""
    if not is_preset(cfg.model.name):
        return None
    given = {k: v for k, v in dataclasses.asdict(cfg.gpt).items() if v is not None}
    return preset(cfg.model.name, vocab_size=cfg.model.vocab_size,
                  max_seq_len=cfg.model.max_seq_len, **given)


def stack_depth(cfg) -> int | None:
    """The blocks in the model's ``nn.Stack`` (None when it has none): a preset's n_layers, else
    those of the factory's model, built abstractly (nothing computed)."""
    shape = gpt_shape(cfg)
    if shape is not None:
        return shape.n_layers
    import jax
    from jaxaccel.model import contract as model_lib, nn
    model = model_lib.abstract(lambda: model_lib.build(cfg.model, cfg.gpt,
                                                       jax.random.PRNGKey(0)))
    stacks = nn.stacks(model)
    return len(stacks[0][1]) if len(stacks) == 1 else None


def technique(summary, name: str, field: str | None = None, default=None):
    """What technique ``name`` did in a run (``RunSummary.techniques``; a summary or its dict):
    its record, or one ``field`` of it; ``default`` when the run did not use it."""
    done = (summary["techniques"] if isinstance(summary, dict) else summary.techniques) or {}
    record = done.get(name)
    if record is None:
        return default
    if field is None:
        return record
    return record.get(field, default) if isinstance(record, dict) else default


# ---------------------------------------------------------------------------------------------
# The harness: an experiment declares its rows, columns and conclusions; ``main_of`` does the
# rest (parse, check every row before any work, run the rows until a signal, compare, print,
# plot, JSON, exit code).

def config_of(settings: type, base: type | None = TrainConfig) -> type:
    """An experiment's config class: ``base`` (TrainConfig, the config every row shares; None
    for an experiment that trains nothing) with one more section, ``experiment``: ``settings``,
    the experiment's own (a dataclass of ``setting(...)`` fields). Named after the settings
    (``SparsitySettings`` -> ``SparsityConfig``), in their module."""
    name = settings.__name__.removesuffix("Settings") + "Config"
    return dataclasses.make_dataclass(
        name, [("experiment", settings, dataclasses.field(default_factory=settings))],
        bases=(base,) if base else (), module=settings.__module__)


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of an experiment: its ``label`` (the table's and the plot's name for it), the
    config ``settings`` that make it (overrides of the shared config), the ``fields`` its
    result carries as they are (what the row varies), and its run directory under the run
    root (``directory``; default: the label with every run of other characters as one ``-``)."""

    label: str
    settings: dict = dataclasses.field(default_factory=dict)
    fields: dict = dataclasses.field(default_factory=dict)
    directory: str | None = None

    @property
    def dirname(self) -> str:
        return self.directory or re.sub(r"[^A-Za-z0-9._+]+", "-", self.label).strip("-")


@dataclasses.dataclass
class RowRun:
    """What ``Experiment.measure`` gets for one row: the shared config, the row, its run
    directory (None for an experiment that trains nothing), the results of the rows before it
    (in this round), what ``Experiment.shared`` built once for every row, and the round (from
    0)."""

    cfg: object
    row: Row
    run_dir: str | None
    previous: list
    shared: object = None
    round: int = 0

    def config(self, **more):
        """The row's training config: the shared one with the row's settings, its run directory
        and no JSON of its own, and ``more`` (dotted names with ``__`` for ``.``)."""
        extra = {k.replace("__", "."): v for k, v in more.items()}
        return override(self.cfg, {**self.row.settings, "run.run_dir": self.run_dir,
                                   "run.json": None, **extra})


@dataclasses.dataclass
class Experiment:
    """An experiment, declared. Required: ``name`` (the run root's prefix ``runs/<name>-<time>``
    and the plot's file name), ``doc`` (the module's docstring; its first paragraph is
    ``--help``'s), ``config`` (the config class, with an ``experiment`` section), ``rows``
    (cfg -> [Row]: parse the row flags, raise ConfigError before any work), ``columns`` (the
    table: ``(key, header, format)``) and ``setup`` (cfg -> the headline's words on what every
    row shares). The rest is optional:

    - ``defaults`` (a dict, or argv -> a dict: defaults that depend on a flag), ``fixed``,
      ``unused``: as ``config.parse`` takes them;
    - ``prepare``: cfg -> cfg, after parsing and before validation; ``mode``: cfg -> another
      Experiment to run instead on the same parsed config (a flag that switches mode), or a
      function cfg -> exit code (a mode with a loop of its own), or None;
    - ``row_flags``: a row setting -> the flag that sets it, so a row's ConfigError names that;
    - ``check``: (cfg, plan) -> None, the rows' check before any work instead of the default
      (each row's config validated and its model built here, the run root free of their
      checkpoints);
    - ``shared``: cfg -> what every row's measurement needs, built once after the checks;
      ``finish``: (cfg, shared) -> run after the rows however they ended (clean up); a dict
      it returns joins the JSON's meta;
    - ``measure``: RowRun -> the row's result, or a list of results (several table rows);
      default: train it (``trained``); a result whose ``status`` is not ``"ran"``, or that
      says ``"last_round": True`` (nothing a later round could change), ends the row's rounds;
    - ``rounds``: cfg -> N, the times every row is measured, the rows taking turns (round 1 of
      every row, then round 2, ...), so that a change of the machine's load meets every row;
      ``combine``: (cfg, results) -> one row's result from its rounds' (required with rounds);
    - ``followup``: (cfg, rows) -> [Row], a second plan run the same way after the first
      (e.g. a combination chosen from the first's results);
    - ``result``: (summary, RowRun) -> more fields of a trained row;
    - ``compare``: (cfg, rows, partial) -> the columns derived across rows, in place; what it
      returns (a dict) joins the JSON's meta;
    - ``conclude``: (cfg, rows) -> lines on the targets, printed under "Targets:";
    - ``tables``: (cfg, rows, meta) -> [(title, rows, columns)], instead of one table;
    - ``notes``: (cfg, rows, meta) -> lines printed after the tables;
    - ``meta``: (cfg, rows) -> the JSON meta's own keys (the shared config's are there; an
      experiment whose meta names the ``device`` keeps this process off it);
    - ``plot``: "loss" (training bits per byte against real tokens, a line per row), None, or
      (path, cfg, rows) -> None, or the paths it wrote; ``plot_title``: the title before
      ``, <model> model``;
    - ``report``: (cfg, rows, meta) -> more markdown lines: the run root gets ``report.md``,
      what was printed and these lines;
    - ``trains``: False for an experiment whose config has no ``run`` section;
    - ``failed``: rows -> True when a measurement failed (exit code 1, after the report)."""

    name: str
    doc: str
    config: type
    rows: Callable
    columns: list
    setup: Callable
    defaults: dict | Callable = dataclasses.field(default_factory=dict)
    fixed: tuple = ()
    unused: dict = dataclasses.field(default_factory=dict)
    prepare: Callable | None = None
    row_flags: dict = dataclasses.field(default_factory=dict)
    check: Callable | None = None
    shared: Callable | None = None
    measure: Callable | None = None
    rounds: Callable | None = None
    combine: Callable | None = None
    followup: Callable | None = None
    result: Callable | None = None
    compare: Callable | None = None
    conclude: Callable | None = None
    tables: Callable | None = None
    notes: Callable | None = None
    meta: Callable | None = None
    plot: Callable | str | None = "loss"
    plot_title: str = ""
    report: Callable | None = None
    trains: bool = True
    finish: Callable | None = None
    failed: Callable | None = None
    mode: Callable | None = None


def main_of(exp: Experiment):
    """The experiment's ``main(argv) -> exit code`` (``command``: one line on bad input, the
    signal's exit code)."""

    @command(exp.config)
    def main(argv=None) -> int:
        return run_experiment(exp, argv)

    main.__doc__ = exp.doc
    return main


def parse_config(exp: Experiment, argv: list[str]):
    """The experiment's config from ``argv``: parsed over its defaults, the run root resolved
    (``runs/<name>-<time>``), prepared and validated. No work is done."""
    defaults = exp.defaults(argv) if callable(exp.defaults) else exp.defaults
    cfg = parse_experiment(argv, exp.config, defaults=defaults, fixed=exp.fixed,
                           unused=exp.unused, description=exp.doc.split("\n\n")[0])
    if exp.trains and not cfg.run.run_dir:       # the run root, known to every hook
        cfg = override(cfg, {"run.run_dir": os.path.join(
            "runs", time.strftime(f"{exp.name}-%Y%m%d-%H%M%S"))})
    if exp.prepare:
        cfg = exp.prepare(cfg)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def run_experiment(exp: Experiment, argv) -> int:
    """Parse, plan and check every row, run them until a signal, then report (``Experiment``)."""
    began = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    module = exp.config.__module__
    if module == "__main__":        # python -m experiments.<name>
        module = getattr(sys.modules["__main__"].__spec__, "name", module)
    command_line = f"python -m {module} {shlex.join(argv)}".strip()
    cfg = parse_config(exp, argv)
    chosen = exp.mode(cfg) if exp.mode else None
    if chosen is not None and not isinstance(chosen, Experiment):
        return chosen(cfg)              # a mode with a loop of its own
    exp = chosen or exp
    try:
        plan = exp.rows(cfg)
    except ConfigError as e:            # named as the experiment flag that sets the field
        raise ConfigError(str(e), field=exp.row_flags.get(e.field, e.field)) from None
    root = cfg.run.run_dir if exp.trains else None
    if exp.check:
        exp.check(cfg, plan)
    elif exp.trains:
        check_rows(cfg, plan, exp.row_flags)
        check_run_root(root, plan)
    shared = exp.shared(cfg) if exp.shared else None
    rows, partial, finished, planned = [], None, None, len(plan)
    try:
        run_plan(exp, cfg, plan, root, shared, rows)
        more = exp.followup(cfg, rows) if exp.followup else []
        planned += len(more)
        run_plan(exp, cfg, more, root, shared, rows)
    except Interrupted as stop:         # the cut row is not a result; later rows do not run
        partial = stop.signal
    finally:
        if exp.finish:
            finished = exp.finish(cfg, shared)
    meta = (exp.compare(cfg, rows, partial) if exp.compare and rows else None) or {}
    lines = exp.conclude(cfg, rows) if exp.conclude and rows else []
    meta = {**shared_meta(cfg, exp.unused), **(exp.meta(cfg, rows) if exp.meta else {}), **meta,
            **(finished or {}), **({"targets": lines} if exp.conclude else {}),
            "command": command_line, "run_dir": root, "interrupted": partial,
            "wall_s": time.perf_counter() - began}
    if "device" not in meta:
        meta.update(environment())
    text = [f"{exp.setup(cfg)}; {meta['device']}, jax {meta['jax_version']}"
            + (f" (PARTIAL: stopped by {partial}; {len(rows)} of {planned} rows ran)"
               if partial else "")]
    tables = exp.tables(cfg, rows, meta) if exp.tables else [(None, rows, exp.columns)]
    for title, table_rows, columns in tables:
        text += [""] + ([title] if title else []) + [format_table(table_rows, columns)]
    if lines:
        text += ["", "Targets:", *[f"- {line}" for line in lines]]
    text += exp.notes(cfg, rows, meta) if exp.notes else []
    print("\n" + "\n".join(text))
    if root and exp.plot and rows:
        path = os.path.join(root, f"{exp.name}.png")
        if exp.plot == "loss":
            plot_loss_curves(path, {r["label"]: r["run_dir"] for r in rows},
                             title=f"{exp.plot_title or exp.name}, {meta['model']} model")
        written = [path] if exp.plot == "loss" else exp.plot(path, cfg, rows) or [path]
        for path in written:
            if os.path.exists(path):
                print(f"plot: {path}")
    if root and exp.report:
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, "report.md"), "w") as f:
            f.write("\n".join([f"# {module}", "", f"Command: `{command_line}`  ",
                               f"{meta['date']}, {meta['wall_s'] / 60:.1f} minutes", "", *text,
                               "", *exp.report(cfg, rows, meta)]) + "\n")
    write_json(json_path(cfg), rows, meta)
    if partial:
        return exit_code(partial)
    return 1 if exp.failed and exp.failed(rows) else 0


def run_plan(exp: Experiment, cfg, plan: list[Row], root: str | None, shared, rows: list):
    """Measure every row of ``plan`` (``exp.rounds`` times, the rows taking turns), appending
    the results to ``rows``; a signal raises ``Interrupted`` after the rounds that finished
    were kept (the cut one is none)."""
    rounds = exp.rounds(cfg) if exp.rounds else 1
    if rounds > 1 and not exp.combine:
        raise TypeError(f"experiment {exp.name} measures rounds and combines none")
    results = [[] for _ in plan]        # each row's results, a list per round
    try:
        for index in range(rounds):
            this_round = []
            for row, earlier in zip(plan, results):
                if earlier and any(r.get("status", "ran") != "ran" or r.get("last_round")
                                   for r in earlier[-1]):
                    continue            # failed, skipped or decided in an earlier round
                check_stop()
                run = RowRun(cfg, row, root and os.path.join(root, row.dirname), this_round,
                             shared, index)
                result = exp.measure(run) if exp.measure else trained(run, exp.result)
                found = [{"label": row.label, **row.fields, **one}
                         for one in (result if isinstance(result, list) else [result])]
                earlier.append(found)
                this_round += found
                if not exp.combine:
                    rows += found
    finally:
        if exp.combine:
            rows += [exp.combine(cfg, [r for found in earlier for r in found])
                     for earlier in results if earlier]


def json_path(cfg) -> str | None:
    """Where the rows go as JSON: ``--json`` (the run's, or the experiment's own)."""
    return cfg.run.json if hasattr(cfg, "run") else getattr(cfg.experiment, "json", None)


def shared_meta(cfg, unused: dict = ()) -> dict:
    """The JSON meta of what every row of a training experiment shares (less the fields the
    experiment does not use)."""
    if not isinstance(cfg, TrainConfig):
        return {}
    meta = {"model": describe(cfg.model, cfg.gpt), "data": cfg.data.path,
            "batching": cfg.data.batching, "seq_len": cfg.seq_len,
            "batch_size": cfg.data.batch_size, "steps": cfg.run.steps,
            "train_tokens": cfg.run.train_tokens, "seed": cfg.run.seed}
    paths = {"data": "data.path", "batching": "data.batching"}
    return {k: v for k, v in meta.items() if paths.get(k) not in unused}


def check_rows(cfg, plan: list[Row], flags: dict):
    """Every row's config validated and its model built abstractly (every technique applied),
    before any work; an error in a setting a row flag sets names that flag."""
    from jaxaccel.techniques import registry as techniques
    for row in plan:
        try:
            row_cfg = override(cfg, row.settings)
            row_cfg.validate()
            techniques.abstract(row_cfg)
        except ConfigError as e:
            raise ConfigError(str(e), field=flags.get(e.field, e.field)) from None


def check_packing(cfg, row: Row, field: str = "data.batching"):
    """A row that packs documents by its own batching (the run's is checked when the run starts,
    naming --batching) needs a model whose call takes them apart: found only when the row
    starts, it would come after the rows before it trained."""
    from jaxaccel.techniques import registry as techniques
    from jaxaccel.model.contract import call_arguments
    if cfg.data.batching != "pack":
        return
    missing = {"positions", "segment_ids"} - call_arguments(techniques.abstract(cfg))
    if missing:
        raise ConfigError(f"model {cfg.model.name}: the row {row.label!r} packs several "
                          f"documents in a row, so the model's call must take "
                          f"{'= and '.join(sorted(missing))}= (and mask attention by segment); "
                          f"add them, or leave that row out", field=field)


def check_run_root(run_root: str, plan: list[Row]):
    """No row may land on an earlier run's checkpoints (found only after the rows before it
    trained), nor on another row's directory."""
    labels = {}
    for row in plan:
        if row.dirname in labels:
            raise ConfigError(f"rows {labels[row.dirname]!r} and {row.label!r} would train into "
                              f"one directory, {os.path.join(run_root, row.dirname)}; list each "
                              f"row once")
        labels[row.dirname] = row.label
    for row in plan:
        checkpoints = os.path.join(run_root, row.dirname, "checkpoints")
        if os.path.isdir(checkpoints) and os.listdir(checkpoints):
            raise ConfigError(f"run dir {run_root} already holds this experiment's row "
                              f"{row.label!r}; choose another run_dir", field="run.run_dir")


def trained(run: RowRun, more=None) -> dict:
    """Train the row (``train_row``: a signal cuts it) and reduce its summary to a result: the
    figures every training experiment reports, and ``more(summary, run)``."""
    summary = train_row(run.config())
    return {**summary_fields(summary), **(more(summary, run) if more else {})}


def summary_fields(summary) -> dict:
    """A trained row's common figures, from its ``RunSummary``."""
    steps = summary.steps_this_run
    return {"steps": summary.steps, "real_tokens": summary.real_tokens,
            "train_s": summary.train_s, "wall_s": summary.wall_s,
            "compile_s": summary.compile_s, "step_ms": 1e3 * summary.train_s / steps
            if steps else None, "real_tokens_per_s": summary.real_tokens_per_s,
            "flops_per_token": summary.flops_per_token, "params": summary.params,
            "train_bpb": summary.train_bpb, "val_loss": summary.val_loss,
            "val_bpb": summary.val_bpb, "val_tokens": summary.val_tokens,
            "unigram_bpb": summary.unigram_bpb, "diverged_at_step": summary.diverged_at_step,
            "run_dir": summary.run_dir}


def relative(rows: list[dict], base: dict | None, **columns):
    """Columns against a ``base`` row, in place: ``name=(key, how)`` sets ``row[name]`` to
    ``row[key] / base[key]`` (how ``"ratio"``), ``base[key] / row[key]`` (``"inverse"``),
    ``row[key] / base[key] - 1`` (``"change"``), ``1 - row[key] / base[key]`` (``"saving"``)
    or ``row[key] - base[key]`` (``"difference"``); None where the base or a value is missing
    (or a divisor 0)."""
    for row in rows:
        for name, (key, how) in columns.items():
            a, b = row.get(key), base and base.get(key)
            if a is None or b is None or (how != "difference" and not (a if how == "inverse"
                                                                       else b)):
                row[name] = None
            else:
                row[name] = {"ratio": lambda: a / b, "inverse": lambda: b / a,
                             "change": lambda: a / b - 1, "saving": lambda: 1 - a / b,
                             "difference": lambda: a - b}[how]()


def first(rows: list[dict], **match) -> dict | None:
    """The first row whose fields equal ``match``."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def eval_curve(run_dir: str) -> list[dict]:
    """Every evaluation of a run in step order: its step, loss, the training seconds up to it
    (those of the train record logged at its step; the first one after it if none was) and the
    real tokens seen by then (the train records logged at or before its step)."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    trained_at = sorted((r["step"], r["train_s"], r["real_tokens"]) for r in records
                        if r["kind"] == "train")
    curve = []
    for r in sorted((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"]):
        seconds = next((s for step, s, _ in trained_at if step >= r["step"]), None)
        tokens = sum(t for step, _, t in trained_at if step <= r["step"])
        curve.append({"step": r["step"], "loss": r["loss"], "train_s": seconds,
                      "tokens": tokens})
    return curve


def first_reaching(curve: list[dict], target: float | None) -> dict | None:
    """The first evaluation of ``curve`` at or below ``target``; None if none is."""
    if target is None:
        return None
    return next((point for point in curve if point["loss"] <= target), None)


def plot_eval_curves(path: str, rows: list[dict], x: str, xlabel: str, ylabel: str,
                     title: str, scale: float = 1.0, flat: str | None = None):
    """Validation loss (times ``scale``) against ``x`` of the rows' ``eval_curve``, a line per
    row, and the first row's final value as a flat line labelled ``flat``."""
    curves = {row["label"]: ([p[x] for p in row["eval_curve"]],
                             [p["loss"] * scale for p in row["eval_curve"]])
              for row in rows if row.get("eval_curve")}
    base = rows[0]
    if flat and base.get("val_loss") is not None and curves:
        right = max(max(xs) for xs, _ in curves.values())
        curves[flat] = ([0, right], [base["val_loss"] * scale] * 2)
    plot_curves(path, curves, xlabel=xlabel, ylabel=ylabel, title=title)


def same_eval_batches(cfg):
    """``cfg`` whose final evaluation takes the periodic ones' batches (unless it is given),
    so that every evaluation of every row compares with the baseline's final one."""
    if cfg.run.final_eval_batches is not None or not cfg.run.eval_batches:
        return cfg
    return override(cfg, {"run.final_eval_batches": cfg.run.eval_batches})


def shared_run(cfg) -> str:
    """What every row of a training experiment shares, in words (the header's start)."""
    return (f"{describe(cfg.model, cfg.gpt)} model, {length(cfg)} per row on the same batches "
            f"(batch {cfg.batch_rows()} x seq_len {cfg.seq_len}, {cfg.data.batching} batching)")


def length(cfg) -> str:
    """How long every row trains: real tokens, or steps when run.train_tokens is unset."""
    if cfg.run.train_tokens is None:
        return f"{cfg.run.steps:,} steps"
    return f"{cfg.run.train_tokens:,} real tokens"
