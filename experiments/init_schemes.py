"""Initialisation schemes without warmup: does a better initialisation let a transformer train
at higher learning rates with no warmup, as the survey's Fixup family claims?

    python -m experiments.init_schemes                   # 4 schemes x 3 learning rates: ~6 CPU minutes
    python -m experiments.init_schemes --schemes default,tfixup --learning-rates 3e-3,3e-2
    python -m experiments.init_schemes --steps 400 --json init_schemes.json

Every row trains the same model shape for the same steps on the same batches, with no
learning-rate warmup (``optimizer.warmup_steps=0``): one row per scheme of ``--schemes``
(``init.scheme``: default, rezero, skipinit, tfixup; ``jaxaccel.init``) and learning rate of
``--learning-rates``. Reference rows train the default initialisation *with*
``--reference-warmup`` warmup steps at each learning rate: what the warmup buys.

A row **trained** when its final validation loss is finite and at least 10 % below the corpus's
unigram entropy (``unigram_bpb``, what the byte frequencies alone give); otherwise it
**diverged** (a NaN) or **stalled** (a model stuck near the byte frequencies, which is how the
pre-norm default fails at high learning rates: the gradient clip keeps it finite). Table 1
lists every row; table 2 the largest swept learning rate at which each scheme (and the
reference) trained, and its validation loss there. Training loss against tokens of every
scheme at the largest learning rate goes to ``init_schemes.png`` in the run directory, so the
default initialisation without warmup and T-Fixup are side by side where it matters.
"""

import dataclasses
import math
import os
import signal
import sys
import time

from experiments.common import (command, environment, parse_experiment, parse_list,
                                plot_loss_curves, train_until_stopped, write_json)
from jaxaccel import techniques
from jaxaccel.config import TrainConfig, override, setting
from jaxaccel.errors import ConfigError
from jaxaccel.init import SCHEMES
from jaxaccel.model import describe
from jaxaccel.report import format_table


@dataclasses.dataclass
class InitSettings:
    schemes: str = setting(",".join(SCHEMES), "comma-separated initialisation schemes, "
                                                   "each trained without warmup")
    learning_rates: str = setting("3e-3,1e-2,3e-2", "comma-separated peak learning rates")
    reference_warmup: int = setting(50, "warmup steps of the reference rows (the default init "
                                        "with warmup; 0: no reference rows)")


@dataclasses.dataclass
class InitConfig(TrainConfig):
    """The training config every row shares plus the schemes and learning rates to sweep."""

    experiment: InitSettings = dataclasses.field(default_factory=InitSettings)


# This experiment's defaults: the tiny preset, packed batches, a fixed number of steps, one
# evaluation at the end on a fixed share of the validation split, no periodic checkpoints.
DEFAULTS = {"data.batching": "pack", "data.seq_len": 128, "data.batch_size": 8,
            "run.steps": 150, "run.eval_every": 0, "run.checkpoint_every": 0,
            "run.final_eval_batches": 20, "run.log_every": 5}
FIXED = ("init.scheme", "optimizer.learning_rate", "optimizer.warmup_steps", "run.train_tokens")

COLUMNS = [
    ("label", "row", ""),
    ("learning_rate", "peak lr", ".0e"),
    ("warmup_steps", "warmup", "d"),
    ("steps", "steps", "d"),
    ("train_bpb", "train bpb", ".3f"),
    ("val_loss", "val loss", ".4f"),
    ("val_bpb", "val bpb", ".3f"),
    ("verdict", "", ""),
    ("wall_s", "wall s", ".1f"),
]
TRAINED = 0.9     # a row trained if its val bpb is at most this share of the unigram entropy
STABLE_COLUMNS = [
    ("label", "scheme", ""),
    ("largest_stable_lr", "largest stable lr", ".0e"),
    ("val_loss", "val loss there", ".4f"),
    ("val_bpb", "val bpb there", ".3f"),
]


def learning_rates(text: str) -> list[float]:
    """The swept learning rates: positive finite numbers (ConfigError otherwise)."""
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < math.inf for v in values):
        raise ConfigError(f"learning_rates={text!r} is not a comma-separated list of positive "
                          f"finite numbers; write e.g. 1e-3,1e-2", field="experiment.learning_rates")
    return sorted(set(values))


def run_one(cfg: InitConfig, run_root: str, scheme: str, lr: float, warmup: int) -> dict:
    """Train one row and reduce its summary to a table row."""
    label = scheme if warmup == 0 else f"{scheme} + {warmup} warmup"
    run_dir = os.path.join(run_root, f"{scheme}-w{warmup}-lr{lr:g}")
    summary = train_until_stopped(override(cfg, {
        "init.scheme": scheme, "optimizer.learning_rate": lr, "optimizer.warmup_steps": warmup,
        "run.run_dir": run_dir, "run.json": None}))
    trained = math.isfinite(summary.val_bpb) and summary.val_bpb <= TRAINED * summary.unigram_bpb
    verdict = "" if trained else ("diverged" if not math.isfinite(summary.val_bpb) else "stalled")
    return {"label": label, "scheme": scheme, "warmup_steps": warmup, "learning_rate": lr,
            "steps": summary.steps, "train_bpb": summary.train_bpb, "val_loss": summary.val_loss,
            "val_bpb": summary.val_bpb, "unigram_bpb": summary.unigram_bpb,
            "diverged_at_step": summary.diverged_at_step,
            "trained": trained, "verdict": verdict,
            "wall_s": summary.wall_s, "run_dir": run_dir, "interrupted": summary.interrupted}


def largest_stable(rows: list[dict]) -> list[dict]:
    """Per row label: the largest learning rate that trained, and its losses there."""
    table = []
    for label in dict.fromkeys(r["label"] for r in rows):
        stable = [r for r in rows if r["label"] == label and r["trained"]]
        best = max(stable, key=lambda r: r["learning_rate"]) if stable else None
        table.append({"label": label, "largest_stable_lr": best and best["learning_rate"],
                      "val_loss": best and best["val_loss"], "val_bpb": best and best["val_bpb"]})
    return table


@command(InitConfig)
def main(argv=None) -> int:
    cfg = parse_experiment(argv, InitConfig, defaults=DEFAULTS, fixed=FIXED,
                           description=__doc__.split("\n\n")[0])
    cfg.validate()
    exp = cfg.experiment
    schemes = parse_list(exp.schemes, "experiment.schemes", valid=SCHEMES)
    rates = learning_rates(exp.learning_rates)
    if exp.reference_warmup < 0 or exp.reference_warmup >= cfg.run.steps:
        raise ConfigError(f"reference_warmup must be in [0, steps={cfg.run.steps}), got "
                          f"{exp.reference_warmup}", field="experiment.reference_warmup")
    for scheme in schemes:                       # every row's model, before any training
        row_cfg = override(cfg, {"init.scheme": scheme})
        row_cfg.validate()
        techniques.abstract(row_cfg)             # the scheme's surgery on this model
    run_root = cfg.run.run_dir or os.path.join("runs",
                                               time.strftime("init_schemes-%Y%m%d-%H%M%S"))
    plan = [(scheme, lr, 0) for scheme in schemes for lr in rates]
    if exp.reference_warmup:
        plan += [("default", lr, exp.reference_warmup) for lr in rates]

    rows, partial = [], None
    for scheme, lr, warmup in plan:
        row = run_one(cfg, run_root, scheme, lr, warmup)
        if row["interrupted"]:
            partial = row["interrupted"]
            break
        rows.append(row)

    model = describe(cfg.model, cfg.gpt)
    stable = largest_stable(rows)
    meta = {"model": model, "data": cfg.data.path, "batching": cfg.data.batching,
            "seq_len": cfg.seq_len, "batch_size": cfg.data.batch_size, "steps": cfg.run.steps,
            "optimizer": cfg.optimizer.name, "schemes": schemes, "learning_rates": rates,
            "reference_warmup": exp.reference_warmup, "largest_stable": stable,
            **environment(), "run_dir": run_root, "interrupted": partial}
    print(f"\n{model} model, {cfg.run.steps} steps per row, {cfg.optimizer.name}, seq_len "
          f"{cfg.seq_len}, batch {cfg.data.batch_size}, {cfg.data.batching} batching, "
          f"{meta['device']}, jax {meta['jax_version']}"
          + (f" (PARTIAL: stopped by {partial})" if partial else ""))
    print(f"\nTable 1: every row without warmup, then the default init with warmup; trained = "
          f"final validation bits/byte finite and at most {TRAINED:.0%} of the unigram "
          f"entropy's")
    print(format_table(rows, COLUMNS))
    print("\nTable 2: the largest swept learning rate each scheme trains at")
    print(format_table(stable, STABLE_COLUMNS))
    top = max((r["learning_rate"] for r in rows), default=None)
    if top is not None:
        plot_loss_curves(os.path.join(run_root, "init_schemes.png"),
                         {r["label"]: r["run_dir"] for r in rows if r["learning_rate"] == top},
                         title=f"initialisation schemes at lr {top:g}, {model} model")
    write_json(cfg.run.json, rows, meta)
    if partial:
        return 128 + getattr(signal.Signals, partial, signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
