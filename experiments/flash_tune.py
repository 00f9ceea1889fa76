"""The tuning sweep of ``python -m experiments.attention --tune``: our flash kernel's block sizes,
Triton warps and stages, per pass and head dim, on the present device.

Candidates: the built-in stage, Triton's blocks x warps x stages and, on a Hopper GPU, the Mosaic
GPU kernels' blocks x ring depths (``--tune-backends``). For each head dim
the passes are tuned in turn, each with the others held at their best so far
(starting from the built-in row of ``jaxaccel.kernels.tuning``): the forward is timed alone, dK/dV
and then dQ in a forward+backward. A candidate's score is its median time summed over
``--tune-seq-lens`` and ``--causal``, at ``--batch-tokens`` per batch. Every candidate's output
(and, for the backward passes, its gradients) is checked against XLA's attention in float32 on the
same inputs; one that fails to compile, runs out of memory or is off by more than the dtype's
tolerance is rejected with the reason. The built-in stage is always a candidate, so the tuned row
is at worst the built-in one (within timing noise). The winners are written into the table file
under the device's kind with the date, jax version, command and shapes, keeping the table's other
devices; the printed summary times the built-in and the tuned row once more, side by side.
"""

import itertools
from pathlib import Path
import sys

import jax
import jax.numpy as jnp

from experiments.common import Interrupted, environment, median_seconds, parse_list, write_json
from jaxaccel.attention import xla_attention
from jaxaccel.errors import ConfigError
from jaxaccel.kernels import flash, flash_attention, tuning
from jaxaccel.report import format_table

# Largest relative error (Frobenius norm of the difference over the reference's) a candidate may
# have against XLA's float32 attention: a kernel with a wrong tile is off by order 1.
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}

COLUMNS = [
    ("D", "D", "d"),
    ("pass", "pass", ""),
    ("backend", "backend", ""),
    ("block_q", "block_q", "d"),
    ("block_k", "block_k", "d"),
    ("num_warps", "warps", ""),
    ("num_stages", "stages", ""),
    ("ms", "ms (sum)", ".3f"),
    ("rel_err", "rel err", ".2e"),
    ("best", "best", ""),
    ("status", "status", ""),
]


def candidates(exp, name: str, base: tuning.Stage, interpret: bool,
               kind: str) -> list[tuning.Stage]:
    """The built-in stage first, then every combination of the swept values: Triton's blocks,
    warps and stages; for the forward on a Hopper GPU (or in the interpreter) also Mosaic GPU's
    blocks (64 or 128 query rows a warpgroup) and ring depths, when ``--tune-backends`` has it."""
    blocks = parse_list(exp.tune_blocks, "experiment.tune_blocks", kind=int)
    backends = parse_list(exp.tune_backends, "experiment.tune_backends", valid=tuning.BACKENDS)
    bad = [b for b in blocks if b < tuning.MIN_BLOCK or b & (b - 1)]
    if bad:
        raise ConfigError(f"tune_blocks {bad} are not powers of two >= {tuning.MIN_BLOCK}; pass "
                          f"e.g. 32,64,128", field="experiment.tune_blocks")
    warps = parse_list(exp.tune_warps, "experiment.tune_warps", kind=int)
    stages = parse_list(exp.tune_stages, "experiment.tune_stages", kind=int)
    if interpret:   # the interpreter ignores warps and stages: one candidate per block pair
        warps, stages = [base.num_warps], [base.num_stages]
    ring = parse_list(exp.tune_stages, "experiment.tune_stages", kind=int)
    grid = [tuning.Stage(bq, bk, w, n) for bq, bk, w, n in
            itertools.product(blocks, blocks, warps, stages)] if "triton" in backends else []
    if "mosaic_gpu" in backends and (interpret or tuning.is_hopper(kind)):
        own = [b for b in blocks if b in tuning.MOSAIC_ROWS]
        streamed = [b for b in blocks if b >= 64]
        pairs = itertools.product(streamed, own) if name == "dkv" else \
            itertools.product(own, streamed)
        grid += [tuning.Stage(bq, bk, None, n, backend="mosaic_gpu")
                 for (bq, bk), n in itertools.product(pairs, ring)]
    return [base] + [s for s in grid if s != base]


def _rel_err(got, want) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


class Shape:
    """One timed shape: inputs, the jitted kernel calls for any params, the XLA reference."""

    def __init__(self, exp, T: int, D: int, causal: bool, interpret: bool, key):
        from experiments.attention import DTYPES, batch_rows, make_inputs

        self.T, self.causal, self.interpret = T, causal, interpret
        kv_heads = exp.kv_heads or exp.heads
        self.inputs = make_inputs(key, batch_rows(exp, T), T, exp.heads, kv_heads, D,
                                  DTYPES[exp.dtype])
        q, k, v, d_out = (x.astype(jnp.float32) for x in self.inputs)
        reference = jax.jit(lambda q, k, v, d_out: jax.vjp(
            lambda q, k, v: xla_attention(q, k, v, causal=causal), q, k, v))
        out, vjp = reference(q, k, v, d_out)
        self.want = (out, *vjp(d_out))

    def run(self, params: tuning.FlashParams, *, backward: bool, timing):
        """(seconds, outputs): the forward's output, or it and dq, dk, dv."""
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
        worst = max([worst] + [_rel_err(got[i], shape.want[i]) for i in checked])
    return total, worst


class NoCandidate(RuntimeError):
    """Every candidate of a pass failed: the kernel does not run on this device as tuned."""


# pass -> (timed with the backward, outputs checked: 0 out, 1 dq, 2 dk, 3 dv)
PASS_RUNS = {"forward": (False, (0,)), "dkv": (True, (0, 2, 3)), "dq": (True, (0, 1))}


def tune_head_dim(exp, D: int, shapes: list[Shape], interpret: bool, timing,
                  on_pass=lambda name, best: None):
    """(rows, tuned params, built-in params) for one head dim; ``on_pass(name, params)`` after
    each pass with the params tuned so far (the later passes still built in)."""
    from experiments.attention import is_out_of_memory

    builtin = tuning.default_params(D, interpret=interpret)
    best, rows = builtin, []
    for name in tuning.PASSES:
        backward, checked = PASS_RUNS[name]
        pass_rows = []
        for stage in candidates(exp, name, getattr(builtin, name), interpret,
                                tuning.device_kind()):
            row = {"D": D, "pass": name, "backend": stage.backend, "block_q": stage.block_q,
                   "block_k": stage.block_k,
                   "num_warps": stage.num_warps, "num_stages": stage.num_stages, "ms": None,
                   "rel_err": None, "best": "", "status": "ok"}
            try:
                seconds, err = score(shapes, best.replace(**{name: stage}), backward=backward,
                                     checked=checked, timing=timing)
            except Interrupted:
                raise               # a signal stops the sweep; it rejects no candidate
            except Exception as e:   # noqa: BLE001 - a candidate that fails is rejected
                row["status"] = ("rejected: out of memory" if is_out_of_memory(e)
                                 else f"rejected: {str(e).splitlines()[0][:120]}")
            else:
                row.update(ms=seconds * 1e3, rel_err=err)
                if err > TOLERANCE[exp.dtype]:
                    row["status"] = f"rejected: relative error above {TOLERANCE[exp.dtype]:g}"
            pass_rows.append((row, stage))
            print(f"  D={D} {name} {stage.backend} blocks {stage.block_q}x{stage.block_k}, "
                  f"{stage.num_warps} warps, {stage.num_stages} stages: "
                  + (f"{row['ms']:.3f} ms, error {row['rel_err']:.1e}" if row["status"] == "ok"
                     else row["status"]), flush=True)
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


def run(exp, head_dims: list[int], causal_modes: tuple[bool, ...], interpret: bool) -> int:
    """The sweep, the table entry, the printed tables; the experiment's exit code."""

    seq_lens = parse_list(exp.tune_seq_lens, "experiment.tune_seq_lens", kind=int)
    if exp.tuning_file is None and interpret:
        raise ConfigError("tuning off the GPU times the Pallas interpreter; pass --tuning-file "
                          "PATH to write that table elsewhere than the one GPUs read",
                          field="experiment.tuning_file")
    path = tuning.table_path() if exp.tuning_file is None else Path(exp.tuning_file)
    tuning.read_table(path)   # a table that is there must be one, before any work
    for D in head_dims:
        if D > flash.MAX_HEAD_DIM:
            raise ConfigError(f"head dim {D} is above {flash.MAX_HEAD_DIM}, the kernel's "
                              f"largest; pass head dims up to it", field="experiment.head_dims")
    candidates(exp, "forward", tuning.Stage(32, 32), interpret, "")   # checked before any work

    def timing(fn, args):
        return median_seconds(fn, args, exp.warmup, exp.iters)

    key = jax.random.PRNGKey(exp.seed)
    rows, tuned, summary = [], {}, []
    env = environment()
    meta = {**env, "command": "python -m experiments.attention " + " ".join(sys.argv[1:]),
            "dtype": exp.dtype, "heads": exp.heads, "kv_heads": exp.kv_heads or exp.heads,
            "batch_tokens": exp.batch_tokens, "batch": exp.batch, "seq_lens": seq_lens,
            "causal": list(causal_modes), "interpret": interpret,
            "score": "median seconds summed over the shapes; forward alone for the forward "
                     "pass, forward+backward for dkv and dq"}
    for D in head_dims:
        shapes = [Shape(exp, T, D, causal, interpret, key) for T in seq_lens
                  for causal in causal_modes]

        def record(name, best, D=D):
            # each finished pass is kept at once: a sweep cut short keeps what it measured
            done = list(tuning.PASSES[:tuning.PASSES.index(name) + 1])
            tuning.write_entry(path, env["device"], {D: best}, meta, passes={D: done})

        try:
            d_rows, best, builtin = tune_head_dim(exp, D, shapes, interpret, timing, record)
        except NoCandidate as e:
            print(f"error: {e}; the table keeps only the passes tuned before it",
                  file=sys.stderr)
            return 1
        rows += d_rows
        tuned[D] = best
        before = score(shapes, builtin, backward=True, checked=(), timing=timing)[0]
        after = score(shapes, best, backward=True, checked=(), timing=timing)[0]
        summary.append({"D": D, "builtin_ms": before * 1e3, "tuned_ms": after * 1e3,
                        "speedup": before / after, "tuned": tuning.params_to_json(best)})
    tuning.write_entry(path, env["device"], tuned, meta)
    print(f"\ntuning {env['device']}, jax {env['jax_version']}, {exp.dtype}, T "
          f"{', '.join(map(str, seq_lens))}" + ("; interpreted, not a speed" if interpret
                                                else ""))
    print(format_table(rows, COLUMNS))
    print(format_table(summary, [("D", "D", "d"), ("builtin_ms", "built-in fwd+bwd ms", ".3f"),
                                 ("tuned_ms", "tuned fwd+bwd ms", ".3f"),
                                 ("speedup", "speedup", ".2f")]))
    print(f"wrote the tuned rows of {env['device']} to {path}")
    write_json(exp.json, rows, {**meta, "summary": summary, "tuning_file": str(path)})
    return 0
