"""What the experiment modules share: one training run per row, JSON output, loss curves."""

import dataclasses
import json
import os
import time

import jax

from jaxaccel.config import TrainConfig
from jaxaccel.data import DataStream
from jaxaccel.errors import ConfigError
from jaxaccel.metrics import plot_curves, read_metrics, token_curve


def run_config(cfg: TrainConfig, **overrides) -> TrainConfig:
    """A plain TrainConfig with the experiment's training settings and one row's overrides."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)}
    fields.update(json=None, **overrides)
    return TrainConfig(**fields)


def parse_names(text: str, valid, flag_name: str) -> list[str]:
    """The comma-separated names of ``--flag_name``; ConfigError if one is not in ``valid``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ConfigError(f"unknown {flag_name} {unknown}; choose --{flag_name} from "
                          f"{', '.join(valid)}")
    return names


def environment() -> dict:
    """The device, jax version and date that every result's meta records."""
    return {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
            "date": time.strftime("%Y-%m-%d")}


def write_json(path: str | None, rows: list[dict], meta: dict):
    """``{"rows": rows, "meta": meta}`` to ``path`` (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump({"rows": rows, "meta": meta}, f, indent=2)


def plot_loss_curves(path: str, run_dirs: dict[str, str], title: str):
    """Train bits per byte against real tokens, one line per run directory."""
    curves = {label: token_curve(read_metrics(os.path.join(run_dir, "metrics.jsonl")))
              for label, run_dir in run_dirs.items()}
    plot_curves(path, curves, xlabel="real tokens", title=title)


def matched_batch(documents, cfg: TrainConfig, strategy: str, match: bool = True,
                  multiple: int = 1) -> dict:
    """Batch settings for ``strategy`` whose batches hold about as many real tokens as fixed
    padding's ``cfg.batch_size`` rows of ``cfg.seq_len`` do, so all take the same optimizer steps.

    Without matching, the strategies that cut padding would also take fewer, larger steps for
    the same tokens, and a short run's loss would measure the step count, not the padding.
    Batches whose rows must be a ``multiple`` (devices x microbatches) get the nearest one.
    """
    def real_per_batch(**batching):
        strategy = batching.pop("strategy")
        stream = DataStream(documents, strategy=strategy, seq_len=cfg.seq_len,
                            pad_multiple=cfg.pad_multiple, num_buckets=cfg.buckets,
                            data_parallel=multiple if strategy == "bucket" else 1, **batching)
        return stream.stats["real_tokens_per_batch"]

    target = real_per_batch(strategy="fixed", batch_size=cfg.batch_size)
    if strategy == "bucket":
        budget = cfg.batch_size * cfg.seq_len
        for _ in range(2 if match else 0):  # batch sizes per bucket round down
            budget = round(budget * target / real_per_batch(strategy="bucket",
                                                            tokens_per_batch=budget))
        return {"batch_size": None, "tokens_per_batch": budget}
    batch_size = cfg.batch_size
    if match:
        ratio = target / real_per_batch(strategy=strategy, batch_size=cfg.batch_size)
        batch_size = max(1, round(cfg.batch_size * ratio))
    batch_size = max(multiple, round(batch_size / multiple) * multiple)
    return {"batch_size": batch_size, "tokens_per_batch": None}
