"""Where a run's metrics go: JSONL in the run directory, the trackers asked for, a PNG."""

import errno
import json
import math
import os

import numpy as np

from jaxaccel.core.errors import ConfigError
from jaxaccel.core.report import finite_json

BITS_PER_NAT = 1.0 / math.log(2.0)


class MetricsWriter:
    """Appends one JSON object per record to ``metrics.jsonl``; mirrors its numbers to the
    ``trackers`` (``jaxaccel.run.trackers``: TensorBoard, W&B) as ``<kind>/<name>``."""

    def __init__(self, run_dir: str, process_index: int = 0, trackers=()):
        self.path = metrics_path(run_dir, process_index)
        self._file = open(self.path, "a")
        self._trackers = list(trackers)

    def write(self, step: int, kind: str, values: dict):
        values = {k: v.item() if isinstance(v, (np.generic, np.ndarray)) else v
                  for k, v in values.items()}
        record = {"step": int(step), "kind": kind, **values}
        try:
            self._file.write(json.dumps(finite_json(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as e:
            raise ConfigError(
                f"cannot write {self.path} ({e.strerror or e}); "
                + ("free disk space" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                   else "make the folder writable")
                + " and continue with --resume, or pass another run_dir",
                field="run.run_dir") from None
        scalars = {key: value for key, value in record.items() if key not in ("step", "kind")
                   and isinstance(value, (int, float)) and not isinstance(value, bool)}
        for tracker in self._trackers:
            tracker.log(int(step), kind, scalars)

    def close(self):
        self._file.close()
        for tracker in self._trackers:
            tracker.close()


def metrics_path(run_dir: str, process_index: int = 0) -> str:
    """A process's metrics file: every process sees the same global metrics, each writes its
    own file (process 0 ``metrics.jsonl``), none overwrites another's."""
    name = "metrics.jsonl" if process_index == 0 else f"metrics.process{process_index}.jsonl"
    return os.path.join(run_dir, name)


def read_metrics(path: str) -> list[dict]:
    """The records of a ``metrics.jsonl``; a last line cut short (a killed run) is left out."""
    return _read(path)[0]


def _read(path: str) -> tuple[list[dict], int]:
    """The records of ``path`` and its count of non-blank lines."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
    return records, len(lines)


def truncate_metrics(path: str, step: int) -> int:
    """Keeps the records of ``path`` written before the checkpoint of ``step`` that a run
    resumes from (0: a run starting over): those of the steps up to it, but not the final
    evaluation of ``step`` (``"final": true``: it came after that checkpoint, and the resumed
    run evaluates again); drops a cut last line. Returns how many lines went."""
    if not os.path.exists(path):
        return 0
    records, num_lines = _read(path)
    kept = [r for r in records if r["step"] < step or (r["step"] == step and not r.get("final"))]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(path + ".tmp", path)
    return num_lines - len(kept)


def plot_loss_curve(records: list[dict], path: str, *, unigram_bpb: float | None = None,
                    title: str = "loss"):
    """Train and validation bits per byte against step, with the unigram baseline dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, style in (("train", "-"), ("eval", "o-")):
        points = [(r["step"], r["bpb"]) for r in records if r["kind"] == kind and "bpb" in r]
        if points:
            steps, bpb = zip(*points)
            ax.plot(steps, bpb, style, label="validation" if kind == "eval" else kind, ms=4)
    if unigram_bpb is not None:
        ax.axhline(unigram_bpb, ls="--", color="gray", label=f"unigram entropy {unigram_bpb:.2f}")
    ax.set(xlabel="step", ylabel="bits per byte", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def token_curve(records: list[dict]) -> tuple[list[float], list[float]]:
    """(cumulative real tokens, train bits per byte) at each train record of a run."""
    tokens, bpb, seen = [], [], 0
    for r in records:
        if r["kind"] == "train":
            seen += r["real_tokens"]
            tokens.append(seen)
            bpb.append(r["bpb"])
    return tokens, bpb


def plot_curves(path: str, curves: dict[str, tuple[list[float], list[float]]], *,
                xlabel: str, ylabel: str = "train bits per byte", title: str = ""):
    """Several runs' curves on one axis, one line per label, written as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
