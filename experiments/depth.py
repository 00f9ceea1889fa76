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
import os
import sys
import time

from experiments.common import (command, environment, exit_code, parse_experiment, parse_list,
                                print_table, stack_depth, technique, train_until_stopped,
                                write_json)
from jaxaccel import stacking, techniques
from jaxaccel.config import TrainConfig, override, setting
from jaxaccel.errors import ConfigError
from jaxaccel.metrics import plot_curves, read_metrics
from jaxaccel.model import describe

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


@dataclasses.dataclass
class DepthConfig(TrainConfig):
    """The training config every row shares (with this experiment's defaults) plus the rows."""

    experiment: DepthSettings = dataclasses.field(default_factory=DepthSettings)


# This experiment's defaults: an 8-layer model (2^2 divides it, for 3 stacking stages) small
# enough for the CPU, its blocks scanned (one block to compile per stage and per run of equal
# kept rows), packed batches, ten evaluations per row on the batches the final one takes,
# metrics logged at every evaluation's step, no checkpoints but each stage's last.
DEFAULTS = {"gpt.d_model": 128, "gpt.n_layers": 8, "gpt.n_heads": 4,
            "remat.scan_layers": True,
            "data.batching": "pack", "data.seq_len": 128, "data.batch_size": 16,
            "run.steps": 400, "optimizer.warmup_steps": 40, "run.eval_every": 40,
            "run.eval_batches": 8, "run.log_every": 8, "run.checkpoint_every": 0,
            "run.final_eval_batches": None}     # None: the eval_batches of every evaluation
# Set for each row; every row trains run.steps (not a token count), so that the rows take the
# same steps on the same batches.
FIXED = ("stochastic_depth.rate", "stacking.stages", "stacking.at", "run.train_tokens")
# A row config's error in a field this experiment sets is reported against the flag that sets it.
ROW_FIELDS = {"stochastic_depth.rate": "experiment.stochastic_depth_rates",
              "stacking.stages": "experiment.stacking_stages",
              "stacking.at": "run.steps"}

COLUMNS = [
    ("label", "row", ""),
    ("steps", "steps", "d"),
    ("step_ms", "step ms", ".1f"),
    ("step_vs_baseline", "vs baseline", ".3f"),
    ("flops_per_token", "FLOPs/token", ".4g"),
    ("stochastic_depth_kept", "blocks kept", ".1%"),
    ("val_loss", "val loss", ".4f"),
    ("val_bpb", "val bpb", ".3f"),
    ("reach_step_text", "step at base loss", ""),
    ("reach_s_text", "train s to it", ""),
    ("reach_share_text", "of base train s", ""),
    ("train_s", "train s", ".1f"),
]


class Interrupted(Exception):
    """A row was stopped by a signal (or a request); the experiment stops as a whole."""


@dataclasses.dataclass
class Row:
    label: str
    name: str                   # the row's subdirectory of the run root
    kind: str                   # baseline, stochastic_depth or progressive_stacking
    stochastic_depth: float = 0.0
    progressive_stack: int = 1

    def settings(self) -> dict:
        return {"stochastic_depth.rate": self.stochastic_depth,
                "stacking.stages": self.progressive_stack, "stacking.at": None}


def parse_rates(text: str) -> list[float]:
    """The stochastic depth rates of ``--stochastic-depth-rates``, each in [0, 1)."""
    field = "experiment.stochastic_depth_rates"
    items = [item.strip() for item in (text or "").split(",") if item.strip()]
    try:
        rates = [float(item) for item in items]
    except ValueError:
        rates = []
    if not rates:
        raise ConfigError(f"stochastic_depth_rates={text!r} is not a comma-separated list of "
                          f"rates; write e.g. 0.2,0.5", field=field)
    bad = [rate for rate in rates if not 0.0 <= rate < 1.0]
    if bad:
        raise ConfigError(f"stochastic depth rate {bad[0]:g} is outside [0, 1); give rates of at "
                          f"least 0 and below 1, e.g. 0.2", field=field)
    return rates


def plan_rows(cfg: DepthConfig) -> list[Row]:
    """The rows, checked before any training: every rate and stage count, and each row's whole
    config (one ConfigError line otherwise, naming this experiment's flag where it has one)."""
    exp, steps = cfg.experiment, cfg.run.steps
    rates = parse_rates(exp.stochastic_depth_rates)
    stages = parse_list(exp.stacking_stages, "experiment.stacking_stages", kind=int)
    n_layers = stack_depth(cfg)
    if n_layers is None:
        raise ConfigError(f"stochastic depth and progressive stacking act on the model's blocks, "
                          f"but {cfg.model.name} has no single jaxaccel.nn.Stack; declare its "
                          f"blocks as one (README, 'Your own model')", field="model.name")
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
    rows = [Row("baseline", "baseline", "baseline")]
    rows += [Row(f"stochastic depth {rate:g}", f"stochastic-depth-{rate:g}", "stochastic_depth",
                 stochastic_depth=rate)
             for rate in dict.fromkeys(rates)]
    rows += [Row(f"progressive stacking {count}", f"stacking-{count}", "progressive_stacking",
                 progressive_stack=count)
             for count in dict.fromkeys(stages)]
    every = max(cfg.run.log_every, 1)
    if cfg.run.eval_every % every:
        raise ConfigError(f"log_every={cfg.run.log_every} does not divide eval_every="
                          f"{cfg.run.eval_every}; the training seconds at each evaluation come "
                          f"from the metrics logged at its step, choose a divisor",
                          field="run.log_every")
    for row in rows:
        try:
            row_cfg = override(cfg, row.settings())
            row_cfg.validate()
            stacking.boundaries(steps, row.progressive_stack)
            techniques.abstract(row_cfg)        # the row's model, every technique applied
        except ConfigError as e:
            raise ConfigError(str(e), field=ROW_FIELDS.get(e.field, e.field)) from None
    return rows


def check_run_root(run_root: str, rows: list[Row]):
    """No row may land on an earlier run's checkpoints (found only after the rows before it
    trained)."""
    for row in rows:
        checkpoints = os.path.join(run_root, row.name, "checkpoints")
        if os.path.isdir(checkpoints) and os.listdir(checkpoints):
            raise ConfigError(f"run dir {run_root} already holds this experiment's row "
                              f"{row.name!r}; choose another run_dir", field="run.run_dir")


def eval_curve(run_dir: str) -> list[dict]:
    """Every evaluation of a row in step order: its step, loss, and the training seconds up to
    it (those of the train record logged at its step; the first one after it if none was)."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    trained = sorted((r["step"], r["train_s"]) for r in records if r["kind"] == "train")
    curve = []
    for r in sorted((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"]):
        seconds = next((s for step, s in trained if step >= r["step"]), None)
        if seconds is not None:
            curve.append({"step": r["step"], "loss": r["loss"], "train_s": seconds})
    return curve


def run_row(cfg: DepthConfig, row: Row, run_root: str) -> dict:
    """Train one row and reduce its summary and metrics to a table row."""
    run_dir = os.path.join(run_root, row.name)
    summary = train_until_stopped(override(cfg, {**row.settings(), "run.run_dir": run_dir,
                                                 "run.json": None}))
    stopped = summary.interrupted
    steps = summary.steps_this_run
    return {
        "label": row.label + (f" (stopped by {stopped})" if stopped else ""),
        "kind": row.kind,
        "stochastic_depth": row.stochastic_depth,
        "progressive_stack": row.progressive_stack,
        "steps": summary.steps,
        "train_s": summary.train_s,
        "wall_s": summary.wall_s,
        "compile_s": summary.compile_s,
        "step_ms": 1e3 * summary.train_s / steps if steps else None,
        "real_tokens": summary.real_tokens,
        "real_tokens_per_s": summary.real_tokens_per_s,
        "flops_per_token": summary.flops_per_token,
        "stochastic_depth_kept": technique(summary, "stochastic_depth", "kept", 1.0),
        "progressive_stages": technique(summary, "stacking", "stages"),
        "params": summary.params,
        "val_loss": None if stopped else summary.val_loss,
        "val_bpb": None if stopped else summary.val_bpb,
        "diverged_at_step": summary.diverged_at_step,
        "val_tokens": summary.val_tokens,
        "train_bpb": summary.train_bpb,
        "eval_curve": eval_curve(run_dir),
        "run_dir": run_dir,
        "interrupted": stopped,
    }


def compare_with_baseline(rows: list[dict]):
    """Each row's step time and FLOPs against the baseline's (the first row), and the first of
    its evaluations at or below the baseline's final validation loss."""
    base = rows[0]
    target = base["val_loss"]
    for row in rows:
        row["step_vs_baseline"] = (row["step_ms"] / base["step_ms"]
                                   if row["step_ms"] and base["step_ms"] else None)
        row["flops_vs_baseline"] = row["flops_per_token"] / base["flops_per_token"]
        reached = None if target is None else next(
            (point for point in row["eval_curve"] if point["loss"] <= target), None)
        row["reached"] = None if target is None else reached is not None
        row["reach_step"] = reached and reached["step"]
        row["reach_train_s"] = reached and reached["train_s"]
        row["reach_share"] = reached and reached["train_s"] / base["train_s"]
        if target is None:
            texts = ("n/a", "n/a", "n/a")
        elif reached is None:
            texts = ("did not reach", "-", "did not reach")
        else:
            texts = (str(reached["step"]), f"{reached['train_s']:.1f}",
                     f"{row['reach_share']:.1%}")
        row["reach_step_text"], row["reach_s_text"], row["reach_share_text"] = texts


def verdicts(rows: list[dict]) -> list[str]:
    """The issue's targets against the measured rows, one line each."""
    base, lines = rows[0], []
    if base["interrupted"]:
        return lines
    for row in rows[1:]:
        if row["interrupted"] or row["step_vs_baseline"] is None:
            continue
        if row["kind"] == "stochastic_depth":
            saving = 1 - row["step_vs_baseline"]
            ideal = 1 - row["flops_vs_baseline"]
            line = (f"{row['label']}: step time {saving:.1%} lower than the baseline's "
                    f"(its FLOPs per token {ideal:.1%} lower)")
            if math.isclose(row["stochastic_depth"], SD_TARGET_RATE):
                met = saving >= SD_TARGET_SAVING
                line += (f"; target >= {SD_TARGET_SAVING:.0%} lower: "
                         + ("met" if met else f"missed by {SD_TARGET_SAVING - saving:.1%} "
                                              f"of the baseline's step time"))
        else:
            if row["reached"]:
                share = row["reach_share"]
                line = (f"{row['label']}: reached the baseline's final val loss "
                        f"{base['val_loss']:.4f} at step {row['reach_step']}, after "
                        f"{row['reach_train_s']:.1f} s = {share:.1%} of the baseline's "
                        f"{base['train_s']:.1f} training seconds; target <= "
                        f"{STACK_TARGET_SHARE:.0%}: "
                        + ("met" if share <= STACK_TARGET_SHARE else
                           f"missed by {share - STACK_TARGET_SHARE:.1%} of the baseline's time"))
            else:
                line = (f"{row['label']}: did not reach the baseline's final val loss "
                        f"{base['val_loss']:.4f} in {row['steps']} steps ({row['train_s']:.1f} s "
                        f"= {row['train_s'] / base['train_s']:.1%} of the baseline's time); its "
                        f"final val loss {row['val_loss']:.4f} is "
                        f"{row['val_loss'] - base['val_loss']:+.4f} nats above; target <= "
                        f"{STACK_TARGET_SHARE:.0%} of the baseline's time: missed")
        lines.append(line)
    return lines


def plot(path: str, rows: list[dict], title: str):
    """Validation loss against training seconds, one line per row, with the baseline's final
    loss as a flat line."""
    curves = {row["label"]: ([p["train_s"] for p in row["eval_curve"]],
                             [p["loss"] for p in row["eval_curve"]])
              for row in rows if row["eval_curve"]}
    base = rows[0]
    if base["val_loss"] is not None and curves:
        right = max(max(xs) for xs, _ in curves.values())
        curves["baseline's final val loss"] = ([0.0, right], [base["val_loss"]] * 2)
    plot_curves(path, curves, xlabel="training seconds (without evaluation and compilation)",
                ylabel="validation loss (nats per token)", title=title)


@command(DepthConfig)
def main(argv=None) -> int:
    cfg = parse_experiment(argv, DepthConfig, defaults=DEFAULTS, fixed=FIXED,
                           description=__doc__.split("\n\n")[0])
    if cfg.run.final_eval_batches is None and cfg.run.eval_batches:
        cfg = override(cfg, {"run.final_eval_batches": cfg.run.eval_batches})
    cfg.validate()
    plan = plan_rows(cfg)
    run_root = cfg.run.run_dir or os.path.join("runs", time.strftime("depth-%Y%m%d-%H%M%S"))
    check_run_root(run_root, plan)

    rows, partial = [], None
    for row in plan:
        rows.append(run_row(cfg, row, run_root))
        if rows[-1]["interrupted"]:
            partial = rows[-1]["interrupted"]
            break
    compare_with_baseline(rows)
    lines = verdicts(rows)

    model = describe(cfg.model, cfg.gpt)
    meta = {"model": model, "data": cfg.data.path, "batching": cfg.data.batching,
            "seq_len": cfg.seq_len, "batch_size": cfg.data.batch_size, "steps": cfg.run.steps,
            "eval_every": cfg.run.eval_every, "eval_batches": cfg.run.eval_batches,
            "final_eval_batches": cfg.run.final_eval_batches, "seed": cfg.run.seed,
            "baseline_val_loss": rows[0]["val_loss"], "targets": lines,
            **environment(), "run_dir": run_root, "interrupted": partial}
    print(f"\n{model} model, {cfg.run.steps} steps per row on the same batches (batch "
          f"{cfg.batch_rows()} x seq_len {cfg.seq_len}, {cfg.data.batching} batching), evaluated "
          f"every {cfg.run.eval_every} steps on {cfg.run.eval_batches or 'all'} validation "
          f"batches, {meta['device']}, jax {meta['jax_version']}"
          + (f" (PARTIAL: stopped by {partial}; later rows not run)" if partial else ""))
    print_table(rows, COLUMNS, lines)
    figure = os.path.join(run_root, "depth.png")
    plot(figure, rows, title=f"incremental learning, {model} model, {cfg.run.steps} steps")
    print(f"\nvalidation loss against training seconds: {figure}")
    write_json(cfg.run.json, rows, meta)
    return exit_code(partial)


if __name__ == "__main__":
    sys.exit(main())
