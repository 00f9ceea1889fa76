"""Optimizers side by side: each one's recommended defaults on the same model and tokens, then
large batches under learning-rate scaling rules.

    python -m experiments.optimizers                      # both tables on the CPU, ~30 minutes
    python -m experiments.optimizers --optimizers adamw,lion --no-large-batch
    python -m experiments.optimizers --json optimizers.json

Table 1 trains one model per optimizer (``--optimizers``), each with the learning rate and weight
decay of ``jaxaccel.step.optim.DEFAULTS``, on the same real tokens in the same order, and reports
the final validation loss, real tokens/s and the optimizer state's bytes. Table 2 trains
``--large-batch-factor`` times the batch on the same tokens (so that many times fewer steps) with
``--large-batch-optimizers`` under each ``--scalings`` rule, the learning rate scaled from the
table-1 batch, and the warmup shortened by the same factor so it covers the same tokens. Loss
curves against tokens go to ``optimizers.png`` in the run directory.
"""

import dataclasses
import sys

from experiments.common import (Experiment, Row, check_rows, check_run_root, config_of, length,
                                main_of, parse_list)
from jaxaccel.run.config import setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import LR_SCALING, OPTIMIZERS, describe


@dataclasses.dataclass
class OptimizersSettings:
    optimizers: str = setting(",".join(OPTIMIZERS), "comma-separated optimizers for table 1")
    large_batch: bool = setting(True, "also run table 2 (large batch)")
    large_batch_factor: int = setting(8, "table 2's batch is this many times table 1's")
    large_batch_optimizers: str = setting("adamw,lamb", "comma-separated optimizers for table 2")
    scalings: str = setting("linear,sqrt", "comma-separated learning-rate scaling rules "
                                           "(optimizer.lr_scaling) for table 2")


OptimizersConfig = config_of(OptimizersSettings)


def row(cfg, optimizer: str, table: str, batch_size: int, lr_scaling: str = "none",
        warmup_steps: int | None = None) -> Row:
    """One optimizer at one batch size (and learning-rate scaling rule)."""
    name = optimizer if lr_scaling == "none" else f"{optimizer}-{lr_scaling}"
    return Row(f"{name}, batch {batch_size}", {
        "optimizer.name": optimizer, "data.batch_size": batch_size,
        "optimizer.lr_scaling": lr_scaling, "optimizer.base_batch_size": cfg.data.batch_size,
        "optimizer.warmup_steps": (cfg.optimizer.warmup_steps if warmup_steps is None
                                   else warmup_steps)},
        {"table": table, "optimizer": optimizer, "batch_size": batch_size,
         "lr_scaling": lr_scaling}, directory=f"{table}-{name}-b{batch_size}")


def rows(cfg: OptimizersConfig) -> list[Row]:
    """Table 1: every optimizer at its defaults; table 2: the large batch under each rule, its
    warmup shortened by the same factor so that it covers the same tokens."""
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
    plan = [row(cfg, name, "defaults", batch_size) for name in optimizers]
    if exp.large_batch:
        warmup = max(1, round(cfg.optimizer.warmup_steps / exp.large_batch_factor))
        plan += [row(cfg, name, "large_batch", batch_size * exp.large_batch_factor, rule, warmup)
                 for name in large for rule in scalings]
    return plan


def check(cfg: OptimizersConfig, plan: list[Row]):
    """The default check, with table 2's batch size named as the factor that makes it."""
    flags = {"optimizer.name": "experiment.optimizers"}
    large = {"optimizer.name": "experiment.large_batch_optimizers",
             "data.batch_size": "experiment.large_batch_factor"}
    check_rows(cfg, [r for r in plan if r.fields["table"] == "defaults"], flags)
    check_rows(cfg, [r for r in plan if r.fields["table"] == "large_batch"], large)
    check_run_root(cfg.run.run_dir, plan)


def result(summary, run) -> dict:
    return {"learning_rate": summary.learning_rate, "weight_decay": summary.weight_decay,
            "tokens_per_s": summary.real_tokens_per_s,
            "state_bytes": summary.optimizer_state_bytes,
            "state_per_param": summary.optimizer_state_bytes / summary.params}


def tables(cfg: OptimizersConfig, rows: list[dict], meta: dict) -> list:
    """Table 1, and table 2 after table 1's rows of the same optimizers (for reference)."""
    exp = cfg.experiment
    out = [("Table 1: each optimizer with its recommended defaults",
            [r for r in rows if r["table"] == "defaults"], COLUMNS)]
    if exp.large_batch:
        large = parse_list(exp.large_batch_optimizers, "experiment.large_batch_optimizers")
        out.append((f"Table 2: {exp.large_batch_factor}x the batch on the same tokens (table-1 "
                    f"rows of the same optimizers first, for reference)",
                    [r for r in rows if r["table"] == "defaults" and r["optimizer"] in large]
                    + [r for r in rows if r["table"] == "large_batch"], COLUMNS))
    return out


COLUMNS = [
    ("optimizer", "optimizer", ""), ("batch_size", "batch", "d"),
    ("lr_scaling", "lr scaling", ""), ("learning_rate", "peak lr", ".3g"),
    ("weight_decay", "wd", ".3g"), ("steps", "steps", "d"), ("val_loss", "val loss", ".4f"),
    ("val_bpb", "val bpb", ".3f"), ("tokens_per_s", "real tok/s", ",.0f"),
    ("state_bytes", "state bytes", ",d"), ("state_per_param", "state B/param", ".2f"),
    ("wall_s", "wall s", ".1f"),
]

EXPERIMENT = Experiment(
    name="optimizers", doc=__doc__, config=OptimizersConfig, rows=rows, columns=COLUMNS,
    result=result, tables=tables,
    setup=lambda cfg: (f"{describe(cfg.model, cfg.gpt)} model, {length(cfg)} per run, seq_len "
                       f"{cfg.seq_len}, {cfg.data.batching} batching"),
    # data.batch_size and optimizer.warmup_steps are table 1's (table 2 multiplies the batch
    # and divides the warmup); 0 evaluates and checkpoints only at the end.
    defaults={"data.batching": "pack", "data.seq_len": 256, "data.batch_size": 8,
              "run.train_tokens": 800_000, "optimizer.warmup_steps": 40, "run.eval_every": 0,
              "run.checkpoint_every": 0},
    fixed=("optimizer.name", "optimizer.lr_scaling", "optimizer.base_batch_size"),
    check=check,
    meta=lambda cfg, rows: {"base_batch_size": cfg.data.batch_size,
                            "large_batch_factor": cfg.experiment.large_batch_factor},
    plot_title="optimizers")
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
