"""Remat policies side by side: compiled memory, FLOPs, compile and step time, and the largest
batch each policy fits in a memory budget, with the blocks unrolled and scanned.

    python -m experiments.remat                # 12 layers, seq 256, every row: ~5 min on 2 CPU cores
    python -m experiments.remat --policies none,attention,full --no-scan-rows
    python -m experiments.remat --memory-budget 3000000000 --json remat.json

Every row compiles the run's train step (the tiny preset's width, ``--n-layers`` 12, or the
model ``--model`` names, the optimizer and ``--precision`` as given,
``jaxaccel.loop.train_step_of``) with one remat policy, ahead of time, and reads XLA's compiled memory analysis (temporaries:
mostly the activations kept for the backward pass; total: arguments + outputs not aliased to
the donated state + temporaries) and ``cost_analysis()`` FLOPs (remat's recomputation shows
here). It then runs one warm-up step and ``--timed-steps`` timed ones on a fixed batch of random
tokens from the same initial parameters, and reports the median step time. Last, the planner
(``jaxaccel.planner``) finds for every row the largest batch whose compiled step fits
``--memory-budget`` (default: the first row's total bytes at ``--batch-size``, i.e. what no
remat needs) and chooses the fastest policy that fits the batch.

XLA counts a loop body once whatever its trip count, so a scanned row's FLOPs are those outside
the scan plus one layer's: compare them with the other scanned rows only. On the CPU pinned host
memory is the same RAM as the device's, so ``offload`` moves nothing and measures as
``attention`` plus copies; its saving shows on a GPU.
"""

import dataclasses
import statistics
import sys
import time

import jax
from flax import nnx

from experiments.common import (check_stop, command, environment, gpt_shape, parse_experiment,
                                parse_list, random_batch, stack_depth, write_json)
from jaxaccel import hardware, nn, techniques
from jaxaccel.compiled import abstract, flops, memory_bytes
from jaxaccel.config import TrainConfig, override, setting
from jaxaccel.errors import ConfigError
from jaxaccel.loop import train_step_of
from jaxaccel.model import describe
from jaxaccel.optim import build_optimizer
from jaxaccel.planner import choose_policy, compile_step, largest_batch
from jaxaccel.remat import REMAT_POLICIES
from jaxaccel.report import format_table
from jaxaccel.state import init_state


@dataclasses.dataclass
class RematSettings:
    policies: str = setting(",".join(REMAT_POLICIES), "comma-separated remat policies")
    scan_rows: bool = setting(True, "also measure every policy with the blocks scanned")
    timed_steps: int = setting(3, "timed steps per row (median), after one warm-up step",
                               at_least=1)
    memory_budget: int | None = setting(None, "device bytes for the largest-batch column "
                                              "(default: the first row's total bytes at "
                                              "--batch-size)", at_least=1,
                                              at_most=2**62)
    max_batch_limit: int = setting(1024, "largest batch the search considers", at_least=1)


@dataclasses.dataclass
class RematConfig(TrainConfig):
    """The training config (the model, optimizer and precision every row shares) and the rows."""

    experiment: RematSettings = dataclasses.field(default_factory=RematSettings)


# This experiment's defaults; each row sets remat.policy and remat.scan_layers itself, and the
# experiment's own memory budget (the largest-batch column) replaces the run's.
DEFAULTS = {"gpt.n_layers": 12, "data.seq_len": 256, "data.batch_size": 4}
FIXED = ("remat.policy", "remat.scan_layers", "run.memory_budget")
# Every row times a fixed batch of random tokens: no corpus, batching or loader is involved.
UNUSED = {f"data.{name}": "its rows time a fixed batch of random tokens"
          for name in ("path", "batching", "tokens_per_batch", "buckets", "pad_multiple",
                       "pack_window", "prefetch", "sampling", "sampling_power",
                       "sampling_floor", "cache_dir")}


COLUMNS = [
    ("layout", "layers", ""),
    ("policy", "remat", ""),
    ("temp_bytes", "temp bytes", ",d"),
    ("temp_vs_none", "temp vs none", ".0%"),
    ("total_bytes", "total bytes", ",d"),
    ("flops", "FLOPs/step", ".3g"),
    ("flops_vs_none", "FLOPs vs none", ".2f"),
    ("compile_s", "compile s", ".1f"),
    ("step_s", "step s (median)", ".3f"),
    ("speedup_vs_none", "speed vs none", ".2f"),
    ("max_batch", "max batch", "d"),
]


def measure(cfg: RematConfig, policy: str, scan: bool, optimizer, batch):
    """One row: the step compiled at --batch-size, its figures and timings; and ``total_at``,
    its compiled total bytes at any batch size (compiling on first sight)."""
    row_cfg = override(cfg, {"remat.policy": policy, "remat.scan_layers": scan})
    step = train_step_of(row_cfg, techniques.abstract(row_cfg), optimizer)
    params = nnx.state(techniques.build(row_cfg, jax.random.PRNGKey(cfg.run.seed)))
    state = init_state(params, optimizer, cfg.run.seed, cfg.make_loss_scale(), cfg.policy(),
                       nn.trainable(params))
    abstract_state = abstract(state)
    rows, seq_len = cfg.data.batch_size, cfg.seq_len
    start = time.perf_counter()
    executable = compile_step(step, abstract_state, rows, seq_len)
    compile_s = time.perf_counter() - start
    memory = memory_bytes(executable)
    seconds, losses = [], []
    for _ in range(1 + cfg.experiment.timed_steps):
        check_stop()
        start = time.perf_counter()
        state, metrics = executable(state, batch)
        jax.block_until_ready((state, metrics))
        seconds.append(time.perf_counter() - start)
        losses.append(metrics["loss"])
    totals = {rows: memory.get("total")}

    def total_at(batch_size: int) -> int:
        if batch_size not in totals:
            totals[batch_size] = memory_bytes(
                compile_step(step, abstract_state, batch_size, seq_len))["total"]
        return totals[batch_size]

    fields = {
        "policy": policy,
        "scan_layers": scan,
        "layout": "scanned" if scan else "unrolled",
        "temp_bytes": memory.get("temp"),
        "total_bytes": memory.get("total"),
        "host_bytes": memory.get("host_total"),
        "flops": flops(executable),
        "compile_s": compile_s,
        "step_s": statistics.median(seconds[1:]),
        "first_loss": float(losses[0]),
        "probed": totals,
    }
    return fields, total_at


def compare_with_none(rows: list[dict]):
    """Temporary bytes, FLOPs and speed of each row against the same layout's ``none`` row."""
    for row in rows:
        none = next((r for r in rows if r["policy"] == "none"
                     and r["scan_layers"] == row["scan_layers"]), None)
        row["temp_vs_none"] = row["temp_bytes"] / none["temp_bytes"] if none else None
        row["flops_vs_none"] = row["flops"] / none["flops"] if none and row["flops"] else None
        row["speedup_vs_none"] = none["step_s"] / row["step_s"] if none else None


@command(RematConfig)
def main(argv=None) -> int:
    cfg = parse_experiment(argv, RematConfig, defaults=DEFAULTS, fixed=FIXED, unused=UNUSED,
                           description=__doc__.split("\n\n")[0])
    cfg.validate()
    exp, batch_size = cfg.experiment, cfg.data.batch_size
    policies = parse_list(exp.policies, "experiment.policies", valid=REMAT_POLICIES)
    if batch_size is None:
        raise ConfigError("this experiment takes a batch size in rows", field="data.batch_size")
    optimizer, _, _ = build_optimizer(cfg.optimizer, batch_rows=batch_size,
                                      total_steps=cfg.run.steps)
    batch = random_batch(batch_size, cfg.seq_len, cfg.model.vocab_size, cfg.run.seed)
    with jax.default_matmul_precision(cfg.precision.matmul):    # as loop.train runs the step
        measured = [measure(cfg, policy, scan, optimizer, batch)
                    for scan in ((False, True) if exp.scan_rows else (False,))
                    for policy in policies]
    rows = [fields for fields, _ in measured]
    if rows[0]["total_bytes"] is None:
        raise ConfigError(f"the {jax.default_backend()} backend gives no compiled memory "
                          f"analysis; this experiment needs it")
    budget = exp.memory_budget or rows[0]["total_bytes"]
    for fields, total_at in measured:
        fields["max_batch"] = largest_batch(total_at, budget, limit=exp.max_batch_limit,
                                            hint=batch_size)
        fields["fits"] = fields["total_bytes"] <= budget
        fields["probed"] = dict(sorted(fields["probed"].items()))

    compare_with_none(rows)
    choices = {}
    for layout in sorted({r["layout"] for r in rows}, reverse=True):
        candidates = [r for r in rows if r["layout"] == layout]
        for criterion, hide in (("step_s", None), ("flops", "step_s")):
            try:
                picked, _ = choose_policy([{**r, hide: None} if hide else r for r in candidates],
                                          budget, batch_size)
            except ConfigError:
                picked = None
            choices[f"{layout}, by {criterion}"] = picked
    compile_ratio = _compile_ratio(rows)
    shape, n_layers = gpt_shape(cfg), stack_depth(cfg)
    meta = {"model": describe(cfg.model, cfg.gpt), "d_model": shape and shape.d_model,
            "n_layers": n_layers, "n_heads": shape and shape.n_heads, "mlp": shape and shape.mlp,
            "seq_len": cfg.seq_len, "batch_size": batch_size, "optimizer": cfg.optimizer.name,
            "precision": cfg.policy().name, "timed_steps": exp.timed_steps,
            "memory_budget": budget,
            "planner_choice": choices, "unrolled_over_scanned_compile_s": compile_ratio,
            "peak_memory_bytes": hardware.peak_memory_bytes(),
            "offload_note": _offload_note() if "offload" in policies else None,
            **environment()}
    width = f"{shape.d_model} wide" if shape else meta["model"]
    print(f"\n{width}, {n_layers} layers, seq_len {cfg.seq_len}, "
          f"batch {batch_size}, {meta['optimizer']}, {meta['precision']}; {meta['device']}, "
          f"jax {meta['jax_version']}")
    print(format_table(rows, COLUMNS))
    print(f"\nmax batch: the largest batch whose compiled step fits {budget:,} bytes. Scanned "
          f"rows' FLOPs count one layer (XLA counts a loop body once).")
    if compile_ratio:
        print(f"compile time, unrolled / scanned (none): {compile_ratio:.1f}x")
    print(f"planner's choice for batch {batch_size} within the budget: "
          + "; ".join(f"{k}: {v or 'nothing fits'}" for k, v in choices.items()))
    if meta["offload_note"]:
        print(meta["offload_note"])
    write_json(cfg.run.json, rows, meta)
    return 0


def _compile_ratio(rows: list[dict]) -> float | None:
    by_layout = {r["layout"]: r["compile_s"] for r in rows if r["policy"] == "none"}
    if len(by_layout) < 2:
        return None
    return by_layout["unrolled"] / by_layout["scanned"]


def _offload_note() -> str | None:
    if jax.default_backend() != "cpu":
        return None
    return ("offload on the CPU: pinned host memory is the device's RAM, so nothing moves; the "
            "policy runs and gives the same numbers, with attention's saving.")


if __name__ == "__main__":
    sys.exit(main())
