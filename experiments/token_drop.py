"""Token dropping: step time and validation loss of a model whose middle layers see only part of
each row's tokens, against the same model seeing all of them, at equal tokens.

    python -m experiments.token_drop                      # 5 rows, 8x128 model: ~7 CPU minutes
    python -m experiments.token_drop --keeps 0.5 --scores random --steps 100
    python -m experiments.token_drop --token-drop-layers 1:7 --json token_drop.json

Rows: ``keep 1`` (every layer sees every token), then for each keep ratio of ``--keeps`` and
each score of ``--scores`` a row with ``token_drop.keep`` at that ratio and
``token_drop.score`` that score (``jaxaccel.token_drop``: the layers
``--token-drop-layers``, by default the middle half, compute only ``K = keep x seq_len`` tokens
per row, rounded to a multiple of 8, drawn each step: ``random`` uniformly, ``loss`` weighted by
the running loss of each token's target id). Every row trains the same ``--steps``
from the same seed on the same batches, so the same real tokens, and evaluates once at the end
on the same validation batches, where every layer sees every token.

Then every row's train step is timed again, round-robin: ``--timed-rounds`` rounds, each running
every row in turn for ``--timed-steps`` steps on one fixed batch of random tokens (every
position real), so that a machine shared with other work slows every row alike; the step time
is the median of those steps. The table reports the kept tokens per row, that step time and its
speed-up against ``keep 1``, the training's own step time (the median over the logged windows
of ``--log-every`` steps) and real tokens per second, the training FLOPs per token the
accounting counts (``loop.finish.flops_per_token``, traced from the step: the middle layers'
matmuls at K/T, their attention at (K/T)^2) and the share it saves, the final
validation loss and bits per byte, and the validation loss's difference from ``keep 1``'s.
Below the table it checks the issue's targets for keep 0.5 in the middle half of the layers:
at least 20 % lower step time, and a validation loss within 2 % of ``keep 1``'s. Training bits
per byte against real tokens, one line per row, go to ``token_drop.png`` in the run directory.
"""

import dataclasses
import math
import os
import statistics
import sys
import time

import jax

from experiments.common import (command, environment, exit_code, parse_experiment, parse_list,
                                plot_loss_curves, print_table, random_batch, stack_depth,
                                train_until_stopped, write_json)
from jaxaccel import techniques, token_drop
from jaxaccel.config import TrainConfig, override, setting
from jaxaccel.errors import ConfigError
from jaxaccel.loader import place_batch
from jaxaccel.loop import sharded_steps
from jaxaccel.metrics import read_metrics
from jaxaccel.model import describe
from jaxaccel.optim import build_optimizer
from jaxaccel.sharding import batch_sharding, build_mesh, parse_axis_rules
from jaxaccel.state import init_sharded_state

# The targets for keep TARGET_KEEP in the middle half of the layers, reported against
# (not asserted).
TARGET_KEEP = 0.5
TARGET_SAVING = 0.20         # at least this much lower step time than keep 1
TARGET_LOSS = 0.02           # validation loss at most this much (relative) above keep 1's


@dataclasses.dataclass
class TokenDropSettings:
    keeps: str = setting("0.75,0.5", "comma-separated token keep ratios in (0, 1), each a row "
                                     "per score beside the keep 1 row")
    scores: str = setting("random,loss", "comma-separated token scores, each a row per keep "
                                         "ratio: random, loss")
    timed_rounds: int = setting(5, "rounds of the round-robin timing after training (0 = "
                                   "none): each times every row's step in turn")
    timed_steps: int = setting(4, "steps per row per timing round, after one warm-up step")


@dataclasses.dataclass
class TokenDropConfig(TrainConfig):
    """The training config every row shares (with this experiment's defaults) plus the rows."""

    experiment: TokenDropSettings = dataclasses.field(default_factory=TokenDropSettings)


# This experiment's defaults: an 8-layer model (middle half 2:6) small enough for the CPU, its
# blocks scanned (one block to compile per run of layers), sequences of 256 packed tokens, one
# evaluation at the end on a fixed share of the validation split, metrics logged every 10 steps
# (the windows the median step time is taken over), no checkpoints.
DEFAULTS = {"gpt.d_model": 128, "gpt.n_layers": 8, "gpt.n_heads": 4,
            "remat.scan_layers": True, "model.max_seq_len": 256,
            "data.batching": "pack", "data.seq_len": 256, "data.batch_size": 8,
            "run.steps": 150, "optimizer.warmup_steps": 15, "run.eval_every": 0,
            "run.final_eval_batches": 16, "run.log_every": 10, "run.checkpoint_every": 0}
# Set for each row; every row trains run.steps (not a token count) on the same batches.
FIXED = ("token_drop.keep", "token_drop.score", "run.train_tokens")
# A row config's error in a field this experiment sets is reported against the flag that sets it.
ROW_FIELDS = {"token_drop.keep": "experiment.keeps", "token_drop.score": "experiment.scores"}

COLUMNS = [
    ("label", "row", ""),
    ("kept_tokens", "K of T", ""),
    ("steps", "steps", "d"),
    ("step_ms", "step ms", ".1f"),
    ("speedup", "speed-up", ".3f"),
    ("train_step_ms", "train step ms", ".1f"),
    ("real_tokens_per_s", "train tokens/s", ",.0f"),
    ("flops_per_token", "FLOPs/token", ".4g"),
    ("flops_saved", "FLOPs saved", ".1%"),
    ("val_loss", "val loss", ".4f"),
    ("val_bpb", "val bpb", ".4f"),
    ("val_vs_base", "val loss vs keep 1", "+.2%"),
    ("train_s", "train s", ".1f"),
]


@dataclasses.dataclass
class Row:
    label: str
    name: str                   # the row's subdirectory of the run root
    keep: float = 1.0
    score: str = "random"

    def settings(self) -> dict:
        return {"token_drop.keep": self.keep, "token_drop.score": self.score}


def parse_keeps(text: str) -> list[float]:
    """The keep ratios of ``--keeps``, each in (0, 1)."""
    field = "experiment.keeps"
    items = [item.strip() for item in (text or "").split(",") if item.strip()]
    try:
        keeps = [float(item) for item in items]
    except ValueError:
        keeps = []
    if not keeps:
        raise ConfigError(f"keeps={text!r} is not a comma-separated list of keep ratios; write "
                          f"e.g. 0.75,0.5", field=field)
    bad = [keep for keep in keeps if not 0.0 < keep < 1.0]
    if bad:
        raise ConfigError(f"keep ratio {bad[0]:g} is outside (0, 1); give shares of the tokens "
                          f"above 0 and below 1 (the keep 1 row is always run), e.g. 0.5",
                          field=field)
    return keeps


def plan_rows(cfg: TokenDropConfig) -> list[Row]:
    """The rows, every one's config checked before any training (one ConfigError line
    otherwise, naming this experiment's flag where it has one)."""
    keeps = parse_keeps(cfg.experiment.keeps)
    scores = parse_list(cfg.experiment.scores, "experiment.scores", valid=token_drop.SCORES)
    rows = [Row("keep 1", "keep-1")]
    rows += [Row(f"keep {keep:g} {score}", f"keep-{keep:g}-{score}", keep, score)
             for keep in dict.fromkeys(keeps) for score in dict.fromkeys(scores)]
    for row in rows:
        try:
            row_cfg = override(cfg, row.settings())
            row_cfg.validate()
            techniques.abstract(row_cfg)      # the row's model: its stack, the dropped layers
        except ConfigError as e:
            raise ConfigError(str(e), field=ROW_FIELDS.get(e.field, e.field)) from None
    if cfg.run.log_every < 1:
        raise ConfigError("log_every must be >= 1: the training step time is the median over "
                          "the logged windows", field="run.log_every")
    for name in ("timed_rounds", "timed_steps"):
        if getattr(cfg.experiment, name) < (0 if name == "timed_rounds" else 1):
            raise ConfigError(f"{name} must be at least {0 if name == 'timed_rounds' else 1}, "
                              f"got {getattr(cfg.experiment, name)}", field=f"experiment.{name}")
    return rows


def median_step_ms(run_dir: str) -> float | None:
    """The median over the logged windows of their mean step time, in milliseconds."""
    records = sorted((r["step"], r["train_s"]) for r in
                     read_metrics(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "train")
    windows = [(s1 - s0) / (n1 - n0) for (n0, s0), (n1, s1) in zip([(0, 0.0)] + records, records)
               if n1 > n0]
    return 1e3 * statistics.median(windows) if windows else None


def run_row(cfg: TokenDropConfig, row: Row, run_root: str) -> dict:
    """Train one row and reduce its summary to a table row."""
    run_dir = os.path.join(run_root, row.name)
    row_cfg = override(cfg, {**row.settings(), "run.run_dir": run_dir, "run.json": None})
    summary = train_until_stopped(row_cfg)
    stopped = summary.interrupted
    kept = token_drop.kept_tokens(cfg.seq_len, row.keep)
    start, end = token_drop.layer_range(row_cfg.token_drop.layers, stack_depth(row_cfg))
    return {
        "label": row.label + (f" (stopped by {stopped})" if stopped else ""),
        "keep": row.keep, "score": row.score if row.keep < 1 else None,
        "kept_tokens": f"{kept} of {cfg.seq_len}",
        "kept": kept, "drop_layers": f"{start}:{end}" if row.keep < 1 else None,
        "steps": summary.steps,
        "train_s": summary.train_s,
        "mean_step_ms": (1e3 * summary.train_s / summary.steps_this_run
                         if summary.steps_this_run else None),
        "train_step_ms": median_step_ms(run_dir),
        "wall_s": summary.wall_s,
        "compile_s": summary.compile_s,
        "real_tokens": summary.real_tokens,
        "real_tokens_per_s": summary.real_tokens_per_s,
        "flops_per_token": summary.flops_per_token,
        "mfu": summary.mfu,
        "train_bpb": summary.train_bpb,
        "val_loss": None if stopped else summary.val_loss,
        "val_bpb": None if stopped else summary.val_bpb,
        "diverged_at_step": summary.diverged_at_step,
        "val_tokens": summary.val_tokens,
        "compiles_after_warmup": summary.compiles_after_warmup,
        "run_dir": run_dir,
        "interrupted": stopped,
    }


def time_rows(cfg: TokenDropConfig, plan: list[Row]) -> list[float]:
    """Each row's step time in milliseconds: the median of ``timed_rounds`` x ``timed_steps``
    steps on one fixed batch, the rows taking turns each round (each step run to completion).
    Each row's step is the one its training ran (``loop.sharded_steps`` on the config's mesh)."""
    exp, m = cfg.experiment, cfg.mesh
    mesh, _ = build_mesh(m.strategy, m.shape, m.axis_types, m.num_devices)
    steps = []
    with jax.default_matmul_precision(cfg.precision.matmul), jax.set_mesh(mesh):
        optimizer, schedule, _ = build_optimizer(cfg.optimizer, batch_rows=cfg.batch_rows(),
                                                 total_steps=cfg.run.steps)
        batch = place_batch(random_batch(cfg.batch_rows(), cfg.seq_len, cfg.model.vocab_size,
                                         cfg.run.seed), batch_sharding(mesh))
        for row in plan:
            row_cfg = override(cfg, row.settings())
            state, shardings = init_sharded_state(
                techniques.variables(row_cfg), optimizer, cfg.run.seed, row_cfg.make_loss_scale(),
                mesh, row_cfg.policy(), axis_rules=parse_axis_rules(row_cfg.mesh.axis_rules))
            step, _ = sharded_steps(row_cfg, techniques.abstract(row_cfg), optimizer, schedule,
                                    shardings, mesh)
            state = jax.block_until_ready(step(state, batch)[0])      # compiled, warmed up
            steps.append([step, state])
        seconds = [[] for _ in plan]
        for _ in range(exp.timed_rounds):
            for entry, times in zip(steps, seconds):
                for _ in range(exp.timed_steps):
                    start = time.perf_counter()
                    entry[1] = jax.block_until_ready(entry[0](entry[1], batch)[0])
                    times.append(time.perf_counter() - start)
    return [1e3 * statistics.median(times) for times in seconds]


def compare_with_base(rows: list[dict]):
    """Each row's step time, FLOPs and validation loss against the keep 1 row's."""
    base = rows[0]
    for row in rows:
        row["speedup"] = (base["step_ms"] / row["step_ms"]
                          if row["step_ms"] and base["step_ms"] else None)
        row["flops_saved"] = 1 - row["flops_per_token"] / base["flops_per_token"]
        row["val_vs_base"] = (row["val_loss"] / base["val_loss"] - 1
                              if row["val_loss"] is not None and base["val_loss"] else None)
        row["val_bpb_vs_base"] = (row["val_bpb"] - base["val_bpb"]
                                  if row["val_bpb"] is not None and base["val_bpb"] is not None
                                  else None)


def verdicts(rows: list[dict], middle_half: bool) -> list[str]:
    """The issue's targets against the measured rows, one line per token-dropping row."""
    base, lines = rows[0], []
    if base["interrupted"]:
        return lines
    for row in rows[1:]:
        if row["interrupted"] or row["speedup"] is None or row["val_vs_base"] is None:
            continue
        saving = 1 - row["step_ms"] / base["step_ms"]
        line = (f"{row['label']} (layers {row['drop_layers']}): step time {saving:.1%} lower "
                f"than keep 1's (FLOPs {row['flops_saved']:.1%} lower), val loss "
                f"{row['val_vs_base']:+.2%} against keep 1's")
        if math.isclose(row["keep"], TARGET_KEEP) and middle_half:
            fast, close = saving >= TARGET_SAVING, row["val_vs_base"] <= TARGET_LOSS
            line += (f"; targets >= {TARGET_SAVING:.0%} lower step time: "
                     + ("met" if fast else f"missed by {TARGET_SAVING - saving:.1%}")
                     + f", val loss within {TARGET_LOSS:.0%}: "
                     + ("met" if close else f"missed by {row['val_vs_base'] - TARGET_LOSS:.2%}"))
        lines.append(line)
    return lines


@command(TokenDropConfig)
def main(argv=None) -> int:
    cfg = parse_experiment(argv, TokenDropConfig, defaults=DEFAULTS, fixed=FIXED,
                           description=__doc__.split("\n\n")[0])
    cfg.validate()
    plan = plan_rows(cfg)
    run_root = cfg.run.run_dir or os.path.join("runs", time.strftime("token-drop-%Y%m%d-%H%M%S"))

    rows, partial = [], None
    for row in plan:
        rows.append(run_row(cfg, row, run_root))
        if rows[-1]["interrupted"]:
            partial = rows[-1]["interrupted"]
            break
    timed = cfg.experiment.timed_rounds > 0 and not partial
    for row, ms in zip(rows, time_rows(cfg, plan) if timed else []):
        row["step_ms"] = ms
    for row in rows:                 # without the timing, the training's own step time
        row.setdefault("step_ms", row["train_step_ms"])
    compare_with_base(rows)
    L = stack_depth(cfg)
    middle = (max(1, L // 4), L - max(1, L // 4))
    layers = token_drop.layer_range(cfg.token_drop.layers, L)
    lines = verdicts(rows, middle_half=layers == middle)

    model = describe(cfg.model, cfg.gpt)
    meta = {"model": model, "data": cfg.data.path, "batching": cfg.data.batching,
            "seq_len": cfg.seq_len, "batch_size": cfg.data.batch_size, "steps": cfg.run.steps,
            "token_drop_layers": f"{layers[0]}:{layers[1]}",
            "step_time": (f"median of {cfg.experiment.timed_rounds} round-robin rounds x "
                          f"{cfg.experiment.timed_steps} steps on a fixed batch" if timed else
                          "median over the training's logged windows"),
            "final_eval_batches": cfg.run.final_eval_batches, "seed": cfg.run.seed,
            "base_val_loss": rows[0]["val_loss"], "targets": lines,
            **environment(), "run_dir": run_root, "interrupted": partial}
    print(f"\n{model} model, tokens dropped in layers {meta['token_drop_layers']}, "
          f"{cfg.run.steps} steps per row on the same batches (batch {cfg.batch_rows()} x "
          f"seq_len {cfg.seq_len}, {cfg.data.batching} batching), evaluated at the end on "
          f"{cfg.run.final_eval_batches or 'all'} validation batches with every token; step "
          f"time: {meta['step_time']}; {meta['device']}, jax {meta['jax_version']}"
          + (f" (PARTIAL: stopped by {partial}; later rows not run)" if partial else ""))
    print_table(rows, COLUMNS, lines)
    figure = os.path.join(run_root, "token_drop.png")
    plot_loss_curves(figure, {row["label"]: row["run_dir"] for row in rows},
                     title=f"token dropping, {model} model")
    print(f"\ntraining loss against real tokens: {figure}")
    write_json(cfg.run.json, rows, meta)
    return exit_code(partial)


if __name__ == "__main__":
    sys.exit(main())
