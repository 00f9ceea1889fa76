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

from experiments.common import (environment, matched_batch, parse_names, run_config,
                                write_json)
from jaxaccel.config import TrainConfig, flag, parse_config
from jaxaccel.corpus import load_corpus
from jaxaccel.data import STRATEGIES, DataStream, batch_stats, batches
from jaxaccel.errors import ConfigError
from jaxaccel.loop import train
from jaxaccel.report import bar_chart, format_table


@dataclasses.dataclass
class PaddingConfig(TrainConfig):
    """The training flags (with defaults for this experiment) plus the strategies to compare."""

    strategies: str = flag(",".join(STRATEGIES), "comma-separated strategies to compare")
    max_seq_len: int | None = flag(1024, "model context length")
    seq_len: int | None = flag(1024, "training sequence length")
    batch_size: int | None = flag(8, "fixed padding's rows per batch; the others get the batch "
                                       "size (bucket: token budget) that holds as many real "
                                       "tokens")
    match_real_tokens: bool = flag(True, "size every strategy's batches to hold fixed's real "
                                         "tokens, so all take the same steps (off: the same "
                                         "rows, and batch_size * seq_len tokens for bucket)")
    train_tokens: int | None = flag(400_000, "real tokens each strategy trains on")
    plan_only: bool = flag(False, "only plan one training epoch per strategy and time the "
                                  "loader: whole-epoch padding efficiency, shapes, batches")
    eval_every: int = flag(0, "evaluate every N steps (0: only at the end)")
    checkpoint_every: int = flag(0, "save a checkpoint every N steps (0: only at the end)")
    warmup_steps: int = flag(10, "linear warmup steps")


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
        documents, strategy=cfg.batching, seq_len=cfg.seq_len, **cfg.batching_options()))
    return real / (time.perf_counter() - start)


PLAN_COLUMNS = [
    ("strategy", "strategy", ""),
    ("batch", "batch", ""),
    ("epoch_padding_efficiency", "epoch padding eff.", ".2%"),
    ("shapes", "shapes", "d"),
    ("batches_per_epoch", "batches/epoch", ",d"),
    ("loader_tokens_per_s", "loader tok/s", ",.0f"),
]


def plan_strategy(cfg: PaddingConfig, strategy: str) -> dict:
    """Plan epoch 0 of ``strategy`` with the experiment's batch settings, and time the loader."""
    documents = load_corpus(cfg.data, cache_dir=cfg.cache_dir).train
    batching = matched_batch(documents, cfg, strategy, match=cfg.match_real_tokens)
    stream = DataStream(documents, strategy=strategy, seq_len=cfg.seq_len, seed=cfg.seed,
                        pad_multiple=cfg.pad_multiple, num_buckets=cfg.buckets, **batching)
    run_cfg = dataclasses.replace(cfg, batching=strategy, **batching)
    return {
        "strategy": strategy,
        "batch": _describe_batch(run_cfg),
        "epoch_padding_efficiency": stream.stats["padding_efficiency"],
        "shapes": len(stream.shapes),
        "batches_per_epoch": stream.batches_per_epoch,
        "loader_tokens_per_s": loader_tokens_per_s(documents, run_cfg),
    }


def _describe_batch(cfg: TrainConfig) -> str:
    return f"{cfg.batch_size} rows" if cfg.batch_size else f"{cfg.tokens_per_batch} tokens"


def run_strategy(cfg: PaddingConfig, strategy: str, run_root: str) -> dict:
    """Measure the loader, train one strategy, and reduce both to a table row."""
    documents = load_corpus(cfg.data, cache_dir=cfg.cache_dir).train
    run_cfg = run_config(cfg, batching=strategy, run_dir=os.path.join(run_root, strategy),
                         **matched_batch(documents, cfg, strategy, match=cfg.match_real_tokens))
    loader_rate = loader_tokens_per_s(documents, run_cfg)
    summary = train(run_cfg)
    return {
        "strategy": strategy,
        "batch": _describe_batch(run_cfg),
        "real_tokens_per_step": summary["real_tokens"] / max(summary["steps"], 1),
        "padding_efficiency": summary["padding_efficiency"],
        "epoch_padding_efficiency": summary["epoch_padding_efficiency"],
        "shapes": len(summary["shapes"]),
        "compiles": summary["compiles"],
        "compiles_after_warmup": summary["compiles_after_warmup"],
        "compile_s": summary["compile_s"],
        "steps": summary["steps"],
        "real_tokens": summary["real_tokens"],
        "real_tokens_per_s": summary["real_tokens_per_s"],
        "data_wait_s": summary["data_wait_s"],
        "loader_tokens_per_s": loader_rate,
        "wall_s": summary["wall_s"],
        "val_loss": summary["val_loss"],
        "val_bpb": summary["val_bpb"],
    }


def main(argv=None) -> int:
    try:
        cfg = parse_config(argv, PaddingConfig, description=__doc__.split("\n\n")[0])
        strategies = parse_names(cfg.strategies, STRATEGIES, "strategies")
        if cfg.plan_only:
            rows = [plan_strategy(cfg, s) for s in strategies]
        else:
            run_root = cfg.run_dir or os.path.join("runs",
                                                   time.strftime("padding-%Y%m%d-%H%M%S"))
            rows = [run_strategy(cfg, s, run_root) for s in strategies]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.plan_only:
        print(f"\nseq_len {cfg.seq_len}, one epoch of {cfg.data} per strategy, loader on one thread")
        print(format_table(rows, PLAN_COLUMNS))
        write_json(cfg.json, rows, {"seq_len": cfg.seq_len, "plan_only": True})
        return 0
    fixed = next((r for r in rows if r["strategy"] == "fixed"), None)
    for row in rows:
        row["speedup_vs_fixed"] = (row["real_tokens_per_s"] / fixed["real_tokens_per_s"]
                                   if fixed else None)
        row["padding_bound"] = (row["padding_efficiency"] / fixed["padding_efficiency"]
                                if fixed else None)
    meta = {"seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "train_tokens": cfg.train_tokens,
            "match_real_tokens": cfg.match_real_tokens,
            "model": cfg.model, "data": cfg.data, **environment()}
    print(f"\nseq_len {cfg.seq_len}, {cfg.train_tokens:,} real tokens per strategy, "
          f"{meta['device']}, jax {meta['jax_version']}")
    print(format_table(rows, COLUMNS))
    bar_chart(os.path.join(run_root, "padding.png"), [r["strategy"] for r in rows],
              [("real tokens/s", [r["real_tokens_per_s"] for r in rows]),
               ("padding efficiency", [r["padding_efficiency"] for r in rows]),
               ("validation loss", [r["val_loss"] for r in rows])],
              title=f"batching strategies, seq_len {cfg.seq_len}")
    write_json(cfg.json, rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
