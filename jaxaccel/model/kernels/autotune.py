"""The flash kernel's autotuner: block sizes, Triton warps and stages per pass and head dim, swept
on the present device and written into the tuned table ``tuning`` reads.

Candidates (``Grid``): the built-in stage, Triton's blocks x warps x stages and, on a Hopper GPU,
the Mosaic GPU kernels' blocks x ring depths. For each head dim the passes are tuned in turn, each
with the others held at their best so far (starting from ``tuning``'s built-in row): the forward
is timed alone, dK/dV and then dQ in a forward+backward. A candidate's score is its time summed
over the head dim's ``Shape``s. Every candidate's output (and, for the backward passes, its
gradients) is checked against XLA's attention in float32 on the same inputs; one that fails to
compile, runs out of memory or is off by more than the dtype's ``TOLERANCE`` is rejected with the
reason. The built-in stage is always a candidate, so the tuned row is at worst the built-in one
(within timing noise). Each finished pass is written into the table file at once under the
device's kind (a sweep cut short keeps what it measured), keeping the table's other devices.

    shapes = lambda D: [Shape(q, k, v, d_out, causal=True) for q, k, v, d_out in inputs(D)]
    result = sweep([64, 128], shapes, Grid(), timing=time_fn, path=tuning.table_path(),
                   meta={"date": ..., "jax_version": ..., "command": ...})

``python -m experiments.attention --tune`` runs it from the command line.
"""

import dataclasses
import itertools
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from jaxaccel.model.attention import xla_attention
from jaxaccel.core.hardware import out_of_memory
from jaxaccel.model.kernels import tuning
from jaxaccel.model.kernels.flash import flash_attention

# Largest relative error (Frobenius norm of the difference over the reference's) a candidate may
# have against XLA's float32 attention: a kernel with a wrong tile is off by order 1.
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}

# pass -> (timed with the backward, outputs checked: 0 out, 1 dq, 2 dk, 3 dv)
PASS_RUNS = {"forward": (False, (0,)), "dkv": (True, (0, 2, 3)), "dq": (True, (0, 1))}

# ``report.format_table`` columns of the sweep's rows (a row per candidate) and its summary
COLUMNS = [
    ("D", "D", "d"), ("pass", "pass", ""), ("backend", "backend", ""),
    ("block_q", "block_q", "d"), ("block_k", "block_k", "d"), ("num_warps", "warps", ""),
    ("num_stages", "stages", ""), ("ms", "ms (sum)", ".3f"), ("rel_err", "rel err", ".2e"),
    ("best", "best", ""), ("status", "status", ""),
]
SUMMARY_COLUMNS = [("D", "D", "d"), ("builtin_ms", "built-in fwd+bwd ms", ".3f"),
                   ("tuned_ms", "tuned fwd+bwd ms", ".3f"), ("speedup", "speedup", ".2f")]


@dataclasses.dataclass(frozen=True)
class Grid:
    """The values swept: block sizes (powers of two >= ``tuning.MIN_BLOCK``) for query and key
    tiles, Triton warps, Triton stages (and Mosaic GPU ring slots), backends."""

    blocks: tuple[int, ...] = (64, 128)
    warps: tuple[int, ...] = (4, 8)
    stages: tuple[int, ...] = (2, 3)
    backends: tuple[str, ...] = tuning.BACKENDS

    def candidates(self, name: str, base: tuning.Stage, *, interpret: bool,
                   kind: str) -> list[tuning.Stage]:
        """The built-in stage ``base`` first, then every combination of the swept values:
        Triton's blocks, warps and stages; on a Hopper GPU (or in the interpreter) also Mosaic
        GPU's blocks (64 or 128 own rows a warpgroup: queries, keys in dK/dV) and ring depths."""
        warps, stages = self.warps, self.stages
        if interpret:   # the interpreter ignores warps and stages: one candidate per block pair
            warps, stages = [base.num_warps], [base.num_stages]
        grid = [tuning.Stage(bq, bk, w, n) for bq, bk, w, n in
                itertools.product(self.blocks, self.blocks, warps, stages)] \
            if "triton" in self.backends else []
        if "mosaic_gpu" in self.backends and (interpret or tuning.is_hopper(kind)):
            own = [b for b in self.blocks if b in tuning.MOSAIC_ROWS]
            streamed = [b for b in self.blocks if b >= 64]
            pairs = itertools.product(streamed, own) if name == "dkv" else \
                itertools.product(own, streamed)
            grid += [tuning.Stage(bq, bk, None, n, backend="mosaic_gpu")
                     for (bq, bk), n in itertools.product(pairs, self.stages)]
        return [base] + [s for s in grid if s != base]


def rel_err(got, want) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


class Shape:
    """One timed shape: q [B, T, H, D], k and v [B, T, K, D], the output cotangent d_out like q;
    the jitted kernel calls for any params; XLA's float32 outputs and gradients to check them."""

    def __init__(self, q, k, v, d_out, *, causal: bool, interpret: bool):
        self.inputs, self.causal, self.interpret = (q, k, v, d_out), causal, interpret
        q, k, v, d_out = (x.astype(jnp.float32) for x in self.inputs)
        reference = jax.jit(lambda q, k, v, d_out: jax.vjp(
            lambda q, k, v: xla_attention(q, k, v, causal=causal), q, k, v))
        out, vjp = reference(q, k, v, d_out)
        self.want = (out, *vjp(d_out))

    def run(self, params: tuning.FlashParams, *, backward: bool, timing):
        """(seconds, outputs): the forward's output, or it and dq, dk, dv; ``timing(fn, args)``
        gives the seconds of ``fn(*args)``."""
        def attn(q, k, v):
            return flash_attention(q, k, v, causal=self.causal, params=params,
                                   interpret=self.interpret)

        q, k, v, d_out = self.inputs
        if not backward:
            fn, args = attn, (q, k, v)
        else:
            def fn(q, k, v, d_out):
                out, vjp = jax.vjp(attn, q, k, v)
                return (out, *vjp(d_out))
            args = (q, k, v, d_out)
        # Mosaic GPU's interpreter runs op by op: under a jit it can starve XLA's CPU threads
        # (tests/test_flash_attention.py).
        mosaic = any(s.backend == "mosaic_gpu" for s in params.stages())
        fn = fn if self.interpret and mosaic else jax.jit(fn)
        got = fn(*args)
        seconds = timing(fn, args)
        return seconds, (got,) if not backward else got


def score(shapes: list[Shape], params, *, backward: bool, checked: tuple[int, ...], timing):
    """(summed seconds, largest relative error over the checked outputs) of params."""
    total, worst = 0.0, 0.0
    for shape in shapes:
        seconds, got = shape.run(params, backward=backward, timing=timing)
        total += seconds
        worst = max([worst] + [rel_err(got[i], shape.want[i]) for i in checked])
    return total, worst


class NoCandidate(RuntimeError):
    """Every candidate of a pass failed: the kernel does not run on this device as tuned."""


@dataclasses.dataclass
class Result:
    """A sweep's rows (one per candidate, ``COLUMNS``), tuned params per head dim, and summary
    (per head dim: the built-in and the tuned row's forward+backward time, ``SUMMARY_COLUMNS``,
    and the tuned row's JSON)."""

    rows: list[dict]
    tuned: dict[int, tuning.FlashParams]
    summary: list[dict]


def describe(row: dict) -> str:
    """One candidate's row as a progress line."""
    return (f"  D={row['D']} {row['pass']} {row['backend']} blocks {row['block_q']}x"
            f"{row['block_k']}, {row['num_warps']} warps, {row['num_stages']} stages: "
            + (f"{row['ms']:.3f} ms, error {row['rel_err']:.1e}" if row["status"] == "ok"
               else row["status"]))


def tune_head_dim(D: int, shapes: list[Shape], grid: Grid, *, tolerance: float, interpret: bool,
                  kind: str, timing, stops: tuple = (), log=None, score=score,
                  on_pass=lambda name, best: None):
    """(rows, tuned params, built-in params) for one head dim (module docstring); ``on_pass(name,
    params)`` after each pass with the params tuned so far (the later passes still built in)."""
    builtin = tuning.default_params(D, interpret=interpret)
    best, rows = builtin, []
    for name in tuning.PASSES:
        backward, checked = PASS_RUNS[name]
        pass_rows = []
        for stage in grid.candidates(name, getattr(builtin, name), interpret=interpret,
                                     kind=kind):
            row = {"D": D, "pass": name, "backend": stage.backend, "block_q": stage.block_q,
                   "block_k": stage.block_k,
                   "num_warps": stage.num_warps, "num_stages": stage.num_stages, "ms": None,
                   "rel_err": None, "best": "", "status": "ok"}
            try:
                seconds, err = score(shapes, best.replace(**{name: stage}), backward=backward,
                                     checked=checked, timing=timing)
            except stops:
                raise               # e.g. a signal: it stops the sweep, it rejects no candidate
            except Exception as e:   # noqa: BLE001 - a candidate that fails is rejected
                row["status"] = ("rejected: out of memory" if out_of_memory(e)
                                 else f"rejected: {str(e).splitlines()[0][:120]}")
            else:
                row.update(ms=seconds * 1e3, rel_err=err)
                if err > tolerance:
                    row["status"] = f"rejected: relative error above {tolerance:g}"
            pass_rows.append((row, stage))
            if log:
                log(describe(row))
        ok = [(r, s) for r, s in pass_rows if r["status"] == "ok"]
        if not ok:
            raise NoCandidate(f"no candidate of the {name} pass at head dim {D} ran correctly, "
                               f"the built-in one included: {pass_rows[0][0]['status']}")
        winner, stage = min(ok, key=lambda rs: rs[0]["ms"])
        winner["best"] = "*"
        best = best.replace(**{name: stage})
        rows += [r for r, _ in pass_rows]
        on_pass(name, best)
    return rows, best, builtin


def sweep(head_dims: list[int], shapes: Callable[[int], list[Shape]], grid: Grid, *, timing,
          path: Path, meta: dict, interpret: bool | None = None, kind: str | None = None,
          tolerance: float | None = None, stops: tuple = (), log=None, score=score) -> Result:
    """Tunes each head dim on ``shapes(D)`` and writes the winners into the table at ``path``
    under ``kind`` (default: this device's) with ``meta`` (date, jax version, command, ...).

    ``timing(fn, args)``: the seconds of ``fn(*args)`` (e.g. a median of several runs);
    ``interpret``: the kernel runs in the Pallas interpreter (default: off the GPU), as the
    shapes must; ``tolerance``: the largest relative error a candidate may have (default: the
    inputs' dtype's ``TOLERANCE``); ``stops``: exception types that end the sweep (a signal's)
    instead of rejecting the candidate that raised them; ``log(line)``: each candidate's line
    as it is scored; ``score``: how a candidate is scored (``score``'s signature). NoCandidate
    when no candidate of a pass runs correctly: the table keeps the passes tuned before it."""
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    kind = kind or tuning.device_kind()
    result = Result([], {}, [])
    for D in head_dims:
        d_shapes = shapes(D)
        limit = tolerance if tolerance is not None else \
            TOLERANCE[jnp.dtype(d_shapes[0].inputs[0].dtype).name]

        def record(name, best, D=D):
            # each finished pass is kept at once: a sweep cut short keeps what it measured
            done = list(tuning.PASSES[:tuning.PASSES.index(name) + 1])
            tuning.write_entry(path, kind, {D: best}, meta, passes={D: done})

        rows, best, builtin = tune_head_dim(D, d_shapes, grid, tolerance=limit,
                                            interpret=interpret, kind=kind, timing=timing,
                                            stops=stops, log=log, score=score, on_pass=record)
        result.rows += rows
        result.tuned[D] = best
        before = score(d_shapes, builtin, backward=True, checked=(), timing=timing)[0]
        after = score(d_shapes, best, backward=True, checked=(), timing=timing)[0]
        result.summary.append({"D": D, "builtin_ms": before * 1e3, "tuned_ms": after * 1e3,
                               "speedup": before / after,
                               "tuned": tuning.params_to_json(best)})
    tuning.write_entry(path, kind, result.tuned, meta)
    return result
