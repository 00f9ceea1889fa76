"""Importance sampling of documents against uniform sampling: validation loss against the real
tokens seen, and the tokens each sampler needs to reach uniform sampling's final validation loss.

    python -m experiments.importance                    # 3 rows, 4x128 model: ~3 CPU minutes
    python -m experiments.importance --samplings uniform,loss --steps 600 --json importance.json
    python -m experiments.importance --sampling-power 2 --sampling-floor 0.2

Rows: ``uniform`` (today's shuffled epochs, always the first row: the reference), ``loss`` and
``grad-norm`` (``data.sampling``: rows of fixed batching drawn with probability proportional to
their document's last relative loss or gradient-norm bound, smoothed by ``--sampling-power`` and
``--sampling-floor``, the loss reweighted by 1/(N p) so that its gradient stays unbiased; see
``jaxaccel.sampling``). Every row trains the same ``--steps`` of the same batch shape from the
same seed on the same training documents, evaluating every ``--eval-every`` steps on the same
validation batches (``--final-eval-batches`` defaults to ``--eval-batches`` here, so every
evaluation is comparable with uniform's final one).

The table reports each row's real tokens seen, its mean step time (training seconds over steps)
and its ratio to uniform's, its final validation loss, and the first evaluation at or below
uniform's final validation loss: the real tokens seen by then as a share of uniform's, and in
brackets the share where the loss, linear between evaluations, crosses it ("not reached" with the
gap of its final loss otherwise). Below the table it checks the issue's target on the
interpolated share: a sampler reaches uniform's final validation loss in <= 90 % of uniform's
tokens. Validation bits
per byte against tokens seen, one line per row, goes to ``importance.png`` in the run directory.
"""

import dataclasses
import os
import sys
import time

from experiments.common import (command, environment, exit_code, parse_experiment, parse_list,
                                print_table, train_until_stopped, write_json)
from jaxaccel.config import TrainConfig, override, setting
from jaxaccel.errors import ConfigError
from jaxaccel.metrics import BITS_PER_NAT, plot_curves, read_metrics
from jaxaccel.model import describe
from jaxaccel.sampling import SAMPLING

TARGET_SHARE = 0.90     # a sampler reaches uniform's final val loss within this share of tokens


@dataclasses.dataclass
class ImportanceSettings:
    samplings: str = setting("uniform,loss,grad-norm", "comma-separated samplers, one row each, "
                                                       "of: " + ", ".join(SAMPLING) +
                                                       " (uniform always runs, first)")


@dataclasses.dataclass
class ImportanceConfig(TrainConfig):
    """The training config every row shares (with this experiment's defaults) plus the rows."""

    experiment: ImportanceSettings = dataclasses.field(default_factory=ImportanceSettings)


# This experiment's defaults: a 4 x 128 model small enough for the CPU, fixed batching (the rows
# importance sampling draws), ten evaluations per row on the batches the final one takes,
# metrics logged at every evaluation's step, no checkpoints but the last.
DEFAULTS = {"gpt.d_model": 128, "gpt.n_layers": 4, "gpt.n_heads": 4,
            "data.batching": "fixed", "data.seq_len": 128, "data.batch_size": 16,
            "run.steps": 300, "optimizer.warmup_steps": 30, "run.eval_every": 30,
            "run.eval_batches": 8, "run.log_every": 10, "run.checkpoint_every": 0,
            "run.final_eval_batches": None}     # None: the eval_batches of every evaluation
# Set for each row; every row trains run.steps (not a token count).
FIXED = ("data.sampling", "run.train_tokens")

COLUMNS = [
    ("label", "row", ""),
    ("steps", "steps", "d"),
    ("real_tokens", "tokens seen", ",d"),
    ("step_ms", "step ms", ".1f"),
    ("step_vs_uniform", "vs uniform", ".3f"),
    ("val_loss", "val loss", ".4f"),
    ("val_bpb", "val bpb", ".3f"),
    ("reach_step_text", "step at uniform's loss", ""),
    ("reach_share_text", "of uniform's tokens (interpolated)", ""),
    ("train_s", "train s", ".1f"),
]


def plan_rows(cfg: ImportanceConfig) -> list[str]:
    """The samplers, uniform first, each row's config checked before any training."""
    field = "experiment.samplings"
    names = parse_list(cfg.experiment.samplings, field, valid=SAMPLING)
    rows = ["uniform"] + [name for name in dict.fromkeys(names) if name != "uniform"]
    every = max(cfg.run.log_every, 1)
    if cfg.run.eval_every == 0 or cfg.run.eval_every % every:
        raise ConfigError(f"log_every={cfg.run.log_every} must divide eval_every="
                          f"{cfg.run.eval_every} (> 0): the tokens seen at each evaluation come "
                          f"from the metrics logged at its step", field="run.log_every")
    for name in rows:
        try:
            override(cfg, {"data.sampling": name}).validate()
        except ConfigError as e:
            raise ConfigError(str(e), field=field if e.field == "data.sampling" else e.field
                              ) from None
    return rows


def check_run_root(run_root: str, rows: list[str]):
    """No row may land on an earlier run's checkpoints."""
    for name in rows:
        checkpoints = os.path.join(run_root, name, "checkpoints")
        if os.path.isdir(checkpoints) and os.listdir(checkpoints):
            raise ConfigError(f"run dir {run_root} already holds this experiment's row "
                              f"{name!r}; choose another run_dir", field="run.run_dir")


def eval_curve(run_dir: str) -> list[dict]:
    """Every evaluation of a row in step order: its step, loss and the real tokens seen up to it
    (the sum of the train records logged at or before its step)."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    trained = sorted((r["step"], r["real_tokens"]) for r in records if r["kind"] == "train")
    curve = []
    for r in sorted((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"]):
        tokens = sum(t for step, t in trained if step <= r["step"])
        curve.append({"step": r["step"], "loss": r["loss"], "tokens": tokens})
    return curve


def run_row(cfg: ImportanceConfig, name: str, run_root: str) -> dict:
    """Train one row and reduce its summary and metrics to a table row."""
    run_dir = os.path.join(run_root, name)
    summary = train_until_stopped(override(cfg, {"data.sampling": name, "run.run_dir": run_dir,
                                   "run.json": None}))
    stopped = summary.interrupted
    steps = summary.steps_this_run
    return {
        "label": name + (f" (stopped by {stopped})" if stopped else ""),
        "sampling": name,
        "steps": summary.steps,
        "real_tokens": summary.real_tokens,
        "train_s": summary.train_s,
        "wall_s": summary.wall_s,
        "compile_s": summary.compile_s,
        "step_ms": 1e3 * summary.train_s / steps if steps else None,
        "real_tokens_per_s": summary.real_tokens_per_s,
        "data_wait_s": summary.data_wait_s,
        "val_loss": None if stopped else summary.val_loss,
        "val_bpb": None if stopped else summary.val_bpb,
        "diverged_at_step": summary.diverged_at_step,
        "val_tokens": summary.val_tokens,
        "train_bpb": summary.train_bpb,
        "eval_curve": eval_curve(run_dir),
        "run_dir": run_dir,
        "interrupted": stopped,
    }


def compare_with_uniform(rows: list[dict]):
    """Each row's step time against uniform's (the first row), and the first of its evaluations
    at or below uniform's final validation loss, in tokens seen as a share of uniform's."""
    base = rows[0]
    target = base["val_loss"]
    for row in rows:
        row["step_vs_uniform"] = (row["step_ms"] / base["step_ms"]
                                  if row["step_ms"] and base["step_ms"] else None)
        reached = None if target is None else next(
            (point for point in row["eval_curve"] if point["loss"] <= target), None)
        row["reached"] = None if target is None else reached is not None
        row["reach_step"] = reached and reached["step"]
        row["reach_tokens"] = reached and reached["tokens"]
        row["reach_share"] = reached and reached["tokens"] / base["real_tokens"]
        crossing = None if reached is None else crossing_tokens(row["eval_curve"], target)
        row["reach_share_interpolated"] = crossing and crossing / base["real_tokens"]
        row["loss_gap"] = (None if target is None or row["val_loss"] is None
                           else row["val_loss"] - target)
        if target is None:
            texts = ("n/a", "n/a")
        elif reached is None:
            texts = ("not reached", f"not reached ({row['loss_gap']:+.4f} nats)"
                     if row["loss_gap"] is not None else "not reached")
        else:
            texts = (str(reached["step"]), f"{row['reach_share']:.1%} "
                     f"({row['reach_share_interpolated']:.1%})")
        row["reach_step_text"], row["reach_share_text"] = texts


def crossing_tokens(curve: list[dict], target: float) -> float:
    """The tokens at which the validation loss, linear between evaluations, first reaches
    ``target`` (the first evaluation's tokens if that one is already at or below it)."""
    before = None
    for point in curve:
        if point["loss"] <= target:
            if before is None:
                return point["tokens"]
            fall = (before["loss"] - target) / (before["loss"] - point["loss"])
            return before["tokens"] + fall * (point["tokens"] - before["tokens"])
        before = point
    return None


def verdicts(rows: list[dict]) -> list[str]:
    """The issue's target against the measured rows, one line per sampler."""
    base, lines = rows[0], []
    if base["interrupted"]:
        return lines
    for row in rows[1:]:
        if row["interrupted"]:
            continue
        overhead = f"step time {row['step_vs_uniform'] - 1:+.1%} against uniform's"
        if row["reached"]:
            share = row["reach_share_interpolated"]
            lines.append(
                f"{row['label']}: reached uniform's final val loss {base['val_loss']:.4f} at "
                f"the evaluation of step {row['reach_step']}, after {row['reach_tokens']:,} "
                f"tokens = {row['reach_share']:.1%} of uniform's {base['real_tokens']:,} "
                f"({share:.1%} interpolated between evaluations); target <= "
                f"{TARGET_SHARE:.0%} (interpolated): "
                + ("met" if share <= TARGET_SHARE else
                   f"missed by {share - TARGET_SHARE:.1%} of uniform's tokens") + f"; {overhead}")
        else:
            gap = row["loss_gap"]
            lines.append(
                f"{row['label']}: did not reach uniform's final val loss {base['val_loss']:.4f} in "
                f"{row['real_tokens']:,} tokens ({row['real_tokens'] / base['real_tokens']:.1%} of "
                f"uniform's); its final val loss {row['val_loss']:.4f} is {gap:+.4f} nats "
                f"({gap * BITS_PER_NAT:+.4f} bits/byte, {gap / base['val_loss']:+.2%}) above; "
                f"target <= {TARGET_SHARE:.0%} of uniform's tokens: missed; {overhead}")
    return lines


def plot(path: str, rows: list[dict], title: str):
    """Validation bits per byte against real tokens seen, one line per row, with uniform's
    final value as a flat line."""
    curves = {row["label"]: ([p["tokens"] for p in row["eval_curve"]],
                             [p["loss"] * BITS_PER_NAT for p in row["eval_curve"]])
              for row in rows if row["eval_curve"]}
    base = rows[0]
    if base["val_bpb"] is not None and curves:
        right = max(max(xs) for xs, _ in curves.values())
        curves["uniform's final val bpb"] = ([0, right], [base["val_bpb"]] * 2)
    plot_curves(path, curves, xlabel="real tokens seen", ylabel="validation bits per byte",
                title=title)


@command(ImportanceConfig)
def main(argv=None) -> int:
    cfg = parse_experiment(argv, ImportanceConfig, defaults=DEFAULTS, fixed=FIXED,
                           description=__doc__.split("\n\n")[0])
    if cfg.run.final_eval_batches is None and cfg.run.eval_batches:
        cfg = override(cfg, {"run.final_eval_batches": cfg.run.eval_batches})
    cfg.validate()
    plan = plan_rows(cfg)
    run_root = cfg.run.run_dir or os.path.join("runs",
                                               time.strftime("importance-%Y%m%d-%H%M%S"))
    check_run_root(run_root, plan)

    rows, partial = [], None
    for name in plan:
        rows.append(run_row(cfg, name, run_root))
        if rows[-1]["interrupted"]:
            partial = rows[-1]["interrupted"]
            break
    compare_with_uniform(rows)
    lines = verdicts(rows)

    model = describe(cfg.model, cfg.gpt)
    meta = {"model": model, "data": cfg.data.path, "batching": cfg.data.batching,
            "seq_len": cfg.seq_len, "batch_size": cfg.batch_rows(), "steps": cfg.run.steps,
            "eval_every": cfg.run.eval_every, "eval_batches": cfg.run.eval_batches,
            "final_eval_batches": cfg.run.final_eval_batches, "seed": cfg.run.seed,
            "sampling_power": cfg.data.sampling_power, "sampling_floor": cfg.data.sampling_floor,
            "uniform_val_loss": rows[0]["val_loss"], "target_share": TARGET_SHARE,
            "targets": lines, **environment(), "run_dir": run_root, "interrupted": partial}
    print(f"\n{model} model, {cfg.run.steps} steps per row (batch {cfg.batch_rows()} x seq_len "
          f"{cfg.seq_len}, fixed batching, seed {cfg.run.seed}), sampling power "
          f"{cfg.data.sampling_power:g}, floor {cfg.data.sampling_floor:g}, evaluated every "
          f"{cfg.run.eval_every} steps on {cfg.run.eval_batches or 'all'} validation batches, "
          f"{meta['device']}, jax {meta['jax_version']}"
          + (f" (PARTIAL: stopped by {partial}; later rows not run)" if partial else ""))
    print_table(rows, COLUMNS, lines)
    figure = os.path.join(run_root, "importance.png")
    plot(figure, rows, title=f"importance sampling, {model} model, {cfg.run.steps} steps")
    print(f"\nvalidation bits per byte against tokens seen: {figure}")
    write_json(cfg.run.json, rows, meta)
    return exit_code(partial)


if __name__ == "__main__":
    sys.exit(main())
