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

from experiments.common import (environment, parse_names, plot_loss_curves, run_config,
                                write_json)
from jaxaccel.config import TrainConfig, flag, parse_config
from jaxaccel.errors import ConfigError
from jaxaccel.loop import train
from jaxaccel.optim import LR_SCALING, OPTIMIZERS
from jaxaccel.report import format_table


@dataclasses.dataclass
class OptimizersConfig(TrainConfig):
    """The training flags (with this experiment's defaults) plus what to compare."""

    optimizers: str = flag(",".join(OPTIMIZERS), "comma-separated optimizers for table 1")
    large_batch: bool = flag(True, "also run table 2 (large batch)")
    large_batch_factor: int = flag(8, "table 2's batch is this many times table 1's")
    large_batch_optimizers: str = flag("adamw,lamb", "comma-separated optimizers for table 2")
    scalings: str = flag("linear,sqrt", "comma-separated --lr-scaling rules for table 2")
    batching: str = flag("pack", "batching strategy")
    seq_len: int | None = flag(256, "training sequence length")
    batch_size: int | None = flag(8, "table 1's rows per batch (table 2 multiplies it)")
    train_tokens: int | None = flag(800_000, "real tokens every run trains on")
    warmup_steps: int = flag(40, "table 1's linear warmup steps (table 2 divides them)")
    eval_every: int = flag(0, "evaluate every N steps (0: only at the end)")
    checkpoint_every: int = flag(0, "save a checkpoint every N steps (0: only at the end)")


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
    summary = train(run_config(
        cfg, optimizer=optimizer, batch_size=batch_size, lr_scaling=lr_scaling,
        base_batch_size=cfg.batch_size, run_dir=run_dir,
        warmup_steps=cfg.warmup_steps if warmup_steps is None else warmup_steps))
    return {
        "table": table,
        "label": f"{label}, batch {batch_size}",
        "optimizer": optimizer,
        "batch_size": batch_size,
        "lr_scaling": lr_scaling,
        "learning_rate": summary["learning_rate"],
        "weight_decay": summary["weight_decay"],
        "steps": summary["steps"],
        "real_tokens": summary["real_tokens"],
        "val_loss": summary["val_loss"],
        "val_bpb": summary["val_bpb"],
        "tokens_per_s": summary["real_tokens_per_s"],
        "state_bytes": summary["optimizer_state_bytes"],
        "state_per_param": summary["optimizer_state_bytes"] / summary["params"],
        "params": summary["params"],
        "wall_s": summary["wall_s"],
        "run_dir": run_dir,
    }


def main(argv=None) -> int:
    try:
        cfg = parse_config(argv, OptimizersConfig, description=__doc__.split("\n\n")[0])
        cfg.validate()
        optimizers = parse_names(cfg.optimizers, OPTIMIZERS, "optimizers")
        large = parse_names(cfg.large_batch_optimizers, OPTIMIZERS, "large-batch-optimizers")
        scalings = parse_names(cfg.scalings, LR_SCALING, "scalings")
        if cfg.batch_size is None or cfg.large_batch_factor < 1:
            raise ConfigError("this experiment needs --batch-size and a --large-batch-factor "
                              ">= 1; pass them")
        run_root = cfg.run_dir or os.path.join("runs", time.strftime("optimizers-%Y%m%d-%H%M%S"))
        rows = [run_one(cfg, run_root, optimizer=name, table="defaults",
                        batch_size=cfg.batch_size) for name in optimizers]
        if cfg.large_batch:
            warmup = max(1, round(cfg.warmup_steps / cfg.large_batch_factor))
            rows += [run_one(cfg, run_root, optimizer=name, table="large_batch",
                             batch_size=cfg.batch_size * cfg.large_batch_factor,
                             lr_scaling=rule, warmup_steps=warmup)
                     for name in large for rule in scalings]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    meta = {"model": cfg.model, "data": cfg.data, "batching": cfg.batching,
            "seq_len": cfg.seq_len, "base_batch_size": cfg.batch_size,
            "large_batch_factor": cfg.large_batch_factor, "train_tokens": cfg.train_tokens,
            **environment(), "run_dir": run_root}
    print(f"\n{cfg.model} model, {cfg.train_tokens:,} real tokens per run, seq_len {cfg.seq_len}, "
          f"{cfg.batching} batching, {meta['device']}, jax {meta['jax_version']}")
    print("\nTable 1: each optimizer with its recommended defaults")
    print(format_table([r for r in rows if r["table"] == "defaults"], COLUMNS))
    if cfg.large_batch:
        reference = [r for r in rows if r["table"] == "defaults" and r["optimizer"] in large]
        print(f"\nTable 2: {cfg.large_batch_factor}x the batch on the same tokens (table-1 rows "
              f"of the same optimizers first, for reference)")
        print(format_table(reference + [r for r in rows if r["table"] == "large_batch"], COLUMNS))
    plot_loss_curves(os.path.join(run_root, "optimizers.png"),
                     {r["label"]: r["run_dir"] for r in rows},
                     title=f"optimizers, {cfg.model} model, seq_len {cfg.seq_len}")
    write_json(cfg.json, rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
