"""What the experiment modules share: one training run per row, JSON output, loss curves."""

import dataclasses
import json
import os
import time

import jax

from jaxaccel.config import TrainConfig
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
