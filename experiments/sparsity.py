"""N:M structured sparse training: what does training with 2:4 masks cost in quality at equal
steps, and what would a sparse matmul save?

    python -m experiments.sparsity                        # dense, 2:4, 1:4: ~4 CPU minutes
    python -m experiments.sparsity --patterns 2:4,4:8 --json sparsity.json

Every row trains the same model shape from the same seed for the same steps on the same batches: a
dense row, then one row per pattern of ``--patterns`` (``sparsity.pattern``; masks of the
``--sparsity-targets`` layers, by default every linear layer of the model's blocks, recomputed
every ``--sparsity-every`` steps from the weights' magnitudes, SR-STE gradients:
``jaxaccel.techniques.sparsity``). The table gives each row's final validation loss and its cost
against the dense row, the share of the masked weights the masks keep at the end, and what an N:M
sparse matmul would save: the share of the training FLOPs (every matmul with the sparse operand;
the forward and input-gradient ones alone in NVIDIA's recipe, where the weight gradient stays
dense) and of the masked weights' bytes (values plus indices). Those savings are counted, not
timed: jax 0.11.2 has no N:M sparse matmul (XLA does not emit sparse tensor-core GEMMs,
``jax.experimental.sparse`` is unstructured BCOO/BCSR), so the masked rows multiply dense weights
and their step time is the dense one plus the masking: the step time column shows that overhead,
not a speed-up.
"""

import dataclasses
import sys

from experiments.common import (Experiment, Row, config_of, main_of, parse_list, relative,
                                shared_run, technique)
from jaxaccel.run.config import setting
from jaxaccel.core.errors import ConfigError


@dataclasses.dataclass
class SparsitySettings:
    patterns: str = setting("2:4,1:4", "comma-separated N:M patterns, each a row beside the "
                                       "dense one")


SparsityConfig = config_of(SparsitySettings)


def rows(cfg: SparsityConfig) -> list[Row]:
    """A dense row, then one per pattern."""
    patterns = parse_list(cfg.experiment.patterns, "experiment.patterns")
    if "none" in patterns:      # it would train the dense row again, into the dense row's run
        raise ConfigError("patterns lists none, the dense row, which always runs; list only N:M "
                          "patterns, e.g. 2:4,1:4", field="experiment.patterns")
    return [Row("dense" if p == "none" else p, {"sparsity.pattern": p},
                {"pattern": "dense" if p == "none" else p}, directory=p.replace(":", "-"))
            for p in ["none", *patterns]]


def result(summary, run) -> dict:
    """The masks' density and what an N:M sparse matmul would save."""
    saved = technique(summary, "sparsity", default={})
    return {key: saved.get(key) for key in ("density", "flops_share", "flops_share_fwd_dgrad",
                                            "weight_bytes_share")}


def setup(cfg: SparsityConfig) -> str:
    return f"{shared_run(cfg)}, masks every {cfg.sparsity.every} steps"


EXPERIMENT = Experiment(
    name="sparsity", doc=__doc__, config=SparsityConfig, rows=rows, setup=setup, result=result,
    # The tiny preset, packed batches, a fixed number of steps, one evaluation at the end on a
    # fixed share of the validation split, no periodic checkpoints.
    defaults={"data.batching": "pack", "data.seq_len": 128, "data.batch_size": 8,
              "run.steps": 300, "run.eval_every": 0, "run.checkpoint_every": 0,
              "run.final_eval_batches": 20, "run.log_every": 10, "sparsity.every": 10},
    fixed=("sparsity.pattern", "run.train_tokens"),
    row_flags={"sparsity.pattern": "experiment.patterns"},
    columns=[("pattern", "row", ""), ("steps", "steps", "d"), ("step_ms", "step ms", ".1f"),
             ("train_bpb", "train bpb", ".3f"), ("val_bpb", "val bpb", ".4f"),
             ("val_vs_dense", "val vs dense", "+.2%"), ("density", "kept", ".1%"),
             ("flops_share", "FLOPs saved", ".1%"), ("flops_share_fwd_dgrad", "(fwd+dgrad)", ".1%"),
             ("weight_bytes_share", "weight bytes saved", ".1%")],
    compare=lambda cfg, rows, partial: relative(rows, rows[0],
                                                val_vs_dense=("val_bpb", "change")),
    meta=lambda cfg, rows: {"sparsity_every": cfg.sparsity.every,
                            "sparsity_decay": cfg.sparsity.decay},
    notes=lambda cfg, rows, meta: [
        "\nSavings are what an N:M sparse matmul would do; none runs here (jax has no N:M "
        "sparse kernel), so the sparse rows multiply masked dense weights."],
    plot_title="N:M sparse training")
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
