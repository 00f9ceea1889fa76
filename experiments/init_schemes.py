"""Initialisation schemes without warmup: does a better initialisation let a transformer train
at higher learning rates with no warmup, as the survey's Fixup family claims?

    python -m experiments.init_schemes                   # 4 schemes x 3 learning rates: ~6 CPU minutes
    python -m experiments.init_schemes --schemes default,tfixup --learning-rates 3e-3,3e-2
    python -m experiments.init_schemes --steps 400 --json init_schemes.json

Every row trains the same model shape for the same steps on the same batches, with no learning-rate
warmup (``optimizer.warmup_steps=0``): one row per scheme of ``--schemes`` (``init.scheme``:
default, rezero, skipinit, tfixup; ``jaxaccel.techniques.init``) and learning rate of
``--learning-rates``. Reference rows train the default initialisation *with* ``--reference-warmup``
warmup steps at each learning rate: what the warmup buys.

A row **trained** when its final validation loss is finite and at least 10 % below the corpus's
unigram entropy (``unigram_bpb``, what the token frequencies alone give, per byte of text);
otherwise it **diverged** (a NaN) or **stalled** (a model stuck near the token frequencies,
which is how the pre-norm default fails at high learning rates: the gradient clip keeps it
finite). Table 1 lists every row; table 2 the largest swept learning rate at which each
scheme (and the reference) trained, and its validation loss there. Training loss against
tokens of every scheme at the largest learning rate goes to ``init_schemes.png`` in the run
directory, so the default initialisation without warmup and T-Fixup are side by side where it
matters.
"""

import dataclasses
import math
import sys

from experiments.common import (Experiment, Row, config_of, main_of, parse_list,
                                plot_loss_curves)
from jaxaccel.run.config import setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import INIT_SCHEMES as SCHEMES, describe


@dataclasses.dataclass
class InitSettings:
    schemes: str = setting(",".join(SCHEMES), "comma-separated initialisation schemes, "
                                                   "each trained without warmup")
    learning_rates: str = setting("3e-3,1e-2,3e-2", "comma-separated peak learning rates")
    reference_warmup: int = setting(50, "warmup steps of the reference rows (the default init "
                                        "with warmup; 0: no reference rows)")


InitConfig = config_of(InitSettings)
TRAINED = 0.9     # a row trained if its val bpb is at most this share of the unigram entropy


def positive(value: float) -> bool:
    "positive"
    return value > 0


def swept(cfg: InitConfig) -> tuple[list[str], list[float]]:
    """The schemes, and the learning rates in increasing order without repeats."""
    exp = cfg.experiment
    return (parse_list(exp.schemes, "experiment.schemes", valid=SCHEMES),
            sorted(set(parse_list(exp.learning_rates, "experiment.learning_rates", kind=float,
                                  within=positive, example="1e-3,1e-2"))))


def rows(cfg: InitConfig) -> list[Row]:
    """Every scheme at every learning rate without warmup, then the default init with the
    reference warmup at every learning rate."""
    schemes, rates = swept(cfg)
    warmup = cfg.experiment.reference_warmup
    if warmup < 0 or warmup >= cfg.run.steps:
        raise ConfigError(f"reference_warmup must be in [0, steps={cfg.run.steps}), got "
                          f"{warmup}", field="experiment.reference_warmup")
    plan = [(scheme, lr, 0) for scheme in schemes for lr in rates]
    plan += [("default", lr, warmup) for lr in rates] if warmup else []
    return [Row(scheme if w == 0 else f"{scheme} + {w} warmup",
                {"init.scheme": scheme, "optimizer.learning_rate": lr,
                 "optimizer.warmup_steps": w},
                {"scheme": scheme, "warmup_steps": w, "learning_rate": lr},
                directory=f"{scheme}-w{w}-lr{lr:g}") for scheme, lr, w in plan]


def result(summary, run) -> dict:
    """Trained, or how it failed: diverged (not finite) or stalled (near the unigram's)."""
    finite = math.isfinite(summary.val_bpb)
    trained = finite and summary.val_bpb <= TRAINED * summary.unigram_bpb
    return {"trained": trained, "verdict": "" if trained else
            ("stalled" if finite else "diverged"), "interrupted": None}


def largest_stable(rows: list[dict]) -> list[dict]:
    """Per row label: the largest learning rate that trained, and its losses there."""
    table = []
    for label in dict.fromkeys(r["label"] for r in rows):
        stable = [r for r in rows if r["label"] == label and r["trained"]]
        best = max(stable, key=lambda r: r["learning_rate"]) if stable else None
        table.append({"label": label, "largest_stable_lr": best and best["learning_rate"],
                      "val_loss": best and best["val_loss"], "val_bpb": best and best["val_bpb"]})
    return table


def meta(cfg: InitConfig, rows: list[dict]) -> dict:
    schemes, rates = swept(cfg)
    return {"optimizer": cfg.optimizer.name, "schemes": schemes, "learning_rates": rates,
            "reference_warmup": cfg.experiment.reference_warmup,
            "largest_stable": largest_stable(rows)}


def tables(cfg: InitConfig, rows: list[dict], meta: dict) -> list:
    return [(f"Table 1: every row without warmup, then the default init with warmup; trained = "
             f"final validation bits/byte finite and at most {TRAINED:.0%} of the unigram "
             f"entropy's", rows, COLUMNS),
            ("Table 2: the largest swept learning rate each scheme trains at",
             meta["largest_stable"], STABLE_COLUMNS)]


def plot(path: str, cfg: InitConfig, rows: list[dict]):
    """Training loss of every row at the largest learning rate."""
    top = max(r["learning_rate"] for r in rows)
    plot_loss_curves(path, {r["label"]: r["run_dir"] for r in rows if r["learning_rate"] == top},
                     title=f"initialisation schemes at lr {top:g}, "
                           f"{describe(cfg.model, cfg.gpt)} model")


COLUMNS = [("label", "row", ""), ("learning_rate", "peak lr", ".0e"),
           ("warmup_steps", "warmup", "d"), ("steps", "steps", "d"),
           ("train_bpb", "train bpb", ".3f"), ("val_loss", "val loss", ".4f"),
           ("val_bpb", "val bpb", ".3f"), ("verdict", "", ""), ("wall_s", "wall s", ".1f")]
STABLE_COLUMNS = [("label", "scheme", ""), ("largest_stable_lr", "largest stable lr", ".0e"),
                  ("val_loss", "val loss there", ".4f"), ("val_bpb", "val bpb there", ".3f")]

EXPERIMENT = Experiment(
    name="init_schemes", doc=__doc__, config=InitConfig, rows=rows, columns=COLUMNS,
    result=result, meta=meta, tables=tables, plot=plot,
    setup=lambda cfg: (f"{describe(cfg.model, cfg.gpt)} model, {cfg.run.steps} steps per row, "
                       f"{cfg.optimizer.name}, seq_len {cfg.seq_len}, batch "
                       f"{cfg.data.batch_size}, {cfg.data.batching} batching"),
    # The tiny preset, packed batches, a fixed number of steps, one evaluation at the end on a
    # fixed share of the validation split, no periodic checkpoints.
    defaults={"data.batching": "pack", "data.seq_len": 128, "data.batch_size": 8,
              "run.steps": 150, "run.eval_every": 0, "run.checkpoint_every": 0,
              "run.final_eval_batches": 20, "run.log_every": 5},
    fixed=("init.scheme", "optimizer.learning_rate", "optimizer.warmup_steps",
           "run.train_tokens"),
    row_flags={"init.scheme": "experiment.schemes",
               "optimizer.learning_rate": "experiment.learning_rates"})
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
