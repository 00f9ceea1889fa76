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
import sys
import time

from experiments.common import (Experiment, Row, check_packing, check_rows, check_run_root,
                                config_of, first, length, main_of, matched_batch, parse_list,
                                relative, summary_fields, train_row)
from jaxaccel.run.config import TrainConfig, override, setting
from jaxaccel.data.corpus import corpus_of
from jaxaccel.data.batching import STRATEGIES, DataStream, batch_stats, batches
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.report import bar_chart


@dataclasses.dataclass
class PaddingSettings:
    strategies: str = setting(",".join(STRATEGIES), "comma-separated strategies to compare")
    match_real_tokens: bool = setting(True, "size every strategy's batches to hold fixed's real "
                                            "tokens, so all take the same steps (off: the same "
                                            "rows, and batch_size * seq_len tokens for bucket)")
    plan_only: bool = setting(False, "only plan one training epoch per strategy and time the "
                                     "loader: whole-epoch padding efficiency, shapes, batches")


PaddingConfig = config_of(PaddingSettings)


def rows(cfg: PaddingConfig) -> list[Row]:
    """One row per strategy; each measurement matches its batch to fixed padding's."""
    strategies = parse_list(cfg.experiment.strategies, "experiment.strategies", valid=STRATEGIES)
    if cfg.data.batch_size is None:
        raise ConfigError("this experiment takes fixed padding's batch size in rows",
                          field="data.batch_size")
    return [Row(s, {"data.batching": s}, {"strategy": s}, directory=s) for s in strategies]


ROW_FLAGS = {"data.batching": "experiment.strategies"}


def check(cfg: PaddingConfig, plan: list[Row]):
    """The default check, a row's batching named as --strategies; when the rows train, the pack
    row's model must take packed documents apart (``check_packing``)."""
    check_rows(cfg, plan, ROW_FLAGS)
    check_run_root(cfg.run.run_dir, plan)
    if not cfg.experiment.plan_only:
        for row in plan:
            check_packing(override(cfg, row.settings), row, field=ROW_FLAGS["data.batching"])


def batched(run) -> TrainConfig:
    """The row's config, its batch holding as many real tokens as fixed padding's."""
    return override(run.config(), matched_batch(run.shared, run.cfg, run.row.label,
                                                match=run.cfg.experiment.match_real_tokens))


def loader_tokens_per_s(documents, cfg: TrainConfig) -> float:
    """Real tokens per second of making one whole epoch of host batches, planning included."""
    start = time.perf_counter()
    real = sum(batch_stats(b)["real_tokens"] for b in batches(
        documents, strategy=cfg.data.batching, seq_len=cfg.seq_len, **cfg.batching_options()))
    return real / (time.perf_counter() - start)


def batch(cfg: TrainConfig) -> str:
    """The batch as the table shows it: rows, or a token budget."""
    data = cfg.data
    return f"{data.batch_size} rows" if data.batch_size else f"{data.tokens_per_batch} tokens"


def measure(run) -> dict:
    """Time the loader alone, then train the strategy."""
    cfg = batched(run)
    loader = loader_tokens_per_s(run.shared, cfg)
    summary = train_row(cfg)
    return {**summary_fields(summary), "batch": batch(cfg), "loader_tokens_per_s": loader,
            "real_tokens_per_step": summary.real_tokens / max(summary.steps, 1),
            "padding_efficiency": summary.padding_efficiency,
            "epoch_padding_efficiency": summary.epoch_padding_efficiency,
            "shapes": len(summary.shapes), "compiles": summary.compiles,
            "compiles_after_warmup": summary.compiles_after_warmup,
            "data_wait_s": summary.data_wait_s}


def plan(run) -> dict:
    """--plan-only: epoch 0 of the strategy with the row's batch, and the loader timed."""
    cfg = batched(run)
    stream = DataStream(run.shared, strategy=cfg.data.batching, seq_len=cfg.seq_len,
                        seed=cfg.run.seed, **cfg.batching_options())
    return {"batch": batch(cfg), "epoch_padding_efficiency": stream.stats["padding_efficiency"],
            "shapes": len(stream.shapes), "batches_per_epoch": stream.batches_per_epoch,
            "loader_tokens_per_s": loader_tokens_per_s(run.shared, cfg)}


def plot(path: str, cfg: PaddingConfig, rows: list[dict]):
    bar_chart(path, [r["strategy"] for r in rows],
              [("real tokens/s", [r["real_tokens_per_s"] for r in rows]),
               ("padding efficiency", [r["padding_efficiency"] for r in rows]),
               ("validation loss", [r["val_loss"] for r in rows])],
              title=f"batching strategies, seq_len {cfg.seq_len}")


EXPERIMENT = Experiment(
    name="padding", doc=__doc__, config=PaddingConfig, rows=rows, check=check, measure=measure,
    plot=plot,
    shared=lambda cfg: corpus_of(cfg.data).train,
    setup=lambda cfg: f"seq_len {cfg.seq_len}, {length(cfg)} per strategy",
    # data.batch_size is fixed padding's rows per batch (the others get the batch size, bucket
    # a token budget, that holds as many real tokens); 0 evaluates and checkpoints only at the
    # end. Each row sets its own batching strategy and batch size.
    defaults={"model.max_seq_len": 1024, "data.seq_len": 1024, "data.batch_size": 8,
              "run.train_tokens": 400_000, "run.eval_every": 0, "run.checkpoint_every": 0,
              "optimizer.warmup_steps": 10},
    fixed=("data.batching", "data.tokens_per_batch"),
    columns=[("strategy", "strategy", ""), ("batch", "batch", ""),
             ("real_tokens_per_step", "real tok/step", ",.0f"),
             ("padding_efficiency", "padding eff.", ".1%"), ("shapes", "shapes", "d"),
             ("compiles", "compiles", "d"), ("compile_s", "compile s", ".1f"),
             ("steps", "steps", "d"), ("real_tokens_per_s", "real tok/s", ",.0f"),
             ("wall_s", "wall s", ".1f"), ("val_loss", "val loss", ".4f"),
             ("speedup_vs_fixed", "speedup", ".2f"), ("padding_bound", "bound", ".2f"),
             ("data_wait_s", "data wait s", ".2f"),
             ("loader_tokens_per_s", "loader tok/s", ",.0f")],
    compare=lambda cfg, rows, partial: relative(
        rows, first(rows, strategy="fixed"), speedup_vs_fixed=("real_tokens_per_s", "ratio"),
        padding_bound=("padding_efficiency", "ratio")),
    meta=lambda cfg, rows: {"match_real_tokens": cfg.experiment.match_real_tokens},
    mode=lambda cfg: PLAN if cfg.experiment.plan_only else None)
# --plan-only: plan one epoch per strategy and time the loader; no training.
PLAN = dataclasses.replace(
    EXPERIMENT, measure=plan, trains=False, compare=None, plot=None,
    setup=lambda cfg: (f"seq_len {cfg.seq_len}, one epoch of {cfg.data.path} per strategy, "
                       f"loader on one thread"),
    columns=[("strategy", "strategy", ""), ("batch", "batch", ""),
             ("epoch_padding_efficiency", "epoch padding eff.", ".2%"),
             ("shapes", "shapes", "d"), ("batches_per_epoch", "batches/epoch", ",d"),
             ("loader_tokens_per_s", "loader tok/s", ",.0f")],
    meta=lambda cfg, rows: {"plan_only": True})
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
