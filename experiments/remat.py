"""Remat policies side by side: compiled memory, FLOPs, compile and step time, and the largest
batch each policy fits in a memory budget, with the blocks unrolled and scanned.

    python -m experiments.remat                # 12 layers, seq 256, every row: ~5 min on 2 CPU cores
    python -m experiments.remat --policies none,attention,full --no-scan-rows
    python -m experiments.remat --memory-budget 3000000000 --json remat.json

Every row compiles the same AdamW train step (the tiny preset's width, ``--n-layers`` 12) with
one ``--remat`` policy, ahead of time, and reads XLA's compiled memory analysis (temporaries:
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
import numpy as np

from experiments.common import environment, parse_names, write_json
from jaxaccel import hardware
from jaxaccel.compiled import abstract, flops, memory_bytes
from jaxaccel.config import TrainConfig, flag, parse_config
from jaxaccel.errors import ConfigError
from jaxaccel.loop import build_optimizer
from jaxaccel.model import init_params, make_apply
from jaxaccel.planner import choose_policy, compile_step, largest_batch
from jaxaccel.remat import REMAT_POLICIES
from jaxaccel.report import format_table
from jaxaccel.train import init_state, make_train_step


@dataclasses.dataclass
class RematConfig(TrainConfig):
    """The model and optimizer flags (with this experiment's defaults) plus the rows."""

    policies: str = flag(",".join(REMAT_POLICIES), "comma-separated remat policies")
    scan_rows: bool = flag(True, "also measure every policy with the blocks scanned")
    remat: str = flag("none", "not used here: each row sets its own (see --policies)")
    scan_layers: bool = flag(False, "not used here: see --scan-rows")
    n_layers: int | None = flag(12, "number of transformer blocks")
    seq_len: int | None = flag(256, "sequence length")
    batch_size: int | None = flag(4, "rows per batch for the timings and the planner's choice")
    timed_steps: int = flag(3, "timed steps per row (median), after one warm-up step")
    memory_budget: int | None = flag(None, "device bytes for the largest-batch column (default: "
                                           "the first row's total bytes at --batch-size)")
    max_batch_limit: int = flag(1024, "largest batch the search considers")


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


def random_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int) -> dict:
    """One packed-style batch of random tokens: every position real, one document per row."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, (batch_size, seq_len + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((batch_size, seq_len), np.float32),
            "segment_ids": np.ones((batch_size, seq_len), np.int32),
            "positions": np.tile(np.arange(seq_len, dtype=np.int32), (batch_size, 1))}


def measure(cfg: RematConfig, policy: str, scan: bool, optimizer, batch):
    """One row: the step compiled at --batch-size, its figures and timings; and ``total_at``,
    its compiled total bytes at any batch size (compiling on first sight)."""
    model_cfg = dataclasses.replace(cfg.model_config(), remat=policy, scan_layers=scan)
    step = make_train_step(make_apply(model_cfg), optimizer, dropout=model_cfg.dropout > 0)
    state = init_state(init_params(model_cfg, jax.random.PRNGKey(cfg.seed)), optimizer, cfg.seed)
    abstract_state = abstract(state)
    start = time.perf_counter()
    executable = compile_step(step, abstract_state, cfg.batch_size, cfg.seq_len)
    compile_s = time.perf_counter() - start
    memory = memory_bytes(executable)
    seconds, losses = [], []
    for _ in range(1 + cfg.timed_steps):
        start = time.perf_counter()
        state, metrics = executable(state, batch)
        jax.block_until_ready((state, metrics))
        seconds.append(time.perf_counter() - start)
        losses.append(metrics["loss"])
    totals = {cfg.batch_size: memory.get("total")}

    def total_at(batch_size: int) -> int:
        if batch_size not in totals:
            totals[batch_size] = memory_bytes(
                compile_step(step, abstract_state, batch_size, cfg.seq_len))["total"]
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


def main(argv=None) -> int:
    try:
        cfg = parse_config(argv, RematConfig, description=__doc__.split("\n\n")[0])
        model_cfg = cfg.validate()
        policies = parse_names(cfg.policies, REMAT_POLICIES, "policies")
        if cfg.timed_steps < 1 or cfg.max_batch_limit < 1:
            raise ConfigError("--timed-steps and --max-batch-limit must be at least 1; fix them")
        optimizer, _, _ = build_optimizer(cfg, cfg.seq_len, cfg.steps)
        batch = random_batch(cfg.batch_size, cfg.seq_len, model_cfg.vocab_size, cfg.seed)
        measured = [measure(cfg, policy, scan, optimizer, batch)
                    for scan in ((False, True) if cfg.scan_rows else (False,))
                    for policy in policies]
        rows = [fields for fields, _ in measured]
        if rows[0]["total_bytes"] is None:
            raise ConfigError(f"the {jax.default_backend()} backend gives no compiled memory "
                              f"analysis; this experiment needs it")
        budget = cfg.memory_budget or rows[0]["total_bytes"]
        for fields, total_at in measured:
            fields["max_batch"] = largest_batch(total_at, budget, limit=cfg.max_batch_limit,
                                                hint=cfg.batch_size)
            fields["fits"] = fields["total_bytes"] <= budget
            fields["probed"] = dict(sorted(fields["probed"].items()))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    compare_with_none(rows)
    choices = {}
    for layout in sorted({r["layout"] for r in rows}, reverse=True):
        candidates = [r for r in rows if r["layout"] == layout]
        for criterion, hide in (("step_s", None), ("flops", "step_s")):
            try:
                picked, _ = choose_policy([{**r, hide: None} if hide else r for r in candidates],
                                          budget, cfg.batch_size)
            except ConfigError:
                picked = None
            choices[f"{layout}, by {criterion}"] = picked
    compile_ratio = _compile_ratio(rows)
    meta = {"model": cfg.model, "d_model": model_cfg.d_model, "n_layers": model_cfg.n_layers,
            "n_heads": model_cfg.n_heads, "mlp": model_cfg.mlp, "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size, "optimizer": cfg.optimizer,
            "precision": cfg.precision, "timed_steps": cfg.timed_steps, "memory_budget": budget,
            "planner_choice": choices, "unrolled_over_scanned_compile_s": compile_ratio,
            "peak_memory_bytes": hardware.peak_memory_bytes(),
            "offload_note": _offload_note() if "offload" in policies else None,
            **environment()}
    print(f"\n{cfg.model} width, {model_cfg.n_layers} layers, seq_len {cfg.seq_len}, batch "
          f"{cfg.batch_size}, {cfg.optimizer}, {cfg.precision}; {meta['device']}, "
          f"jax {meta['jax_version']}")
    print(format_table(rows, COLUMNS))
    print(f"\nmax batch: the largest batch whose compiled step fits {budget:,} bytes. Scanned "
          f"rows' FLOPs count one layer (XLA counts a loop body once).")
    if compile_ratio:
        print(f"compile time, unrolled / scanned (none): {compile_ratio:.1f}x")
    print(f"planner's choice for batch {cfg.batch_size} within the budget: "
          + "; ".join(f"{k}: {v or 'nothing fits'}" for k, v in choices.items()))
    if meta["offload_note"]:
        print(meta["offload_note"])
    write_json(cfg.json, rows, meta)
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
