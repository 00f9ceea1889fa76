"""Importance sampling of documents against uniform sampling: validation loss against the real
tokens seen, and the tokens each sampler needs to reach uniform sampling's final validation loss.

    python -m experiments.importance                    # 3 rows, 4x128 model: ~3 CPU minutes
    python -m experiments.importance --samplings uniform,loss --steps 600 --json importance.json
    python -m experiments.importance --sampling-power 2 --sampling-floor 0.2

Rows: ``uniform`` (today's shuffled epochs, always the first row: the reference), ``loss`` and
``grad-norm`` (``data.sampling``: rows of fixed batching drawn with probability proportional to
their document's last relative loss or gradient-norm bound, smoothed by ``--sampling-power`` and
``--sampling-floor``, the loss reweighted by 1/(N p) so that its gradient stays unbiased; see
``jaxaccel.data.sampling``). Every row trains the same ``--steps`` of the same batch shape from the
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
import sys

from experiments.common import (Experiment, Row, config_of, eval_curve, first_reaching,
                                main_of, parse_list, plot_eval_curves, relative,
                                same_eval_batches, shared_run)
from jaxaccel.run.config import setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.step.metrics import BITS_PER_NAT
from jaxaccel.core.sections import SAMPLING, describe

TARGET_SHARE = 0.90     # a sampler reaches uniform's final val loss within this share of tokens


@dataclasses.dataclass
class ImportanceSettings:
    samplings: str = setting("uniform,loss,grad-norm", "comma-separated samplers, one row each, "
                                                       "of: " + ", ".join(SAMPLING) +
                                                       " (uniform always runs, first)")


ImportanceConfig = config_of(ImportanceSettings)


def rows(cfg: ImportanceConfig) -> list[Row]:
    """The samplers, uniform first."""
    names = parse_list(cfg.experiment.samplings, "experiment.samplings", valid=SAMPLING)
    # The run's own check would suggest --sampling uniform, which this experiment sets per row.
    if cfg.data.batching != "fixed" and set(names) - {"uniform"}:
        raise ConfigError(f"importance sampling draws rows of fixed batching, not "
                          f"{cfg.data.batching!r}; use --batching fixed", field="data.batching")
    if cfg.run.eval_every == 0 or cfg.run.eval_every % max(cfg.run.log_every, 1):
        raise ConfigError(f"log_every={cfg.run.log_every} must divide eval_every="
                          f"{cfg.run.eval_every} (> 0): the tokens seen at each evaluation come "
                          f"from the metrics logged at its step", field="run.log_every")
    return [Row(name, {"data.sampling": name}, {"sampling": name})
            for name in dict.fromkeys(["uniform", *names])]


def result(summary, run) -> dict:
    return {"data_wait_s": summary.data_wait_s, "eval_curve": eval_curve(run.run_dir),
            "interrupted": summary.interrupted}


def crossing_tokens(curve: list[dict], target: float) -> float | None:
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


def compare(cfg: ImportanceConfig, results: list[dict], partial) -> dict:
    """Each row's step time against uniform's (the first row), and the first of its evaluations
    at or below uniform's final validation loss, in tokens seen as a share of uniform's."""
    base = results[0]
    target, tokens = base["val_loss"], base["real_tokens"]
    relative(results, base, step_vs_uniform=("step_ms", "ratio"))
    for r in results:
        reached = first_reaching(r["eval_curve"], target)
        crossing = reached and crossing_tokens(r["eval_curve"], target)
        r["reached"] = None if target is None else reached is not None
        r["reach_step"] = reached and reached["step"]
        r["reach_tokens"] = reached and reached["tokens"]
        r["reach_share"] = reached and reached["tokens"] / tokens
        r["reach_share_interpolated"] = crossing and crossing / tokens
        r["loss_gap"] = (None if target is None or r["val_loss"] is None
                         else r["val_loss"] - target)
        if target is None:
            texts = ("n/a", "n/a")
        elif reached is None:
            texts = ("not reached", "not reached" if r["loss_gap"] is None
                     else f"not reached ({r['loss_gap']:+.4f} nats)")
        else:
            texts = (str(reached["step"]), f"{r['reach_share']:.1%} "
                     f"({r['reach_share_interpolated']:.1%})")
        r["reach_step_text"], r["reach_share_text"] = texts
    return {"uniform_val_loss": target}


def conclude(cfg: ImportanceConfig, results: list[dict]) -> list[str]:
    """The issue's target against the measured rows, one line per sampler."""
    base, lines = results[0], []
    for r in results[1:]:
        overhead = f"step time {r['step_vs_uniform'] - 1:+.1%} against uniform's"
        if r["reached"]:
            share = r["reach_share_interpolated"]
            lines.append(
                f"{r['label']}: reached uniform's final val loss {base['val_loss']:.4f} at "
                f"the evaluation of step {r['reach_step']}, after {r['reach_tokens']:,} "
                f"tokens = {r['reach_share']:.1%} of uniform's {base['real_tokens']:,} "
                f"({share:.1%} interpolated between evaluations); target <= "
                f"{TARGET_SHARE:.0%} (interpolated): "
                + ("met" if share <= TARGET_SHARE else
                   f"missed by {share - TARGET_SHARE:.1%} of uniform's tokens") + f"; {overhead}")
        else:
            gap = r["loss_gap"]
            lines.append(
                f"{r['label']}: did not reach uniform's final val loss {base['val_loss']:.4f} in "
                f"{r['real_tokens']:,} tokens ({r['real_tokens'] / base['real_tokens']:.1%} of "
                f"uniform's); its final val loss {r['val_loss']:.4f} is {gap:+.4f} nats "
                f"({gap * BITS_PER_NAT:+.4f} bits/byte, {gap / base['val_loss']:+.2%}) above; "
                f"target <= {TARGET_SHARE:.0%} of uniform's tokens: missed; {overhead}")
    return lines


def setup(cfg: ImportanceConfig) -> str:
    return (f"{shared_run(cfg)}, seed {cfg.run.seed}, sampling power "
            f"{cfg.data.sampling_power:g}, floor {cfg.data.sampling_floor:g}, evaluated every "
            f"{cfg.run.eval_every} steps on {cfg.run.eval_batches or 'all'} validation batches")


EXPERIMENT = Experiment(
    name="importance", doc=__doc__, config=ImportanceConfig, rows=rows, setup=setup,
    prepare=same_eval_batches, result=result, compare=compare, conclude=conclude,
    columns=[("label", "row", ""), ("steps", "steps", "d"),
             ("real_tokens", "tokens seen", ",d"), ("step_ms", "step ms", ".1f"),
             ("step_vs_uniform", "vs uniform", ".3f"), ("val_loss", "val loss", ".4f"),
             ("val_bpb", "val bpb", ".3f"), ("reach_step_text", "step at uniform's loss", ""),
             ("reach_share_text", "of uniform's tokens (interpolated)", ""),
             ("train_s", "train s", ".1f")],
    # A 4 x 128 model small enough for the CPU, fixed batching (the rows importance sampling
    # draws), ten evaluations per row on the batches the final one takes, metrics logged at
    # every evaluation's step, no checkpoints but the last.
    defaults={"gpt.d_model": 128, "gpt.n_layers": 4, "gpt.n_heads": 4,
              "data.batching": "fixed", "data.seq_len": 128, "data.batch_size": 16,
              "run.steps": 300, "optimizer.warmup_steps": 30, "run.eval_every": 30,
              "run.eval_batches": 8, "run.log_every": 10, "run.checkpoint_every": 0,
              "run.final_eval_batches": None},     # None: the eval_batches of every evaluation
    # Set for each row; every row trains run.steps (not a token count).
    fixed=("data.sampling", "run.train_tokens"),
    row_flags={"data.sampling": "experiment.samplings"},
    meta=lambda cfg, rows: {"batch_size": cfg.batch_rows(), "eval_every": cfg.run.eval_every,
                            "eval_batches": cfg.run.eval_batches,
                            "final_eval_batches": cfg.run.final_eval_batches,
                            "sampling_power": cfg.data.sampling_power,
                            "sampling_floor": cfg.data.sampling_floor,
                            "target_share": TARGET_SHARE},
    plot=lambda path, cfg, rows: plot_eval_curves(
        path, rows, "tokens", "real tokens seen", "validation bits per byte",
        f"importance sampling, {describe(cfg.model, cfg.gpt)} model, {cfg.run.steps} steps",
        scale=BITS_PER_NAT, flat="uniform's final val bpb"))
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
