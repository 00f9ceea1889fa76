"""Optimizers side by side: each one's recommended defaults on the same model and tokens, then
large batches under learning-rate scaling rules.

    python -m experiments.optimizers                      # both tables on the CPU, ~30 minutes
    python -m experiments.optimizers --optimizers adamw,lion --no-large-batch
    python -m experiments.optimizers --json optimizers.json

Table 1 trains one model per optimizer (``--optimizers``), each with the learning rate and weight
decay of ``jaxaccel.optim.DEFAULTS``, on the same real tokens in the same order, and reports the
final validation loss, real tokens/s and the optimizer state's bytes. Table 2 trains
``--large-batch-factor`` times the batch on the same tokens (so that many times fewer steps) with
``--large-batch-optimizers`` under each ``--scalings`` rule, the learning rate scaled from the
table-1 batch, and the warmup shortened by the same factor so it covers the same tokens. Loss
curves against tokens go to ``optimizers.png`` in the run directory.
"""

import dataclasses
import os
import sys
import time

from experiments.common import (Interrupted, command, environment, exit_code, parse_list,
                                plot_loss_curves, train_row, write_json)
from jaxaccel.config import TrainConfig, override, parse, setting
from jaxaccel.errors import ConfigError
from jaxaccel.model import describe
from jaxaccel.optim import LR_SCALING, OPTIMIZERS
from jaxaccel.report import format_table


@dataclasses.dataclass
class OptimizersSettings:
    optimizers: str = setting(",".join(OPTIMIZERS), "comma-separated optimizers for table 1")
    large_batch: bool = setting(True, "also run table 2 (large batch)")
    large_batch_factor: int = setting(8, "table 2's batch is this many times table 1's")
    large_batch_optimizers: str = setting("adamw,lamb", "comma-separated optimizers for table 2")
    scalings: str = setting("linear,sqrt", "comma-separated learning-rate scaling rules "
                                           "(optimizer.lr_scaling) for table 2")


@dataclasses.dataclass
class OptimizersConfig(TrainConfig):
    """The training config (with this experiment's defaults) plus what to compare."""

    experiment: OptimizersSettings = dataclasses.field(default_factory=OptimizersSettings)


# This experiment's defaults: data.batch_size and optimizer.warmup_steps are table 1's (table 2
# multiplies the batch and divides the warmup); 0 evaluates and checkpoints only at the end.
# Each row sets its own optimizer, learning-rate scaling and base batch size.
DEFAULTS = {"data.batching": "pack", "data.seq_len": 256, "data.batch_size": 8,
            "run.train_tokens": 800_000, "optimizer.warmup_steps": 40, "run.eval_every": 0,
            "run.checkpoint_every": 0}
FIXED = ("optimizer.name", "optimizer.lr_scaling", "optimizer.base_batch_size")


COLUMNS = [
    ("optimizer", "optimizer", ""),
    ("batch_size", "batch", "d"),
    ("lr_scaling", "lr scaling", ""),
    ("learning_rate", "peak lr", ".3g"),
    ("weight_decay", "wd", ".3g"),
    ("steps", "steps", "d"),
    ("val_loss", "val loss", ".4f"),
    ("val_bpb", "val bpb", ".3f"),
    ("tokens_per_s", "real tok/s", ",.0f"),
    ("state_bytes", "state bytes", ",d"),
    ("state_per_param", "state B/param", ".2f"),
    ("wall_s", "wall s", ".1f"),
]


def run_one(cfg: OptimizersConfig, run_root: str, *, optimizer: str, table: str,
            batch_size: int, lr_scaling: str = "none", warmup_steps: int | None = None) -> dict:
    """Train one configuration and reduce its summary to a table row."""
    label = optimizer if lr_scaling == "none" else f"{optimizer}-{lr_scaling}"
    run_dir = os.path.join(run_root, f"{table}-{label}-b{batch_size}")
    summary = train_row(override(cfg, {
        "optimizer.name": optimizer, "data.batch_size": batch_size,
        "optimizer.lr_scaling": lr_scaling, "optimizer.base_batch_size": cfg.data.batch_size,
        "optimizer.warmup_steps": (cfg.optimizer.warmup_steps if warmup_steps is None
                                   else warmup_steps),
        "run.run_dir": run_dir, "run.json": None}))
    return {
        "table": table,
        "label": f"{label}, batch {batch_size}",
        "optimizer": optimizer,
        "batch_size": batch_size,
        "lr_scaling": lr_scaling,
        "learning_rate": summary.learning_rate,
        "weight_decay": summary.weight_decay,
        "steps": summary.steps,
        "real_tokens": summary.real_tokens,
        "val_loss": summary.val_loss,
        "val_bpb": summary.val_bpb,
        "diverged_at_step": summary.diverged_at_step,
        "tokens_per_s": summary.real_tokens_per_s,
        "state_bytes": summary.optimizer_state_bytes,
        "state_per_param": summary.optimizer_state_bytes / summary.params,
        "params": summary.params,
        "wall_s": summary.wall_s,
        "run_dir": run_dir,
    }


def _length(cfg: TrainConfig) -> str:
    """How long every run trains: real tokens, or steps when run.train_tokens is unset."""
    if cfg.run.train_tokens is None:
        return f"{cfg.run.steps:,} steps"
    return f"{cfg.run.train_tokens:,} real tokens"


@command(OptimizersConfig)
def main(argv=None) -> int:
    cfg = parse(argv, OptimizersConfig, defaults=DEFAULTS, fixed=FIXED,
                description=__doc__.split("\n\n")[0])
    cfg.validate()
    exp = cfg.experiment
    optimizers = parse_list(exp.optimizers, "experiment.optimizers", valid=OPTIMIZERS)
    large = parse_list(exp.large_batch_optimizers, "experiment.large_batch_optimizers",
                       valid=OPTIMIZERS)
    scalings = parse_list(exp.scalings, "experiment.scalings", valid=LR_SCALING)
    batch_size = cfg.data.batch_size
    if batch_size is None:
        raise ConfigError("this experiment takes table 1's batch size in rows",
                          field="data.batch_size")
    if exp.large_batch_factor < 1:
        raise ConfigError(f"large_batch_factor must be at least 1, got {exp.large_batch_factor}",
                          field="experiment.large_batch_factor")
    run_root = cfg.run.run_dir or os.path.join("runs", time.strftime("optimizers-%Y%m%d-%H%M%S"))
    plan = [dict(optimizer=name, table="defaults", batch_size=batch_size) for name in optimizers]
    if exp.large_batch:
        warmup = max(1, round(cfg.optimizer.warmup_steps / exp.large_batch_factor))
        plan += [dict(optimizer=name, table="large_batch",
                      batch_size=batch_size * exp.large_batch_factor, lr_scaling=rule,
                      warmup_steps=warmup) for name in large for rule in scalings]
    rows, partial = [], None
    try:
        for row in plan:
            rows.append(run_one(cfg, run_root, **row))
    except Interrupted as stop:         # the cut row is not a result; later rows do not run
        partial = stop.signal

    model = describe(cfg.model, cfg.gpt)
    meta = {"model": model, "data": cfg.data.path, "batching": cfg.data.batching,
            "seq_len": cfg.seq_len, "base_batch_size": batch_size,
            "large_batch_factor": exp.large_batch_factor, "train_tokens": cfg.run.train_tokens,
            **environment(), "run_dir": run_root, "interrupted": partial}
    print(f"\n{model} model, {_length(cfg)} per run, seq_len {cfg.seq_len}, "
          f"{cfg.data.batching} batching, {meta['device']}, jax {meta['jax_version']}"
          + (f" (PARTIAL: stopped by {partial}; {len(rows)} of {len(plan)} rows ran)"
             if partial else ""))
    print("\nTable 1: each optimizer with its recommended defaults")
    print(format_table([r for r in rows if r["table"] == "defaults"], COLUMNS))
    if exp.large_batch:
        reference = [r for r in rows if r["table"] == "defaults" and r["optimizer"] in large]
        print(f"\nTable 2: {exp.large_batch_factor}x the batch on the same tokens (table-1 rows "
              f"of the same optimizers first, for reference)")
        print(format_table(reference + [r for r in rows if r["table"] == "large_batch"], COLUMNS))
    plot_loss_curves(os.path.join(run_root, "optimizers.png"),
                     {r["label"]: r["run_dir"] for r in rows},
                     title=f"optimizers, {model} model, seq_len {cfg.seq_len}")
    write_json(cfg.run.json, rows, meta)
    return exit_code(partial)


if __name__ == "__main__":
    sys.exit(main())
