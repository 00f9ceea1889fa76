"""Token dropping: step time and validation loss of a model whose middle layers see only part of
each row's tokens, against the same model seeing all of them, at equal tokens.

    python -m experiments.token_drop                      # 5 rows, 8x128 model: ~7 CPU minutes
    python -m experiments.token_drop --keeps 0.5 --scores random --steps 100
    python -m experiments.token_drop --token-drop-layers 1:7 --json token_drop.json

Rows: ``keep 1`` (every layer sees every token), then for each keep ratio of ``--keeps`` and
each score of ``--scores`` a row with ``token_drop.keep`` at that ratio and
``token_drop.score`` that score (``jaxaccel.techniques.token_drop``: the layers
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

from experiments.common import (Experiment, Row, config_of, main_of, parse_list, random_batch,
                                relative, shared_run, stack_depth)
from jaxaccel.techniques import registry as techniques, token_drop
from jaxaccel.run.config import override, setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import place_batch
from jaxaccel.run.loop import sharded_steps
from jaxaccel.step.metrics import read_metrics
from jaxaccel.step.optim import build_optimizer
from jaxaccel.core.sharding import batch_sharding, build_mesh, parse_axis_rules
from jaxaccel.step.state import init_sharded_state

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
    timed_steps: int = setting(4, "steps per row per timing round, after one warm-up step",
                               at_least=1)


TokenDropConfig = config_of(TokenDropSettings)


def keep_ratio(value: float) -> bool:
    "in (0, 1) (the keep 1 row always runs)"
    return 0.0 < value < 1.0


def rows(cfg: TokenDropConfig) -> list[Row]:
    """``keep 1``, then a row per keep ratio and score."""
    keeps = parse_list(cfg.experiment.keeps, "experiment.keeps", kind=float, within=keep_ratio,
                       example="0.75,0.5")
    scores = parse_list(cfg.experiment.scores, "experiment.scores", valid=token_drop.SCORES)
    if cfg.run.log_every < 1:
        raise ConfigError("log_every must be >= 1: the training step time is the median over "
                          "the logged windows", field="run.log_every")

    check_kept(keeps, cfg.seq_len)

    def row(keep: float, score: str) -> Row:
        kept = token_drop.kept_tokens(cfg.seq_len, keep)
        return Row(f"keep {keep:g}" + (f" {score}" if keep < 1 else ""),
                   {"token_drop.keep": keep, "token_drop.score": score},
                   {"keep": keep, "score": score if keep < 1 else None,
                    "kept_tokens": f"{kept} of {cfg.seq_len}", "kept": kept})

    return [row(1.0, "random")] + [row(keep, score) for keep in dict.fromkeys(keeps)
                                   for score in dict.fromkeys(scores)]


def check_kept(keeps: list[float], seq_len: int):
    """Every keep ratio drops tokens at ``seq_len``, and no two keep as many: K rounds (to a
    multiple of ``token_drop.MULTIPLE`` in rows that long), so a ratio near 1 keeps the whole row
    (a second keep 1 row under another name) and nearby ratios keep the same K (one row twice)."""
    step = token_drop.MULTIPLE if seq_len >= token_drop.MULTIPLE else 1
    rounding = ("K is keep x seq_len rounded" + f" to a multiple of {step}" * (step > 1))
    kept = {}
    for keep in keeps:
        K = token_drop.kept_tokens(seq_len, keep)
        if K >= seq_len:
            most = (seq_len - 1) // step * step
            if most < 1:
                raise ConfigError(f"keep {keep:g} keeps all {seq_len} tokens of a row at "
                                  f"seq_len {seq_len} ({rounding}, at least {step}), as every "
                                  f"keep does; pass a longer --seq-len", field="data.seq_len")
            raise ConfigError(f"keep {keep:g} keeps all {seq_len} tokens of a row at seq_len "
                              f"{seq_len} ({rounding}): its row would be keep 1's; pass keeps "
                              f"that keep at most {most} of them, or a longer --seq-len",
                              field="experiment.keeps")
        if K in kept:
            raise ConfigError(f"keeps {kept[K]:g} and {keep:g} both keep {K} of {seq_len} "
                              f"tokens ({rounding}): their rows would be one; list one of them",
                              field="experiment.keeps")
        kept[K] = keep


def drop_layers(cfg) -> tuple[int, int]:
    """The layers that see only the kept tokens."""
    return token_drop.layer_range(cfg.token_drop.layers, stack_depth(cfg))


def median_step_ms(run_dir: str) -> float | None:
    """The median over the logged windows of their mean step time, in milliseconds."""
    records = sorted((r["step"], r["train_s"]) for r in
                     read_metrics(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "train")
    windows = [(s1 - s0) / (n1 - n0) for (n0, s0), (n1, s1) in zip([(0, 0.0)] + records, records)
               if n1 > n0]
    return 1e3 * statistics.median(windows) if windows else None


def result(summary, run) -> dict:
    start, end = drop_layers(run.cfg)
    return {"drop_layers": f"{start}:{end}" if run.row.fields["keep"] < 1 else None,
            "mean_step_ms": (1e3 * summary.train_s / summary.steps_this_run
                             if summary.steps_this_run else None),
            "train_step_ms": median_step_ms(run.run_dir), "mfu": summary.mfu,
            "compiles_after_warmup": summary.compiles_after_warmup,
            "interrupted": summary.interrupted}


def time_rows(cfg: TokenDropConfig, settings: list[dict]) -> list[float]:
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
        for row_settings in settings:
            row_cfg = override(cfg, row_settings)
            state, shardings = init_sharded_state(
                techniques.variables(row_cfg), optimizer, cfg.run.seed, row_cfg.make_loss_scale(),
                mesh, row_cfg.policy(), axis_rules=parse_axis_rules(row_cfg.mesh.axis_rules))
            step, _ = sharded_steps(row_cfg, techniques.abstract(row_cfg), optimizer, schedule,
                                    shardings, mesh)
            state = jax.block_until_ready(step(state, batch)[0])      # compiled, warmed up
            steps.append([step, state])
        seconds = [[] for _ in settings]
        for _ in range(exp.timed_rounds):
            for entry, times in zip(steps, seconds):
                for _ in range(exp.timed_steps):
                    start = time.perf_counter()
                    entry[1] = jax.block_until_ready(entry[0](entry[1], batch)[0])
                    times.append(time.perf_counter() - start)
    return [1e3 * statistics.median(times) for times in seconds]


def compare(cfg: TokenDropConfig, results: list[dict], partial) -> dict:
    """Every row's step timed round-robin (unless stopped; else the training's own), then its
    step time, FLOPs and validation loss against the keep 1 row's."""
    exp = cfg.experiment
    timed = exp.timed_rounds > 0 and not partial
    times = time_rows(cfg, [r.settings for r in rows(cfg)]) if timed else []
    for r, ms in zip(results, times or [r["train_step_ms"] for r in results]):
        r["step_ms"] = ms
    base = results[0]
    relative(results, base, speedup=("step_ms", "inverse"), val_vs_base=("val_loss", "change"),
             val_bpb_vs_base=("val_bpb", "difference"), flops_saved=("flops_per_token", "saving"))
    return {"base_val_loss": base["val_loss"],
            "step_time": (f"median of {exp.timed_rounds} round-robin rounds x "
                          f"{exp.timed_steps} steps on a fixed batch" if timed else
                          "median over the training's logged windows")}


def conclude(cfg: TokenDropConfig, results: list[dict]) -> list[str]:
    """The issue's targets against the measured rows, one line per token-dropping row."""
    L = stack_depth(cfg)
    middle_half = drop_layers(cfg) == (max(1, L // 4), L - max(1, L // 4))
    base, lines = results[0], []
    for r in results[1:]:
        if r["speedup"] is None or r["val_vs_base"] is None:
            continue
        saving = 1 - r["step_ms"] / base["step_ms"]
        line = (f"{r['label']} (layers {r['drop_layers']}): step time {saving:.1%} lower "
                f"than keep 1's (FLOPs {r['flops_saved']:.1%} lower), val loss "
                f"{r['val_vs_base']:+.2%} against keep 1's")
        if math.isclose(r["keep"], TARGET_KEEP) and middle_half:
            fast, close = saving >= TARGET_SAVING, r["val_vs_base"] <= TARGET_LOSS
            line += (f"; targets >= {TARGET_SAVING:.0%} lower step time: "
                     + ("met" if fast else f"missed by {TARGET_SAVING - saving:.1%}")
                     + f", val loss within {TARGET_LOSS:.0%}: "
                     + ("met" if close else f"missed by {r['val_vs_base'] - TARGET_LOSS:.2%}"))
        lines.append(line)
    return lines


def setup(cfg: TokenDropConfig) -> str:
    start, end = drop_layers(cfg)
    return (f"{shared_run(cfg)}, tokens dropped in layers {start}:{end}, evaluated at the end "
            f"on {cfg.run.final_eval_batches or 'all'} validation batches with every token")


EXPERIMENT = Experiment(
    name="token_drop", doc=__doc__, config=TokenDropConfig, rows=rows, setup=setup,
    result=result, compare=compare, conclude=conclude,
    # An 8-layer model (middle half 2:6) small enough for the CPU, its blocks scanned (one
    # block to compile per run of layers), sequences of 256 packed tokens, one evaluation at the
    # end on a fixed share of the validation split, metrics logged every 10 steps (the windows
    # the median step time is taken over), no checkpoints.
    defaults={"gpt.d_model": 128, "gpt.n_layers": 8, "gpt.n_heads": 4,
              "remat.scan_layers": True, "model.max_seq_len": 256,
              "data.batching": "pack", "data.seq_len": 256, "data.batch_size": 8,
              "run.steps": 150, "optimizer.warmup_steps": 15, "run.eval_every": 0,
              "run.final_eval_batches": 16, "run.log_every": 10, "run.checkpoint_every": 0},
    # Set for each row; every row trains run.steps (not a token count) on the same batches.
    fixed=("token_drop.keep", "token_drop.score", "run.train_tokens"),
    row_flags={"token_drop.keep": "experiment.keeps", "token_drop.score": "experiment.scores"},
    columns=[("label", "row", ""), ("kept_tokens", "K of T", ""), ("steps", "steps", "d"),
             ("step_ms", "step ms", ".1f"), ("speedup", "speed-up", ".3f"),
             ("train_step_ms", "train step ms", ".1f"),
             ("real_tokens_per_s", "train tokens/s", ",.0f"),
             ("flops_per_token", "FLOPs/token", ".4g"), ("flops_saved", "FLOPs saved", ".1%"),
             ("val_loss", "val loss", ".4f"), ("val_bpb", "val bpb", ".4f"),
             ("val_vs_base", "val loss vs keep 1", "+.2%"), ("train_s", "train s", ".1f")],
    meta=lambda cfg, rows: {"token_drop_layers": "{}:{}".format(*drop_layers(cfg)),
                            "final_eval_batches": cfg.run.final_eval_batches},
    notes=lambda cfg, rows, meta: [f"\nstep ms: {meta['step_time']}"] if rows else [],
    plot_title="token dropping")
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
