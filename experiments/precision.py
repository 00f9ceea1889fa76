"""Precision policies side by side: the same model on the same tokens in fp32, TF32, bf16, fp16
with dynamic loss scaling and fp16 without it, and FP8 matmuls; then where fp16's gradients
underflow.

    python -m experiments.precision                       # every row on the CPU, ~15 minutes
    python -m experiments.precision --precisions fp32,bf16 --json precision.json

Rows: ``fp32`` (float32 everywhere, matmuls at full float32 precision), ``tf32`` (the same with
XLA's default matmul precision, which on NVIDIA GPUs runs float32 matmuls in TF32; on a CPU it is
the fp32 computation), ``bf16``, ``fp16`` (dynamic loss scaling), ``fp16-noscale`` and ``fp8``
(bf16 with the blocks' matmuls in float8, delayed scaling: ``jaxaccel.techniques.fp8``; emulated,
so not faster, off FP8 GPUs). Each trains from the same initial parameters on the same batches. The
table gives the mean step time, real tokens/s, XLA's compiled memory for the step (temporaries:
mostly activations), the final validation loss, skipped steps and the speedup over fp32; fp8 is
also compared with bf16 (the issue's target: >= 1.3x bf16's speed, validation loss within 1 %).

The underflow probe then takes the fp32 run's parameters at the start and at the end of
training and one training batch, and computes the float16 gradient without and with the loss
scale: the share of gradient entries that are non-zero in float32 but flush to zero in float16,
and the gradient's relative error against float32. ``--probe-batch-size`` sets the probe
batch's rows; bigger batches mean smaller per-token gradients and more underflow.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import (Experiment, Row, config_of, first, length, main_of, parse_list,
                                relative, technique)
from jaxaccel.model import nn
from jaxaccel.techniques import registry as techniques
from jaxaccel.run.config import override, setting
from jaxaccel.data.corpus import corpus_of
from jaxaccel.data.batching import DataStream
from jaxaccel.core.errors import ConfigError
from jaxaccel.step.grads import value_and_grad
from jaxaccel.run.loop import read_trained_run
from jaxaccel.model.contract import describe, make_apply
from jaxaccel.step.precision import DynamicLossScale, NoLossScale, cast, get_policy, loss_scaled
from jaxaccel.step.train import weighted_cross_entropy

# Row name -> (precision policy, loss scale, float32 matmul precision): its FIXED settings.
ROWS = {
    "fp32": ("fp32", "none", "highest"),
    "tf32": ("fp32", "none", "default"),
    "bf16": ("bf16", "none", "default"),
    "fp16": ("fp16", "dynamic", "default"),
    "fp16-noscale": ("fp16", "none", "default"),
    "fp8": ("fp8", "none", "default"),
}


@dataclasses.dataclass
class PrecisionSettings:
    precisions: str = setting(",".join(ROWS), "comma-separated rows: " + ", ".join(ROWS))
    probe_batch_size: int = setting(16, "rows of the underflow probe's batch")
    probe_accumulate: str = setting("1,64,1024", "comma-separated K: probe the batch as one of K "
                                                 "microbatches of a global batch")


PrecisionConfig = config_of(PrecisionSettings)
# This experiment's defaults (0 evaluates and checkpoints only at the end); each row sets its own
# precision policy, loss scaling and float32 matmul precision (see --precisions and ROWS).
DEFAULTS = {"data.batching": "pack", "data.seq_len": 256, "data.batch_size": 16,
            "run.train_tokens": 600_000, "optimizer.warmup_steps": 20, "run.eval_every": 0,
            "run.checkpoint_every": 0}
FIXED = ("precision.policy", "precision.loss_scale", "precision.matmul")


def rows(cfg: PrecisionConfig) -> list[Row]:
    """One row per name of --precisions; the probe's settings checked too."""
    exp = cfg.experiment
    names = parse_list(exp.precisions, "experiment.precisions", valid=ROWS)
    if exp.probe_batch_size < 1:
        raise ConfigError(f"probe_batch_size must be at least 1, got {exp.probe_batch_size}",
                          field="experiment.probe_batch_size")
    probe_accumulates(exp)
    return [Row(name, dict(zip(FIXED, ROWS[name])),
                {"precision": name, "matmul_precision": ROWS[name][2]}, directory=name)
            for name in names]


# The probe's K multiplies the batch's token count inside a jitted computation, where a Python
# integer is an int32: the largest K that computes.
MAX_PROBE_ACCUMULATE = 2**31 - 1


def probe_accumulates(exp: PrecisionSettings) -> list[int]:
    """The K of --probe-accumulate, each at most ``MAX_PROBE_ACCUMULATE``: checked with the rows,
    since the probe runs only after every row has trained."""
    values = parse_list(exp.probe_accumulate, "experiment.probe_accumulate", kind=int,
                        example="1,64,1024")
    if max(values) > MAX_PROBE_ACCUMULATE:
        raise ConfigError(f"probe_accumulate: K={max(values):,} is more than the probe can "
                          f"compute (it enters the jitted probe as a 32-bit integer); pass K of "
                          f"at most {MAX_PROBE_ACCUMULATE:,}", field="experiment.probe_accumulate")
    return values


def result(summary, run) -> dict:
    memory = summary.step_memory_bytes or {}
    return {"policy": summary.precision,
            "step_s": summary.train_s / max(summary.steps_this_run, 1),
            "memory_bytes": memory.get("total"), "temp_bytes": memory.get("temp"),
            "skipped_steps": summary.skipped_steps, "loss_scale": summary.loss_scale,
            "fp8": technique(summary, "fp8", "note"),
            "fp8_gemms": technique(summary, "fp8", "gemms")}


def compare(cfg: PrecisionConfig, rows: list[dict], partial) -> dict:
    """Every row against fp32, the fp8 row against bf16; then, unless a signal stopped the
    rows, the underflow probe (at the fp32 run's final checkpoint too, if it ran)."""
    fp32, bf16 = first(rows, precision="fp32"), first(rows, precision="bf16")
    relative(rows, fp32, speedup_vs_fp32=("real_tokens_per_s", "ratio"),
             val_loss_vs_fp32=("val_loss", "change"))
    for row in rows:
        relative([row], bf16 if row["precision"] == "fp8" else None,
                 speedup_vs_bf16=("real_tokens_per_s", "ratio"),
                 val_loss_vs_bf16=("val_loss", "change"))
    if partial:
        return {}
    trained = fp32 and nnx.state(read_trained_run(fp32["run_dir"])[1])
    return {"underflow_probe": underflow_probe(cfg, trained)}


def probe_grad_fn(model, policy_name: str):
    """The jitted ``grad_fn(params, batch, normalizer, loss_scale) -> (grads, grads_finite)``
    of the probe for ``model`` (abstract: its graph) and its state ``params``: the loss is
    ``sum(weights * token_loss) / normalizer`` (in float32, from the model run under the
    policy, without dropout) and the gradient, of the weights that train, is that of the loss
    times the scale, divided by the scale again (``jaxaccel.step.precision.loss_scaled``)."""
    graphdef, state = nnx.split(model)
    apply_fn = cast(make_apply(graphdef), get_policy(policy_name))
    trainable = nn.trainable(state)

    def grad_fn(params, batch, normalizer, loss_scale):
        def loss_fn(p, b, key):
            loss_sum, weight_sum = weighted_cross_entropy(apply_fn(p, b, None), b["targets"],
                                                          b["weights"])
            return loss_sum / normalizer, {"real_tokens": weight_sum}

        (_, aux), grads, _ = loss_scaled(value_and_grad(loss_fn, trainable=trainable))(
            params, batch, None, loss_scale)
        return grads, aux["grads_finite"]

    return jax.jit(grad_fn)


def largest_finite_scale(grad_fn, params, batch, normalizer, start: float) -> float:
    """The largest power of two at most ``start`` whose scaled float16 gradient is finite: the
    scale dynamic loss scaling settles near."""
    scale = start
    while scale > 1:
        _, finite = grad_fn(params, batch, normalizer, DynamicLossScale.create(scale))
        if bool(finite):
            break
        scale /= 2
    return scale


def underflow_probe(cfg: PrecisionConfig, trained_params) -> list[dict]:
    """float16 gradients without and with loss scaling against float32, on one batch, of the
    fp32 row's model at its initial variables and ``trained_params`` (its trained state, or
    None).

    With ``--probe-accumulate K`` the batch's loss is divided by K times its token count, as one
    microbatch of a K-times larger global batch is under gradient accumulation or data
    parallelism: its gradient is K times smaller, nearer float16's underflow.
    """
    data, exp = cfg.data, cfg.experiment
    fp32_cfg = override(cfg, {"precision.policy": "fp32"})
    model = techniques.abstract(fp32_cfg)
    documents = corpus_of(data).train
    stream = DataStream(documents, strategy=data.batching, seq_len=cfg.seq_len,
                        seed=cfg.run.seed, batch_size=exp.probe_batch_size,
                        pad_multiple=data.pad_multiple, num_buckets=data.buckets)
    batch = next(iter(stream))
    tokens = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
    grad32 = probe_grad_fn(model, "fp32")
    grad16 = probe_grad_fn(model, "fp16")
    initial = nnx.state(techniques.build(fp32_cfg, jax.random.PRNGKey(cfg.run.seed)))
    # on the host, as the initial variables are: the gradient functions compile once for both
    # (the trained run's arrays come back laid out on its mesh, another program's inputs)
    trained_params = None if trained_params is None else jax.device_get(trained_params)
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    rows = []
    for label, params in (("initial", initial), ("trained", trained_params)):
        if params is None:
            continue
        for accumulate in probe_accumulates(exp):
            normalizer = tokens * accumulate
            with jax.default_matmul_precision("highest"):
                reference, _ = grad32(params, batch, normalizer, NoLossScale.create())
            reference = flat(reference)
            nonzero = reference != 0
            scale = largest_finite_scale(grad16, params, batch, normalizer,
                                         2.0 ** (16 + int(np.log2(accumulate))))
            for case, loss_scale in (("no scaling", NoLossScale.create()),
                                     ("loss scaling", DynamicLossScale.create(scale))):
                grads, _ = grad16(params, batch, normalizer, loss_scale)
                grads = flat(grads)
                rows.append({
                    "params": label,
                    "accumulate": accumulate,
                    "case": case,
                    "scale": float(loss_scale.loss_scale),
                    "flushed_to_zero": float(np.mean(grads[nonzero] == 0)),
                    "relative_error": float(np.linalg.norm(grads - reference)
                                            / np.linalg.norm(reference)),
                    "median_abs_fp32": float(np.median(np.abs(reference[nonzero]))),
                })
    return rows


def tables(cfg: PrecisionConfig, rows: list[dict], meta: dict) -> list:
    """The rows, then the underflow probe's if it ran."""
    out = [(None, rows, COLUMNS)]
    if meta["underflow_probe"]:
        out.append((f"Underflow probe: one batch of {cfg.experiment.probe_batch_size} rows as "
                    f"one of K microbatches; float16 gradients against float32 at the start "
                    f"and end of the fp32 run", meta["underflow_probe"], PROBE_COLUMNS))
    return out


COLUMNS = [
    ("precision", "precision", ""), ("step_s", "step s (mean)", ".4f"),
    ("real_tokens_per_s", "real tok/s", ",.0f"), ("temp_bytes", "temp bytes", ",d"),
    ("memory_bytes", "total bytes", ",d"), ("val_loss", "val loss", ".4f"),
    ("val_loss_vs_fp32", "vs fp32", "+.2%"), ("skipped_steps", "skipped", "d"),
    ("loss_scale", "final scale", "g"), ("speedup_vs_fp32", "speedup", ".2f"),
    ("speedup_vs_bf16", "vs bf16", ".2f"), ("val_loss_vs_bf16", "val vs bf16", "+.2%"),
]
PROBE_COLUMNS = [
    ("params", "parameters", ""), ("accumulate", "K", "d"),
    ("median_abs_fp32", "median |g| fp32", ".1e"), ("case", "fp16 gradient", ""),
    ("scale", "scale", "g"), ("flushed_to_zero", "flushed to zero", ".2%"),
    ("relative_error", "rel. error vs fp32", ".3f"),
]

EXPERIMENT = Experiment(
    name="precision", doc=__doc__, config=PrecisionConfig, rows=rows, columns=COLUMNS,
    defaults=DEFAULTS, fixed=FIXED, row_flags=dict.fromkeys(FIXED, "experiment.precisions"),
    result=result, compare=compare, tables=tables,
    setup=lambda cfg: (f"{describe(cfg.model, cfg.gpt)} model, {length(cfg)} per row, seq_len "
                       f"{cfg.seq_len}, {cfg.data.batching} batching"),
    meta=lambda cfg, rows: {"probe_batch_size": cfg.experiment.probe_batch_size,
                            "underflow_probe": []},
    notes=lambda cfg, rows, meta: (["\nno underflow probe: a signal stopped the rows"]
                                   if meta["interrupted"] else []),
    plot_title="precision policies")
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
