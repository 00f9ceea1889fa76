"""Precision policies side by side: the same model on the same tokens in fp32, TF32, bf16, fp16
with dynamic loss scaling and fp16 without it; then where fp16's gradients underflow.

    python -m experiments.precision                       # every row on the CPU, ~15 minutes
    python -m experiments.precision --precisions fp32,bf16 --json precision.json

Rows: ``fp32`` (float32 everywhere, matmuls at full float32 precision), ``tf32`` (the same with
XLA's default matmul precision, which on NVIDIA GPUs runs float32 matmuls in TF32; on a CPU it
is the fp32 computation), ``bf16``, ``fp16`` (dynamic loss scaling) and ``fp16-noscale``. Each
trains from the same initial parameters on the same batches. The table gives the mean step
time, real tokens/s, XLA's compiled memory for the step (temporaries: mostly activations), the
final validation loss, skipped steps and the speedup over fp32.

The underflow probe then takes the fp32 run's parameters at the start and at the end of
training and one training batch, and computes the float16 gradient without and with the loss
scale: the share of gradient entries that are non-zero in float32 but flush to zero in float16,
and the gradient's relative error against float32. ``--probe-batch-size`` sets the probe
batch's rows; bigger batches mean smaller per-token gradients and more underflow.
"""

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from experiments.common import (environment, parse_names, plot_loss_curves, run_config,
                                write_json)
from jaxaccel.config import TrainConfig, flag, parse_config
from jaxaccel.corpus import load_corpus
from jaxaccel.data import DataStream
from jaxaccel.errors import ConfigError
from jaxaccel.loop import train
from jaxaccel.model import init_params, make_apply
from jaxaccel.precision import DynamicLossScale, NoLossScale, all_finite, get_policy
from jaxaccel.report import format_table
from jaxaccel.train import make_grad_fn

# Row name -> (precision policy, loss scale, float32 matmul precision).
ROWS = {
    "fp32": ("fp32", "none", "highest"),
    "tf32": ("fp32", "none", "default"),
    "bf16": ("bf16", "none", "default"),
    "fp16": ("fp16", "dynamic", "default"),
    "fp16-noscale": ("fp16", "none", "default"),
}


@dataclasses.dataclass
class PrecisionConfig(TrainConfig):
    """The training flags (with this experiment's defaults) plus the rows to compare."""

    precisions: str = flag(",".join(ROWS), "comma-separated rows: " + ", ".join(ROWS))
    precision: str = flag("fp32", "not used here: each row sets its own (see --precisions)")
    loss_scale: str = flag("auto", "not used here: each row sets its own (see --precisions)")
    matmul_precision: str = flag("default", "not used here: each row sets its own (see "
                                            "--precisions)")
    probe_batch_size: int = flag(16, "rows of the underflow probe's batch")
    probe_accumulate: str = flag("1,64,1024", "comma-separated K: probe the batch as one of K "
                                              "microbatches of a global batch")
    batching: str = flag("pack", "batching strategy")
    seq_len: int | None = flag(256, "training sequence length")
    batch_size: int | None = flag(16, "rows per batch")
    train_tokens: int | None = flag(600_000, "real tokens every row trains on")
    warmup_steps: int = flag(20, "linear warmup steps")
    eval_every: int = flag(0, "evaluate every N steps (0: only at the end)")
    checkpoint_every: int = flag(0, "save a checkpoint every N steps (0: only at the end)")

    def probe_accumulations(self) -> list[int]:
        try:
            values = [int(v) for v in self.probe_accumulate.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise ConfigError(f"bad --probe-accumulate {self.probe_accumulate!r}; pass "
                              f"comma-separated integers >= 1")
        return values


COLUMNS = [
    ("precision", "precision", ""),
    ("step_s", "step s (mean)", ".4f"),
    ("real_tokens_per_s", "real tok/s", ",.0f"),
    ("temp_bytes", "temp bytes", ",d"),
    ("memory_bytes", "total bytes", ",d"),
    ("val_loss", "val loss", ".4f"),
    ("val_loss_vs_fp32", "vs fp32", "+.2%"),
    ("skipped_steps", "skipped", "d"),
    ("loss_scale", "final scale", "g"),
    ("speedup_vs_fp32", "speedup", ".2f"),
]

PROBE_COLUMNS = [
    ("params", "parameters", ""),
    ("accumulate", "K", "d"),
    ("median_abs_fp32", "median |g| fp32", ".1e"),
    ("case", "fp16 gradient", ""),
    ("scale", "scale", "g"),
    ("flushed_to_zero", "flushed to zero", ".2%"),
    ("relative_error", "rel. error vs fp32", ".3f"),
]


def run_row(cfg: PrecisionConfig, name: str, run_root: str) -> dict:
    precision, loss_scale, matmul = ROWS[name]
    summary = train(run_config(cfg, precision=precision, loss_scale=loss_scale,
                               matmul_precision=matmul, run_dir=os.path.join(run_root, name)))
    memory = summary["step_memory_bytes"]
    return {
        "precision": name,
        "policy": summary["precision"],
        "matmul_precision": matmul,
        "steps": summary["steps"],
        "step_s": summary["train_s"] / max(summary["steps_this_run"], 1),
        "real_tokens_per_s": summary["real_tokens_per_s"],
        "memory_bytes": memory["total"] if memory else None,
        "temp_bytes": memory["temp"] if memory else None,
        "val_loss": summary["val_loss"],
        "val_bpb": summary["val_bpb"],
        "skipped_steps": summary["skipped_steps"],
        "loss_scale": summary["loss_scale"],
        "compile_s": summary["compile_s"],
        "run_dir": summary["run_dir"],
    }


def largest_finite_scale(grad_fn, params, batch, key, normalizer, start: float) -> float:
    """The largest power of two at most ``start`` whose scaled float16 gradient is finite: the
    scale dynamic loss scaling settles near."""
    scale = start
    while scale > 1:
        _, grads = grad_fn(params, batch, key, normalizer, DynamicLossScale.create(scale))
        if bool(all_finite(grads)):
            break
        scale /= 2
    return scale


def underflow_probe(cfg: PrecisionConfig, trained_params) -> list[dict]:
    """float16 gradients without and with loss scaling against float32, on one batch.

    With ``--probe-accumulate K`` the batch's loss is divided by K times its token count, as one
    microbatch of a K-times larger global batch is under gradient accumulation or data
    parallelism: its gradient is K times smaller, nearer float16's underflow.
    """
    model_cfg = cfg.model_config()
    documents = load_corpus(cfg.data, cache_dir=cfg.cache_dir).train
    stream = DataStream(documents, strategy=cfg.batching, seq_len=cfg.seq_len, seed=cfg.seed,
                        batch_size=cfg.probe_batch_size, pad_multiple=cfg.pad_multiple,
                        num_buckets=cfg.buckets)
    batch = next(iter(stream))
    tokens = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
    key = jax.random.PRNGKey(0)
    apply_fn = make_apply(model_cfg)
    grad32 = jax.jit(make_grad_fn(apply_fn, policy=get_policy("fp32")))
    grad16 = jax.jit(make_grad_fn(apply_fn, policy=get_policy("fp16")))
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    rows = []
    for label, params in (("initial", init_params(model_cfg, jax.random.PRNGKey(cfg.seed))),
                          ("trained", trained_params)):
        if params is None:
            continue
        for accumulate in cfg.probe_accumulations():
            normalizer = tokens * accumulate
            with jax.default_matmul_precision("highest"):
                _, reference = grad32(params, batch, key, normalizer, NoLossScale.create())
            reference = flat(reference)
            nonzero = reference != 0
            scale = largest_finite_scale(grad16, params, batch, key, normalizer,
                                         2.0 ** (16 + int(np.log2(accumulate))))
            for case, loss_scale in (("no scaling", NoLossScale.create()),
                                     ("loss scaling", DynamicLossScale.create(scale))):
                _, grads = grad16(params, batch, key, normalizer, loss_scale)
                grads = flat(loss_scale.unscale(grads))
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


def main(argv=None) -> int:
    try:
        cfg = parse_config(argv, PrecisionConfig, description=__doc__.split("\n\n")[0])
        cfg.validate()
        names = parse_names(cfg.precisions, ROWS, "precisions")
        if cfg.probe_batch_size < 1:
            raise ConfigError("probe_batch_size must be >= 1; fix --probe-batch-size")
        cfg.probe_accumulations()
        run_root = cfg.run_dir or os.path.join("runs", time.strftime("precision-%Y%m%d-%H%M%S"))
        rows = [run_row(cfg, name, run_root) for name in names]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    fp32 = next((r for r in rows if r["precision"] == "fp32"), None)
    for row in rows:
        row["speedup_vs_fp32"] = (row["real_tokens_per_s"] / fp32["real_tokens_per_s"]
                                  if fp32 else None)
        row["val_loss_vs_fp32"] = (row["val_loss"] / fp32["val_loss"] - 1 if fp32 else None)
    trained = None
    if fp32 is not None:
        checkpoint = os.path.join(fp32["run_dir"], "checkpoints", str(fp32["steps"]), "state")
        state = ocp.StandardCheckpointer().restore(os.path.abspath(checkpoint))
        trained = state["params"]
    probe = underflow_probe(cfg, trained)

    meta = {"model": cfg.model, "data": cfg.data, "batching": cfg.batching, "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size, "train_tokens": cfg.train_tokens,
            "probe_batch_size": cfg.probe_batch_size, "underflow_probe": probe,
            **environment(), "run_dir": run_root}
    print(f"\n{cfg.model} model, {cfg.train_tokens:,} real tokens per row, seq_len {cfg.seq_len}, "
          f"{cfg.batching} batching, {meta['device']}, jax {meta['jax_version']}")
    print(format_table(rows, COLUMNS))
    print(f"\nUnderflow probe: one batch of {cfg.probe_batch_size} rows as one of K microbatches; "
          f"float16 gradients against float32 at the start and end of the fp32 run")
    print(format_table(probe, PROBE_COLUMNS))
    plot_loss_curves(os.path.join(run_root, "precision.png"),
                     {r["precision"]: r["run_dir"] for r in rows},
                     title=f"precision policies, {cfg.model} model, seq_len {cfg.seq_len}")
    write_json(cfg.json, rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
