"""N:M structured sparse training: what does training with 2:4 masks cost in quality at equal
steps, and what would a sparse matmul save?

    python -m experiments.sparsity                        # dense, 2:4, 1:4: ~4 CPU minutes
    python -m experiments.sparsity --patterns 2:4,4:8 --json sparsity.json

Every row trains the same model shape from the same seed for the same steps on the same batches:
a dense row, then one row per pattern of ``--patterns`` (``sparsity.pattern``; masks of the
``--sparsity-targets`` layers, by default every linear layer of the model's blocks, recomputed every ``--sparsity-every`` steps from the weights' magnitudes, SR-STE
gradients: ``jaxaccel.sparsity``). The table gives each row's final validation loss and its cost
against the dense row, the share of the masked weights the masks keep at the end, and what an
N:M sparse matmul would save: the share of the training FLOPs (every matmul with the sparse
operand; the forward and input-gradient ones alone in NVIDIA's recipe, where the weight
gradient stays dense) and of the masked weights' bytes (values plus indices). Those savings are
counted, not timed: jax 0.11.2 has no N:M sparse matmul (XLA does not emit sparse tensor-core
GEMMs, ``jax.experimental.sparse`` is unstructured BCOO/BCSR), so the masked rows multiply dense
weights and their step time is the dense one plus the masking: the step time column shows that
overhead, not a speed-up.
"""

import dataclasses
import os
import signal
import sys
import time

from experiments.common import (command, environment, parse_list, plot_loss_curves, technique,
                                train_until_stopped, write_json)
from jaxaccel import techniques
from jaxaccel.config import TrainConfig, override, parse, setting
from jaxaccel.model import describe
from jaxaccel.report import format_table
from jaxaccel.sparsity import parse_pattern


@dataclasses.dataclass
class SparsitySettings:
    patterns: str = setting("2:4,1:4", "comma-separated N:M patterns, each a row beside the "
                                       "dense one")


@dataclasses.dataclass
class SparsityConfig(TrainConfig):
    """The training config every row shares plus the patterns to compare."""

    experiment: SparsitySettings = dataclasses.field(default_factory=SparsitySettings)


# This experiment's defaults: the tiny preset, packed batches, a fixed number of steps, one
# evaluation at the end on a fixed share of the validation split, no periodic checkpoints.
DEFAULTS = {"data.batching": "pack", "data.seq_len": 128, "data.batch_size": 8,
            "run.steps": 300, "run.eval_every": 0, "run.checkpoint_every": 0,
            "run.final_eval_batches": 20, "run.log_every": 10, "sparsity.every": 10}
FIXED = ("sparsity.pattern", "run.train_tokens")

COLUMNS = [
    ("pattern", "row", ""),
    ("steps", "steps", "d"),
    ("step_ms", "step ms", ".1f"),
    ("train_bpb", "train bpb", ".3f"),
    ("val_bpb", "val bpb", ".4f"),
    ("val_vs_dense", "val vs dense", "+.2%"),
    ("density", "kept", ".1%"),
    ("flops_share", "FLOPs saved", ".1%"),
    ("flops_share_fwd_dgrad", "(fwd+dgrad)", ".1%"),
    ("weight_bytes_share", "weight bytes saved", ".1%"),
]


def run_one(cfg: SparsityConfig, run_root: str, pattern: str) -> dict:
    """Train one row and reduce its summary to a table row."""
    run_dir = os.path.join(run_root, pattern.replace(":", "-"))
    row_cfg = override(cfg, {"sparsity.pattern": pattern, "run.run_dir": run_dir,
                             "run.json": None})
    summary = train_until_stopped(row_cfg)
    saved = technique(summary, "sparsity", default={})   # the masks' density and savings
    return {"pattern": "dense" if pattern == "none" else pattern, "steps": summary.steps,
            "step_ms": 1000 * summary.train_s / max(summary.steps_this_run, 1),
            "train_bpb": summary.train_bpb, "val_loss": summary.val_loss,
            "val_bpb": summary.val_bpb, "density": saved.get("density"),
            "diverged_at_step": summary.diverged_at_step,
            "flops_share": saved.get("flops_share"),
            "flops_share_fwd_dgrad": saved.get("flops_share_fwd_dgrad"),
            "weight_bytes_share": saved.get("weight_bytes_share"),
            "real_tokens_per_s": summary.real_tokens_per_s, "wall_s": summary.wall_s,
            "run_dir": run_dir, "interrupted": summary.interrupted}


@command(SparsityConfig)
def main(argv=None) -> int:
    cfg = parse(argv, SparsityConfig, defaults=DEFAULTS, fixed=FIXED,
                description=__doc__.split("\n\n")[0])
    cfg.validate()
    patterns = parse_list(cfg.experiment.patterns, "experiment.patterns")
    for pattern in patterns:                     # every row's model, before any training
        parse_pattern(pattern)
        row_cfg = override(cfg, {"sparsity.pattern": pattern})
        row_cfg.validate()
        techniques.abstract(row_cfg)             # the masks fit the targeted layers
    run_root = cfg.run.run_dir or os.path.join("runs", time.strftime("sparsity-%Y%m%d-%H%M%S"))

    rows, partial = [], None
    for pattern in ["none", *patterns]:
        row = run_one(cfg, run_root, pattern)
        if row["interrupted"]:
            partial = row["interrupted"]
            break
        rows.append(row)
    dense = rows[0] if rows else None
    for row in rows:
        row["val_vs_dense"] = row["val_bpb"] / dense["val_bpb"] - 1

    model = describe(cfg.model, cfg.gpt)
    meta = {"model": model, "data": cfg.data.path, "batching": cfg.data.batching,
            "seq_len": cfg.seq_len, "batch_size": cfg.data.batch_size, "steps": cfg.run.steps,
            "sparsity_every": cfg.sparsity.every,
            "sparsity_decay": cfg.sparsity.decay, **environment(), "run_dir": run_root,
            "interrupted": partial}
    print(f"\n{model} model, {cfg.run.steps} steps per row, seq_len {cfg.seq_len}, batch "
          f"{cfg.data.batch_size}, {cfg.data.batching} batching, masks every "
          f"{cfg.sparsity.every} steps, {meta['device']}, jax {meta['jax_version']}"
          + (f" (PARTIAL: stopped by {partial})" if partial else ""))
    print(format_table(rows, COLUMNS))
    print("\nSavings are what an N:M sparse matmul would do; none runs here (jax has no N:M "
          "sparse kernel), so the sparse rows multiply masked dense weights.")
    plot_loss_curves(os.path.join(run_root, "sparsity.png"),
                     {r["pattern"]: r["run_dir"] for r in rows},
                     title=f"N:M sparse training, {model} model")
    write_json(cfg.run.json, rows, meta)
    if partial:
        return 128 + getattr(signal.Signals, partial, signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
