"""Incremental learning side by side: stochastic depth and progressive layer stacking against a
baseline on the same batches, in step time and in the time to reach the baseline's final
validation loss.

    python -m experiments.depth                         # 4 rows, 8x128 model: ~7 CPU minutes
    python -m experiments.depth --stochastic-depth-rates 0.2,0.5 --stacking-stages 2
    python -m experiments.depth --steps 600 --eval-every 30 --json depth.json

Rows: ``baseline`` (neither technique), ``stochastic depth P`` for each P of
``--stochastic-depth-rates`` (``stochastic_depth.rate``: block l of L skipped at l/L*P for rows it
then does not compute, every block run at evaluation) and ``progressive stacking S`` for each S
of ``--stacking-stages`` (``stacking.stages``: S stages of depth L/2^(S-1), ..., L in equal
shares of the steps, the depth doubled by copying the trained blocks; the depth L of the model's
stack must be divisible by 2^(S-1)). Any model whose blocks are an ``nn.Stack`` takes part
(``--model FILE.py:FUNCTION``). Every row trains the same ``--steps`` from the same seed on the
same batches, evaluating every ``--eval-every`` steps. The final evaluation takes the same
validation batches as the periodic ones (``--final-eval-batches`` defaults to
``--eval-batches`` here), so that every evaluation of every row is comparable with the
baseline's final one.

The table reports the mean step time (training seconds, which exclude evaluation, checkpoints
and compilation, over steps) and its ratio to the baseline's, the training FLOPs per token
(stochastic depth counts only the rows computed; stacking weights each stage's depth by its
steps), the share of block work stochastic depth keeps, the final validation loss, and the
first evaluation at or below the baseline's final validation loss: its step, the training
seconds up to it, and their share of the baseline's training seconds ("did not reach" when no
evaluation got there). Below the table it checks the issue's targets: stochastic depth 0.2 at
least 10 % cheaper per step than the baseline, progressive stacking at the baseline's final loss
within 80 % of the baseline's training time. Validation loss against training seconds, one line
per row, goes to ``depth.png`` in the run directory.
"""

import dataclasses
import math
import sys

from experiments.common import (Experiment, Row, config_of, eval_curve, first_reaching,
                                main_of, parse_list, plot_eval_curves, relative,
                                same_eval_batches, shared_run, stack_depth,
                                technique)
from jaxaccel.run.config import setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import describe

# The targets, reported against (not asserted).
SD_TARGET_RATE = 0.2         # stochastic depth at this rate ...
SD_TARGET_SAVING = 0.10      # ... takes at least this much less time per step than the baseline
STACK_TARGET_SHARE = 0.80    # stacking reaches the baseline's final loss within this share of
                             # the baseline's training time


@dataclasses.dataclass
class DepthSettings:
    stochastic_depth_rates: str = setting("0.2", "comma-separated stochastic depth rates P, one "
                                                 "row each, in [0, 1)")
    stacking_stages: str = setting("2,3", "comma-separated progressive stacking stage counts S, "
                                          "one row each; the depth of the model's stack must be "
                                          "divisible by 2^(S-1)")


DepthConfig = config_of(DepthSettings)


def rate(value: float) -> bool:
    "in [0, 1)"
    return 0.0 <= value < 1.0


def row(label: str, directory: str, kind: str, rate: float = 0.0, stages: int = 1) -> Row:
    return Row(label, {"stochastic_depth.rate": rate, "stacking.stages": stages,
                       "stacking.at": None},
               {"kind": kind, "stochastic_depth": rate, "progressive_stack": stages},
               directory=directory)


def rows(cfg: DepthConfig) -> list[Row]:
    """The baseline, a row per rate and per stage count; every setting checked before any
    training (one ConfigError line otherwise, naming this experiment's flag where it has one)."""
    from jaxaccel.techniques import stacking  # imports jax: not at the top, so that --help is fast
    exp, steps = cfg.experiment, cfg.run.steps
    rates = parse_list(exp.stochastic_depth_rates, "experiment.stochastic_depth_rates",
                       kind=float, within=rate, example="0.2,0.5")
    stages = parse_list(exp.stacking_stages, "experiment.stacking_stages", kind=int,
                        example="2,3")
    n_layers = stack_depth(cfg)
    if n_layers is None:
        raise ConfigError(f"stochastic depth and progressive stacking act on the model's blocks, "
                          f"but {cfg.model.name} has no single jaxaccel.model.nn.Stack; declare "
                          f"its blocks as one (README, 'Your own model')", field="model.name")
    for count in stages:
        if n_layers % 2 ** (count - 1):
            raise ConfigError(f"{count} stacking stages halve n_layers={n_layers} {count - 1} "
                              f"times, which does not divide it; use n_layers divisible by "
                              f"{2 ** (count - 1)} or fewer stages",
                              field="experiment.stacking_stages")
        if count > steps:
            raise ConfigError(f"{count} stacking stages need at least {count} steps, the run "
                              f"has {steps}; train more steps or use fewer stages",
                              field="run.steps")
        stacking.boundaries(steps, count)
    if cfg.run.eval_every % max(cfg.run.log_every, 1):
        raise ConfigError(f"log_every={cfg.run.log_every} does not divide eval_every="
                          f"{cfg.run.eval_every}; the training seconds at each evaluation come "
                          f"from the metrics logged at its step, choose a divisor",
                          field="run.log_every")
    return ([row("baseline", "baseline", "baseline")]
            + [row(f"stochastic depth {p:g}", f"stochastic-depth-{p:g}", "stochastic_depth",
                   rate=p) for p in dict.fromkeys(rates)]
            + [row(f"progressive stacking {s}", f"stacking-{s}", "progressive_stacking",
                   stages=s) for s in dict.fromkeys(stages)])


def result(summary, run) -> dict:
    return {"stochastic_depth_kept": technique(summary, "stochastic_depth", "kept", 1.0),
            "progressive_stages": technique(summary, "stacking", "stages"),
            "eval_curve": eval_curve(run.run_dir)}


def compare(cfg, rows: list[dict], partial):
    """Each row's step time and FLOPs against the baseline's (the first row), and the first of
    its evaluations at or below the baseline's final validation loss."""
    base = rows[0]
    relative(rows, base, step_vs_baseline=("step_ms", "ratio"),
             flops_vs_baseline=("flops_per_token", "ratio"))
    for r in rows:
        reached = first_reaching(r["eval_curve"], base["val_loss"])
        r["reached"] = reached is not None
        r["reach_step"] = reached and reached["step"]
        r["reach_train_s"] = reached and reached["train_s"]
        r["reach_share"] = reached and reached["train_s"] / base["train_s"]
        r["reach_step_text"], r["reach_s_text"], r["reach_share_text"] = (
            (str(reached["step"]), f"{reached['train_s']:.1f}", f"{r['reach_share']:.1%}")
            if reached else ("did not reach", "-", "did not reach"))
    return {"baseline_val_loss": base["val_loss"]}


def conclude(cfg, rows: list[dict]) -> list[str]:
    """The issue's targets against the measured rows, one line each."""
    base, lines = rows[0], []
    for r in rows[1:]:
        if r["kind"] == "stochastic_depth":
            saving = 1 - r["step_vs_baseline"]
            line = (f"{r['label']}: step time {saving:.1%} lower than the baseline's (its FLOPs "
                    f"per token {1 - r['flops_vs_baseline']:.1%} lower)")
            if math.isclose(r["stochastic_depth"], SD_TARGET_RATE):
                line += (f"; target >= {SD_TARGET_SAVING:.0%} lower: "
                         + ("met" if saving >= SD_TARGET_SAVING else
                            f"missed by {SD_TARGET_SAVING - saving:.1%} of the baseline's step "
                            f"time"))
        elif r["reached"]:
            share = r["reach_share"]
            line = (f"{r['label']}: reached the baseline's final val loss {base['val_loss']:.4f} "
                    f"at step {r['reach_step']}, after {r['reach_train_s']:.1f} s = {share:.1%} "
                    f"of the baseline's {base['train_s']:.1f} training seconds; target <= "
                    f"{STACK_TARGET_SHARE:.0%}: "
                    + ("met" if share <= STACK_TARGET_SHARE else
                       f"missed by {share - STACK_TARGET_SHARE:.1%} of the baseline's time"))
        else:
            line = (f"{r['label']}: did not reach the baseline's final val loss "
                    f"{base['val_loss']:.4f} in {r['steps']} steps ({r['train_s']:.1f} s = "
                    f"{r['train_s'] / base['train_s']:.1%} of the baseline's time); its final val "
                    f"loss {r['val_loss']:.4f} is {r['val_loss'] - base['val_loss']:+.4f} nats "
                    f"above; target <= {STACK_TARGET_SHARE:.0%} of the baseline's time: missed")
        lines.append(line)
    return lines


def setup(cfg: DepthConfig) -> str:
    return (f"{shared_run(cfg)}, evaluated every {cfg.run.eval_every} steps on "
            f"{cfg.run.eval_batches or 'all'} validation batches")


EXPERIMENT = Experiment(
    name="depth", doc=__doc__, config=DepthConfig, rows=rows, setup=setup,
    prepare=same_eval_batches,
    result=result, compare=compare, conclude=conclude,
    # An 8-layer model (2^2 divides it, for 3 stacking stages) small enough for the CPU, its
    # blocks scanned (one block to compile per stage and per run of equal kept rows), packed
    # batches, ten evaluations per row on the batches the final one takes, metrics logged at
    # every evaluation's step, no checkpoints but each stage's last.
    defaults={"gpt.d_model": 128, "gpt.n_layers": 8, "gpt.n_heads": 4,
              "remat.scan_layers": True,
              "data.batching": "pack", "data.seq_len": 128, "data.batch_size": 16,
              "run.steps": 400, "optimizer.warmup_steps": 40, "run.eval_every": 40,
              "run.eval_batches": 8, "run.log_every": 8, "run.checkpoint_every": 0,
              "run.final_eval_batches": None},     # None: the eval_batches of every evaluation
    # Set for each row; every row trains run.steps (not a token count), so that the rows take
    # the same steps on the same batches.
    fixed=("stochastic_depth.rate", "stacking.stages", "stacking.at", "run.train_tokens"),
    row_flags={"stochastic_depth.rate": "experiment.stochastic_depth_rates",
               "stacking.stages": "experiment.stacking_stages", "stacking.at": "run.steps"},
    columns=[("label", "row", ""), ("steps", "steps", "d"), ("step_ms", "step ms", ".1f"),
             ("step_vs_baseline", "vs baseline", ".3f"),
             ("flops_per_token", "FLOPs/token", ".4g"),
             ("stochastic_depth_kept", "blocks kept", ".1%"), ("val_loss", "val loss", ".4f"),
             ("val_bpb", "val bpb", ".3f"), ("reach_step_text", "step at base loss", ""),
             ("reach_s_text", "train s to it", ""), ("reach_share_text", "of base train s", ""),
             ("train_s", "train s", ".1f")],
    meta=lambda cfg, rows: {"eval_every": cfg.run.eval_every,
                            "eval_batches": cfg.run.eval_batches,
                            "final_eval_batches": cfg.run.final_eval_batches},
    plot=lambda path, cfg, rows: plot_eval_curves(
        path, rows, "train_s", "training seconds (without evaluation and compilation)",
        "validation loss (nats per token)", f"incremental learning, "
        f"{describe(cfg.model, cfg.gpt)} model, {cfg.run.steps} steps",
        flat="baseline's final val loss"))
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
