"""Cut the padding: each batching strategy trains the same model on the same real tokens.

    python -m experiments.padding --seq-len 1024
    python -m experiments.padding --seq-len 2048 --batch-size 2 --json padding-2048.json

For every strategy (fixed, dynamic, bucket, pack) it trains the model from the same seed for the
same number of real tokens (tokens that count in the loss) and prints padding efficiency, the
distinct batch shapes and compilations, real tokens/s, wall time, the final validation loss
(all strategies are evaluated on the same fixed-padded validation batches) and the speedup over
fixed padding, next to the bound that padding alone sets (efficiency / fixed's efficiency). It
also times the loader alone: real tokens/s of making one whole training epoch of host batches,
planning included, on one thread.
Each strategy's batches hold about as many real tokens as fixed padding's ``--batch-size``
rows (``bucket`` through its token budget), so all take the same number of optimizer steps
and only the padding differs. A bar chart goes to the run directory.
"""

import dataclasses
import os
import sys
import time

from experiments.common import (Interrupted, command, environment, exit_code, matched_batch,
                                parse_list, train_row, write_json)
from jaxaccel.config import TrainConfig, override, parse, setting
from jaxaccel.corpus import corpus_of
from jaxaccel.data import STRATEGIES, DataStream, batch_stats, batches
from jaxaccel.errors import ConfigError
from jaxaccel.model import describe
from jaxaccel.report import bar_chart, format_table


@dataclasses.dataclass
class PaddingSettings:
    strategies: str = setting(",".join(STRATEGIES), "comma-separated strategies to compare")
    match_real_tokens: bool = setting(True, "size every strategy's batches to hold fixed's real "
                                            "tokens, so all take the same steps (off: the same "
                                            "rows, and batch_size * seq_len tokens for bucket)")
    plan_only: bool = setting(False, "only plan one training epoch per strategy and time the "
                                     "loader: whole-epoch padding efficiency, shapes, batches")


@dataclasses.dataclass
class PaddingConfig(TrainConfig):
    """The training config (with this experiment's defaults) plus the strategies to compare."""

    experiment: PaddingSettings = dataclasses.field(default_factory=PaddingSettings)


# This experiment's defaults: data.batch_size is fixed padding's rows per batch (the others get
# the batch size, bucket a token budget, that holds as many real tokens); 0 evaluates and
# checkpoints only at the end. Each row sets its own batching strategy and batch size.
DEFAULTS = {"model.max_seq_len": 1024, "data.seq_len": 1024, "data.batch_size": 8,
            "run.train_tokens": 400_000, "run.eval_every": 0, "run.checkpoint_every": 0,
            "optimizer.warmup_steps": 10}
FIXED = ("data.batching", "data.tokens_per_batch")


COLUMNS = [
    ("strategy", "strategy", ""),
    ("batch", "batch", ""),
    ("real_tokens_per_step", "real tok/step", ",.0f"),
    ("padding_efficiency", "padding eff.", ".1%"),
    ("shapes", "shapes", "d"),
    ("compiles", "compiles", "d"),
    ("compile_s", "compile s", ".1f"),
    ("steps", "steps", "d"),
    ("real_tokens_per_s", "real tok/s", ",.0f"),
    ("wall_s", "wall s", ".1f"),
    ("val_loss", "val loss", ".4f"),
    ("speedup_vs_fixed", "speedup", ".2f"),
    ("padding_bound", "bound", ".2f"),
    ("data_wait_s", "data wait s", ".2f"),
    ("loader_tokens_per_s", "loader tok/s", ",.0f"),
]


def loader_tokens_per_s(documents, cfg: TrainConfig) -> float:
    """Real tokens per second of making one whole epoch of host batches, planning included."""
    start = time.perf_counter()
    real = sum(batch_stats(b)["real_tokens"] for b in batches(
        documents, strategy=cfg.data.batching, seq_len=cfg.seq_len, **cfg.batching_options()))
    return real / (time.perf_counter() - start)


PLAN_COLUMNS = [
    ("strategy", "strategy", ""),
    ("batch", "batch", ""),
    ("epoch_padding_efficiency", "epoch padding eff.", ".2%"),
    ("shapes", "shapes", "d"),
    ("batches_per_epoch", "batches/epoch", ",d"),
    ("loader_tokens_per_s", "loader tok/s", ",.0f"),
]


def strategy_config(cfg: PaddingConfig, documents, strategy: str, **fields) -> PaddingConfig:
    """``cfg`` for one strategy: its batching and the batch matched to fixed padding's."""
    batching = matched_batch(documents, cfg, strategy, match=cfg.experiment.match_real_tokens)
    return override(cfg, {"data.batching": strategy, **batching, **fields})


def plan_strategy(cfg: PaddingConfig, strategy: str) -> dict:
    """Plan epoch 0 of ``strategy`` with the experiment's batch settings, and time the loader."""
    documents = corpus_of(cfg.data).train
    run_cfg = strategy_config(cfg, documents, strategy)
    data = run_cfg.data
    stream = DataStream(documents, strategy=strategy, seq_len=cfg.seq_len, seed=cfg.run.seed,
                        batch_size=data.batch_size, tokens_per_batch=data.tokens_per_batch,
                        pad_multiple=data.pad_multiple, num_buckets=data.buckets)
    return {
        "strategy": strategy,
        "batch": _describe_batch(run_cfg),
        "epoch_padding_efficiency": stream.stats["padding_efficiency"],
        "shapes": len(stream.shapes),
        "batches_per_epoch": stream.batches_per_epoch,
        "loader_tokens_per_s": loader_tokens_per_s(documents, run_cfg),
    }


def _describe_batch(cfg: TrainConfig) -> str:
    data = cfg.data
    return f"{data.batch_size} rows" if data.batch_size else f"{data.tokens_per_batch} tokens"


def _length(cfg: TrainConfig) -> str:
    """How long every row trains: real tokens, or steps when run.train_tokens is unset."""
    if cfg.run.train_tokens is None:
        return f"{cfg.run.steps:,} steps"
    return f"{cfg.run.train_tokens:,} real tokens"


def run_strategy(cfg: PaddingConfig, strategy: str, run_root: str) -> dict:
    """Measure the loader, train one strategy, and reduce both to a table row."""
    documents = corpus_of(cfg.data).train
    run_cfg = strategy_config(cfg, documents, strategy,
                              **{"run.run_dir": os.path.join(run_root, strategy),
                                 "run.json": None})
    loader_rate = loader_tokens_per_s(documents, run_cfg)
    summary = train_row(run_cfg)
    return {
        "strategy": strategy,
        "batch": _describe_batch(run_cfg),
        "real_tokens_per_step": summary.real_tokens / max(summary.steps, 1),
        "padding_efficiency": summary.padding_efficiency,
        "epoch_padding_efficiency": summary.epoch_padding_efficiency,
        "shapes": len(summary.shapes),
        "compiles": summary.compiles,
        "compiles_after_warmup": summary.compiles_after_warmup,
        "compile_s": summary.compile_s,
        "steps": summary.steps,
        "real_tokens": summary.real_tokens,
        "real_tokens_per_s": summary.real_tokens_per_s,
        "data_wait_s": summary.data_wait_s,
        "loader_tokens_per_s": loader_rate,
        "wall_s": summary.wall_s,
        "val_loss": summary.val_loss,
        "val_bpb": summary.val_bpb,
        "diverged_at_step": summary.diverged_at_step,
    }


@command(PaddingConfig)
def main(argv=None) -> int:
    cfg = parse(argv, PaddingConfig, defaults=DEFAULTS, fixed=FIXED,
                description=__doc__.split("\n\n")[0])
    cfg.validate()
    exp = cfg.experiment
    strategies = parse_list(exp.strategies, "experiment.strategies", valid=STRATEGIES)
    if cfg.data.batch_size is None:
        raise ConfigError("this experiment takes fixed padding's batch size in rows",
                          field="data.batch_size")
    if exp.plan_only:
        rows = [plan_strategy(cfg, s) for s in strategies]
        print(f"\nseq_len {cfg.seq_len}, one epoch of {cfg.data.path} per strategy, loader on one "
              f"thread")
        print(format_table(rows, PLAN_COLUMNS))
        write_json(cfg.run.json, rows, {"seq_len": cfg.seq_len, "plan_only": True})
        return 0
    run_root = cfg.run.run_dir or os.path.join("runs", time.strftime("padding-%Y%m%d-%H%M%S"))
    rows, partial = [], None
    try:
        for strategy in strategies:
            rows.append(run_strategy(cfg, strategy, run_root))
    except Interrupted as stop:         # the cut row is not a result; later rows do not run
        partial = stop.signal
    fixed = next((r for r in rows if r["strategy"] == "fixed"), None)
    for row in rows:
        row["speedup_vs_fixed"] = (row["real_tokens_per_s"] / fixed["real_tokens_per_s"]
                                   if fixed else None)
        row["padding_bound"] = (row["padding_efficiency"] / fixed["padding_efficiency"]
                                if fixed else None)
    meta = {"seq_len": cfg.seq_len, "batch_size": cfg.data.batch_size,
            "train_tokens": cfg.run.train_tokens, "match_real_tokens": exp.match_real_tokens,
            "model": describe(cfg.model, cfg.gpt), "data": cfg.data.path, **environment(),
            "interrupted": partial}
    print(f"\nseq_len {cfg.seq_len}, {_length(cfg)} per strategy, {meta['device']}, "
          f"jax {meta['jax_version']}"
          + (f" (PARTIAL: stopped by {partial}; {len(rows)} of {len(strategies)} rows ran)"
             if partial else ""))
    print(format_table(rows, COLUMNS))
    bar_chart(os.path.join(run_root, "padding.png"), [r["strategy"] for r in rows],
              [("real tokens/s", [r["real_tokens_per_s"] for r in rows]),
               ("padding efficiency", [r["padding_efficiency"] for r in rows]),
               ("validation loss", [r["val_loss"] for r in rows])],
              title=f"batching strategies, seq_len {cfg.seq_len}")
    write_json(cfg.run.json, rows, meta)
    return exit_code(partial)


if __name__ == "__main__":
    sys.exit(main())
