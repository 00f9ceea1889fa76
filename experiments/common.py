"""What the experiment modules share: the command-line wrapper, list flags, JSON, loss curves,
batch sizes matched across batching strategies, and what an experiment reads of any model (its
GPT shape if it is a preset, its stack's depth, what each technique did in a run's summary)."""

import contextlib
import dataclasses
import functools
import os
import signal
import statistics
import sys
import threading
import time

import jax
import numpy as np

from jaxaccel.config import TrainConfig, describe_error, parse
from jaxaccel.data import DataStream
from jaxaccel.errors import ConfigError
from jaxaccel.metrics import plot_curves, read_metrics, token_curve
from jaxaccel.model import is_preset
from jaxaccel.report import dump_json, format_table


def command(config_cls=TrainConfig):
    """Wrap an experiment's ``main(argv) -> exit code``: a ConfigError becomes one line
    ``error: <message> [<flag> / <field>]`` on stderr and exit code 2; SIGINT and SIGTERM stop
    the whole experiment (``stop_on_signals``): an ``Interrupted`` the experiment does not
    handle itself, or a second Ctrl-C, becomes one line ``stopped by SIGINT ...`` and the
    shell's exit code for the signal (130, 143), never a traceback."""

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


def out_of_memory(error: BaseException) -> bool:
    """An allocation failure: Python's MemoryError, or XLA's RESOURCE_EXHAUSTED (a
    ``JaxRuntimeError`` / ``XlaRuntimeError`` whose message starts with it)."""
    return isinstance(error, MemoryError) or (
        type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
        and "RESOURCE_EXHAUSTED" in str(error).split("\n", 1)[0])


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
    return (f"error: out of memory ({first or 'MemoryError'}): the batch, sequence or model "
            f"is too large for this device's (or host's) memory; lower --batch-size (or "
            f"--tokens-per-batch), --seq-len, --d-model / --n-layers, or use --remat full, "
            f"--memory-budget auto, --accumulate N")


# ---------------------------------------------------------------------------------------------
# Stopping a whole experiment on a signal.

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
    from jaxaccel.loop import train
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


def print_table(rows: list[dict], columns, targets: list[str]):
    """The experiment's table, then its targets' verdicts (if any) as a list."""
    print(format_table(rows, columns))
    if targets:
        print("\nTargets:")
        print("\n".join(f"- {line}" for line in targets))


def parse_list(text: str, field: str, *, valid=None, kind=str) -> list:
    """The comma-separated items of the setting ``field``: names from ``valid``, or (``kind=int``)
    positive integers; ConfigError naming the field otherwise."""
    items = [item.strip() for item in (text or "").split(",") if item.strip()]
    name = field.rpartition(".")[2]
    if kind is int:
        try:
            values = [int(item) for item in items]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise ConfigError(f"{name}={text!r} is not a comma-separated list of positive "
                              f"integers; write e.g. 1024,2048", field=field)
        return values
    unknown = [item for item in items if valid is not None and item not in valid]
    if unknown or not items:
        raise ConfigError(f"unknown {name} {unknown}; choose from {', '.join(valid)}",
                          field=field)
    return items


def median_seconds(fn, args, warmup: int, iters: int) -> float:
    """The median wall time of ``iters`` calls ``fn(*args)`` after ``warmup`` untimed ones, each
    ended with ``block_until_ready`` (a signal stops between calls)."""
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
    from jaxaccel import gpt
    if not is_preset(cfg.model.name):
        return None
    given = {k: v for k, v in dataclasses.asdict(cfg.gpt).items() if v is not None}
    return gpt.preset(cfg.model.name, vocab_size=cfg.model.vocab_size,
                      max_seq_len=cfg.model.max_seq_len, **given)


def stack_depth(cfg) -> int | None:
    """The blocks in the model's ``nn.Stack`` (None when it has none): a preset's n_layers, else
    those of the factory's model, built abstractly (nothing computed)."""
    shape = gpt_shape(cfg)
    if shape is not None:
        return shape.n_layers
    from jaxaccel import model as model_lib, nn
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
