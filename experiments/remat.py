"""Remat policies side by side: compiled memory, FLOPs, compile and step time, and the largest
batch each policy fits in a memory budget, with the blocks unrolled and scanned.

    python -m experiments.remat                # 12 layers, seq 256, every row: ~5 min on 2 CPU cores
    python -m experiments.remat --policies none,attention,full --no-scan-rows
    python -m experiments.remat --memory-budget 3000000000 --json remat.json

Every row compiles the run's train step (the tiny preset's width, ``--n-layers`` 12, or the model
``--model`` names, the optimizer and ``--precision`` as given, ``jaxaccel.run.loop.train_step_of``)
with one remat policy, ahead of time, and reads XLA's compiled memory analysis (temporaries: mostly
the activations kept for the backward pass; total: arguments + outputs not aliased to the donated
state + temporaries) and ``cost_analysis()`` FLOPs (remat's recomputation shows here). It then runs
one warm-up step and ``--timed-steps`` timed ones on a fixed batch of random tokens from the same
initial parameters, and reports the median step time. Last, the planner
(``jaxaccel.techniques.planner``) finds for every row the largest batch whose compiled step fits
``--memory-budget`` (default: the first row's total bytes at ``--batch-size``, i.e. what no remat
needs) and chooses the fastest policy that fits the batch.

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

from experiments.common import (Experiment, Row, RowRun, check_stop, config_of, first,
                                gpt_shape, main_of, parse_list, random_batch, relative,
                                stack_depth)
from jaxaccel.core import hardware
from jaxaccel.model import nn
from jaxaccel.techniques import registry as techniques
from jaxaccel.step import trace
from jaxaccel.step.compiled import abstract, flops, memory_bytes
from jaxaccel.run.config import setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import abstract_batch, abstract_key
from jaxaccel.run.loop import train_step_of
from jaxaccel.model.contract import describe, make_apply
from jaxaccel.step.optim import build_optimizer
from jaxaccel.techniques.planner import choose_policy, compile_step, largest_batch
from jaxaccel.techniques.remat import REMAT_POLICIES, check_tags, tags as policy_tags
from jaxaccel.step.state import init_state


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


RematConfig = config_of(RematSettings)

# This experiment's defaults; each row sets remat.policy and remat.scan_layers itself, and the
# experiment's own memory budget (the largest-batch column) replaces the run's.
DEFAULTS = {"gpt.n_layers": 12, "data.seq_len": 256, "data.batch_size": 4}
FIXED = ("remat.policy", "remat.scan_layers", "run.memory_budget")
# Every row times a fixed batch of random tokens: no corpus, batching or loader is involved.
UNUSED = {f"data.{name}": "its rows time a fixed batch of random tokens"
          for name in ("path", "batching", "tokens_per_batch", "buckets", "pad_multiple",
                       "pack_window", "prefetch", "sampling", "sampling_power",
                       "sampling_floor", "cache_dir")}


def rows(cfg: RematConfig) -> list[Row]:
    """Every policy unrolled, then (``--scan-rows``) every policy scanned."""
    policies = parse_list(cfg.experiment.policies, "experiment.policies", valid=REMAT_POLICIES)
    if cfg.data.batch_size is None:
        raise ConfigError("this experiment takes a batch size in rows", field="data.batch_size")
    accumulate = cfg.optimizer.accumulate
    if cfg.experiment.max_batch_limit < accumulate:
        raise ConfigError(f"max_batch_limit={cfg.experiment.max_batch_limit} is below "
                          f"accumulate={accumulate}: the largest-batch search tries batches that "
                          f"split into {accumulate} microbatches; pass --max-batch-limit of at "
                          f"least {accumulate}", field="experiment.max_batch_limit")
    layouts = (False, True) if cfg.experiment.scan_rows else (False,)
    return [Row(f"{policy}, {layout}", {"remat.policy": policy, "remat.scan_layers": scan},
                {"policy": policy, "scan_layers": scan, "layout": layout})
            for scan, layout in zip(layouts, ("unrolled", "scanned")) for policy in policies]


def check(cfg: RematConfig, plan: list[Row]):
    """Before any row is measured: every policy that keeps tagged tensors finds them in the
    model's forward, traced once (``remat.check_tags``, as a run checks it); a model of one's own
    without them would measure such a policy as ``full``, under its name."""
    keeping = [row.fields["policy"] for row in plan if policy_tags(row.fields["policy"])]
    if not keeping:
        return
    graphdef, state = nnx.split(techniques.abstract(cfg))
    jaxpr = jax.make_jaxpr(make_apply(graphdef))(
        state, dict(abstract_batch((1, min(cfg.seq_len, 64)))), abstract_key())
    named = trace.tags(jaxpr)
    for policy in dict.fromkeys(keeping):
        try:
            check_tags(policy, named)
        except ConfigError:     # its fixes are a run's: name this experiment's
            found = f"it names {', '.join(sorted(named))}" if named else "it tags no tensor"
            raise ConfigError(
                f"remat {policy} keeps the tensors tagged {', '.join(policy_tags(policy))}, but "
                f"the model never tags them ({found}), so its row would measure full under the "
                f"name {policy}; tag them with jaxaccel.model.nn.tag, or leave {policy} out of "
                f"--policies", field="experiment.policies") from None


def shared(cfg: RematConfig):
    """The optimizer and the fixed batch of random tokens every row steps on."""
    optimizer, _, _ = build_optimizer(cfg.optimizer, batch_rows=cfg.data.batch_size,
                                      total_steps=cfg.run.steps)
    return optimizer, random_batch(cfg.data.batch_size, cfg.seq_len, cfg.model.vocab_size,
                                   cfg.run.seed)


def measure(run: RowRun) -> dict:
    """The row's step compiled at --batch-size, its figures and timings, and the largest batch
    whose compiled total fits the budget (compiling the step at each batch the search tries)."""
    cfg, exp, (optimizer, batch) = run.config(), run.cfg.experiment, run.shared
    with jax.default_matmul_precision(cfg.precision.matmul):    # as loop.train runs the step
        step = train_step_of(cfg, techniques.abstract(cfg), optimizer)
        params = nnx.state(techniques.build(cfg, jax.random.PRNGKey(cfg.run.seed)))
        state = init_state(params, optimizer, cfg.run.seed, cfg.make_loss_scale(),
                           cfg.policy(), nn.trainable(params))
        abstract_state, batch_size, seq_len = abstract(state), cfg.data.batch_size, cfg.seq_len
        start = time.perf_counter()
        executable = compile_step(step, abstract_state, batch_size, seq_len)
        compile_s = time.perf_counter() - start
        memory = memory_bytes(executable)
        if memory.get("total") is None:
            raise ConfigError(f"the {jax.default_backend()} backend gives no compiled memory "
                              f"analysis; this experiment needs it")
        seconds, losses = [], []
        for _ in range(1 + exp.timed_steps):
            check_stop()
            start = time.perf_counter()
            state, metrics = executable(state, batch)
            jax.block_until_ready((state, metrics))
            seconds.append(time.perf_counter() - start)
            losses.append(metrics["loss"])
        totals = {batch_size: memory["total"]}

        def total_at(rows: int) -> int:
            if rows not in totals:
                try:
                    totals[rows] = memory_bytes(compile_step(step, abstract_state, rows,
                                                             seq_len))["total"]
                except Exception as e:      # noqa: BLE001 - only running out of memory is ours
                    if not hardware.out_of_memory(e):
                        raise
                    first_line = (str(e).splitlines() or [type(e).__name__])[0][:160]
                    raise ConfigError(
                        f"the largest-batch search ran out of memory compiling the step at "
                        f"batch {rows:,} ({first_line}); it tries batches up to "
                        f"--max-batch-limit {exp.max_batch_limit:,}: lower it (or "
                        f"--memory-budget)", field="experiment.max_batch_limit") from None
            return totals[rows]

        budget = budget_of(exp, run.previous or [{"total_bytes": memory["total"]}])
        # a batch the step takes splits into --accumulate microbatches: only those are tried
        max_batch = largest_batch(total_at, budget, limit=exp.max_batch_limit, hint=batch_size,
                                  multiple=cfg.optimizer.accumulate)
    return {"temp_bytes": memory.get("temp"), "total_bytes": memory["total"],
            "host_bytes": memory.get("host_total"), "flops": flops(executable),
            "compile_s": compile_s, "step_s": statistics.median(seconds[1:]),
            "first_loss": float(losses[0]), "probed": dict(sorted(totals.items())),
            "max_batch": max_batch, "fits": memory["total"] <= budget}


def budget_of(exp: RematSettings, rows: list[dict]) -> int:
    """--memory-budget, else the first row's total bytes."""
    return exp.memory_budget or rows[0]["total_bytes"]


def compare(cfg: RematConfig, rows: list[dict], partial) -> dict:
    """Each row against the same layout's ``none`` row; the planner's choice per layout."""
    budget, choices = budget_of(cfg.experiment, rows), {}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        same = [r for r in rows if r["layout"] == layout]
        relative(same, first(same, policy="none"), temp_vs_none=("temp_bytes", "ratio"),
                 flops_vs_none=("flops", "ratio"), speedup_vs_none=("step_s", "inverse"))
        for criterion, hide in (("step_s", None), ("flops", "step_s")):
            try:
                choices[f"{layout}, by {criterion}"], _ = choose_policy(
                    [{**r, hide: None} if hide else r for r in same], budget,
                    cfg.data.batch_size)
            except ConfigError:
                choices[f"{layout}, by {criterion}"] = None
    none = {r["layout"]: r["compile_s"] for r in rows if r["policy"] == "none"}
    return {"memory_budget": budget, "planner_choice": choices,
            "unrolled_over_scanned_compile_s": none["unrolled"] / none["scanned"]
            if len(none) == 2 else None}


def setup(cfg: RematConfig) -> str:
    shape = gpt_shape(cfg)
    width = f"{shape.d_model} wide" if shape else describe(cfg.model, cfg.gpt)
    return (f"{width}, {stack_depth(cfg)} layers, seq_len {cfg.seq_len}, batch "
            f"{cfg.data.batch_size}, {cfg.optimizer.name}, {cfg.policy().name}")


def meta(cfg: RematConfig, rows: list[dict]) -> dict:
    shape = gpt_shape(cfg)
    offload = ("offload on the CPU: pinned host memory is the device's RAM, so nothing moves; "
               "the policy runs and gives the same numbers, with attention's saving."
               if "offload" in {r["policy"] for r in rows} and jax.default_backend() == "cpu"
               else None)
    return {"model": describe(cfg.model, cfg.gpt), "d_model": shape and shape.d_model,
            "n_layers": stack_depth(cfg), "n_heads": shape and shape.n_heads,
            "mlp": shape and shape.mlp, "optimizer": cfg.optimizer.name,
            "precision": cfg.policy().name, "timed_steps": cfg.experiment.timed_steps,
            "peak_memory_bytes": hardware.peak_memory_bytes(), "offload_note": offload}


def notes(cfg: RematConfig, rows: list[dict], meta: dict) -> list[str]:
    if not rows:
        return []
    ratio, offload = meta["unrolled_over_scanned_compile_s"], meta["offload_note"]
    accumulate = cfg.optimizer.accumulate
    return [f"\nmax batch: the largest batch whose compiled step fits {meta['memory_budget']:,} "
            f"bytes" + (f", among those that split into --accumulate {accumulate} microbatches"
                        if accumulate > 1 else "")
            + ". Scanned rows' FLOPs count one layer (XLA counts a loop body once).",
            *([f"compile time, unrolled / scanned (none): {ratio:.1f}x"] if ratio else []),
            f"planner's choice for batch {cfg.data.batch_size} within the budget: "
            + "; ".join(f"{k}: {v or 'nothing fits'}" for k, v in meta["planner_choice"].items()),
            *([offload] if offload else [])]


EXPERIMENT = Experiment(
    name="remat", doc=__doc__, config=RematConfig, rows=rows, setup=setup, trains=False,
    defaults=DEFAULTS, fixed=FIXED, unused=UNUSED, check=check, shared=shared, measure=measure,
    compare=compare, meta=meta, notes=notes,
    columns=[("layout", "layers", ""), ("policy", "remat", ""),
             ("temp_bytes", "temp bytes", ",d"), ("temp_vs_none", "temp vs none", ".0%"),
             ("total_bytes", "total bytes", ",d"), ("flops", "FLOPs/step", ".3g"),
             ("flops_vs_none", "FLOPs vs none", ".2f"), ("compile_s", "compile s", ".1f"),
             ("step_s", "step s (median)", ".3f"),
             ("speedup_vs_none", "speed vs none", ".2f"), ("max_batch", "max batch", "d")])
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
