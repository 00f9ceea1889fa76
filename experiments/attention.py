"""Attention implementations side by side: forward and forward+backward TFLOP/s, and the longest
sequence each fits in memory; ``--tune`` tunes our kernel's parameters on this device (the
tuning sweep, below).

    python -m experiments.attention                   # a GPU: T 1k-16k, D 64 and 128, bf16
    python -m experiments.attention --json attention.json
    python -m experiments.attention --seq-lens 64,128 --head-dims 64 --heads 2 --impls xla,pallas
    python -m experiments.attention --tune     # a GPU: writes jaxaccel/model/kernels/tuned.json

The implementations and layouts: docs/TRAINING.md, "Flash attention". Off the GPU the Pallas
kernels run interpreted: the table checks that they work, it measures no speed. A packed row
counts its dense shape's FLOPs (``meta``'s "flops"), so its TFLOP/s compares speed at equal shape.
"""

import dataclasses
import functools
import importlib.util
import itertools
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import (Experiment, Interrupted, Row, RowRun, config_of, environment,
                                first, main_of, median_seconds, out_of_memory, parse_list,
                                relative, write_json)
from jaxaccel.core import hardware
from jaxaccel.model.attention import attention_mask, dot_product_attention
from jaxaccel.run.config import setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.model.kernels import autotune, flash, flash_attention, tuning
from jaxaccel.core.report import format_table

TOKAMAX_IMPLS = {"tokamax_mosaic": "mosaic", "tokamax_triton": "triton", "tokamax_cudnn": "cudnn"}
IMPLS = ("xla", "cudnn", "jax_reference", "pallas", *TOKAMAX_IMPLS)
RIVALS = (("cudnn", ("fwd_tflops", "fwdbwd_tflops")), ("jax_reference", ("fwdbwd_tflops",)),
          *((t, ("fwd_tflops", "fwdbwd_tflops")) for t in TOKAMAX_IMPLS))
LAYOUTS = ("dense", "packed")
CAUSAL = {"both": (True, False), "causal": (True,), "full": (False,)}
PACKED_SEARCH = 1000   # batches of the packed epoch looked at for one with enough documents
REFERENCE_BLOCK = 128   # the reference kernel's default forward block
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


@dataclasses.dataclass
class AttentionSettings:
    seq_lens: str = setting("1024,2048,4096,8192,16384", "comma-separated sequence lengths T")
    head_dims: str = setting("64,128", "comma-separated head dims D")
    impls: str = setting(",".join(IMPLS), "comma-separated implementations")
    causal: str = setting("both", "causal rows, full (non-causal) rows or both",
                          choices=("both", "causal", "full"))
    heads: int = setting(16, "query heads", at_least=1)
    kv_heads: int | None = setting(None, "key/value heads (default: --heads); JAX's reference "
                                         "kernel takes only equal counts")
    batch: int | None = setting(None, "rows per batch (default: --batch-tokens / T, at least 1)",
                                at_least=1)
    batch_tokens: int = setting(16384, "tokens per batch when --batch is not given")
    dtype: str = setting("bfloat16", "input dtype", choices=tuple(DTYPES))
    warmup: int = setting(2, "untimed runs per measurement")
    iters: int = setting(10, "timed runs per measurement (median)", at_least=1)
    max_t_limit: int | None = setting(None, "longest T the memory search tries; 0: no search "
                                            "(default: 131072 on a GPU, no search elsewhere, "
                                            "where running out of host memory is no clean error)")
    seed: int = setting(0, "seed of the random inputs and of the packed batch's epoch")
    layouts: str = setting("dense,packed", "comma-separated batch layouts: dense (no segments), "
                                           "packed (a real packed batch's segment ids)")
    data: str = setting("stdlib", "corpus of the packed batch (see experiments.train --data)")
    tokenizer: str = setting("bytes", "tokenizer of the packed batch's corpus")
    packed_docs: float = setting(3.0, "the packed batch: the first with at least this many "
                                      "documents per row on average", above=0)
    json: str | None = setting(None, "also write the rows as JSON to this path")
    tune: bool = setting(
        False, "sweep our kernel's block sizes, warps and stages per pass instead, check each "
        "against XLA, and write the tuned table jaxaccel.model.kernels.tuning reads for this "
        "device")
    tune_seq_lens: str = setting("4096", "--tune: the lengths a candidate is timed at (summed "
                                         "over these and --causal)")
    tune_blocks: str = setting("64,128", "--tune: block sizes tried for query and key tiles "
                                         "(the built-in row's are tried too)")
    tune_warps: str = setting("4,8", "--tune: Triton warps tried")
    tune_stages: str = setting("2,3", "--tune: Triton pipeline stages (and Mosaic GPU ring "
                                      "slots) tried")
    tune_backends: str = setting(
        "triton,mosaic_gpu", "--tune: backends tried (mosaic_gpu on Hopper GPUs only)")
    tuning_file: str | None = setting(None, "--tune: the table to write (default: "
                                            "$JAXACCEL_FLASH_TUNING or jaxaccel/model/kernels/"
                                            "tuned.json; required off the GPU)")


# This experiment trains nothing, so its config has only its own section.
AttentionConfig = config_of(AttentionSettings, base=None)
COLUMNS = [
    ("impl", "impl", ""), ("layout", "layout", ""), ("T", "T", "d"), ("D", "D", "d"),
    ("causal", "causal", ""), ("batch", "batch", "d"), ("fwd_ms", "fwd ms", ".3f"),
    ("fwdbwd_ms", "fwd+bwd ms", ".3f"), ("fwd_tflops", "fwd TFLOP/s", ".3g"),
    ("fwdbwd_tflops", "fwd+bwd TFLOP/s", ".3g"), ("docs_per_row", "docs/row", ".2f"),
    ("packed_vs_dense", "packed/dense", ".2f"), ("max_T", "max T", "d"), ("status", "status", "")]


def attention_fn(impl: str, causal: bool, interpret: bool, segment_ids=None):
    """``fn(q, k, v) -> out`` in [B, T, H, D] layout, given [B, T] ``segment_ids`` its own way."""
    if impl in ("xla", "cudnn"):
        return lambda q, k, v: dot_product_attention(q, k, v, segment_ids=segment_ids,
                                                     causal=causal, implementation=impl)
    if impl == "pallas":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                               interpret=interpret)
    if impl in TOKAMAX_IMPLS:
        import tokamax

        def peer(q, k, v):
            mask = None if segment_ids is None else attention_mask(
                q.shape[1], k.shape[1], causal=False, segment_ids_q=segment_ids)
            return tokamax.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                                 implementation=TOKAMAX_IMPLS[impl])
        return peer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as reference
    return lambda q, k, v: reference.mha(q, k, v, segment_ids, sm_scale=q.shape[-1] ** -0.5,
                                         causal=causal, interpret=interpret)


@functools.cache
def tokamax_missing() -> str | None:
    """Why tokamax cannot be used here (not installed, or its import fails), or None."""
    if importlib.util.find_spec("tokamax") is None:
        return "skipped: tokamax is not installed (pip install 'jaxaccel[peers]')"
    try:
        importlib.import_module("tokamax")
    except ImportError as e:
        return f"skipped: tokamax does not import ({e}); install its requirements"
    return None


def skip_reason(exp: AttentionSettings, impl: str, T: int) -> str | None:
    """Why an implementation cannot run this row on this backend, or None."""
    backend = jax.default_backend()
    if impl == "cudnn" and backend != "gpu":
        return f"skipped: cuDNN needs an NVIDIA GPU, the backend is {backend}"
    if impl in TOKAMAX_IMPLS and (missing := tokamax_missing()):
        return missing
    if impl in TOKAMAX_IMPLS and backend != "gpu":
        return (f"skipped: tokamax's {TOKAMAX_IMPLS[impl]} needs an NVIDIA GPU, the backend is "
                f"{backend}")
    if impl == "jax_reference" and (exp.kv_heads or exp.heads) != exp.heads:
        return "skipped: the reference kernel has no grouped-query attention"
    if impl == "jax_reference" and T % min(REFERENCE_BLOCK, T):
        return f"skipped: the reference kernel needs T a multiple of {REFERENCE_BLOCK}"
    return None


def make_inputs(exp: AttentionSettings, key, batch: int, T: int, D: int) -> list:
    """Random q [B, T, H, D], k and v [B, T, K, D], and an output cotangent like q, in --dtype."""
    q, kv = (batch, T, exp.heads, D), (batch, T, exp.kv_heads or exp.heads, D)
    return [jax.random.normal(part, shape, jnp.float32).astype(DTYPES[exp.dtype])
            for part, shape in zip(jax.random.split(key, 4), (q, kv, kv, q))]


def batch_rows(exp: AttentionSettings, T: int) -> int:
    """Rows per batch of length ``T``: ``--batch``, else ``--batch-tokens`` / T (at least 1)."""
    return exp.batch or max(1, exp.batch_tokens // T)


def fwdbwd_fn(attn):
    """The jitted forward+backward: a vjp with a given output cotangent."""
    return jax.jit(lambda q, k, v, d_out: jax.vjp(attn, q, k, v)[1](d_out))


def packed_segment_ids(exp: AttentionSettings, T: int, batch: int) -> tuple[np.ndarray, float]:
    """int32 [batch, T] segment ids of the first batch of a seeded ``pack`` epoch with
    ``--packed-docs`` documents per row on average, and that mean; else ConfigError."""
    from jaxaccel.data import corpus, batching as data

    documents = corpus.load_corpus(exp.data, tokenizer=exp.tokenizer).train
    most = 0.0
    for b in itertools.islice(data.batches(documents, strategy="pack", seq_len=T,
                                           batch_size=batch, seed=exp.seed), PACKED_SEARCH):
        segment_ids = b["segment_ids"]
        docs = float(segment_ids.max(axis=1).mean())
        if docs >= exp.packed_docs:
            return segment_ids, docs
        most = max(most, docs)
    raise ConfigError(f"no packed batch of {batch} x {T} tokens of {exp.data} (of the first "
                      f"{PACKED_SEARCH}) holds {exp.packed_docs} documents per row on average "
                      f"(at most {most:.2f}); pass a smaller --packed-docs or --layouts dense",
                      field="experiment.packed_docs")


def time_row(exp: AttentionSettings, impl: str, T: int, D: int, causal: bool, interpret: bool,
             key, packed: tuple[np.ndarray, float] | None = None) -> dict:
    """One row: median times and TFLOP/s, or why none; ``packed``: (segment ids, docs/row)."""
    batch = batch_rows(exp, T)
    row = {"impl": impl, "layout": "packed" if packed else "dense", "T": T, "D": D,
           "causal": causal, "batch": batch, "fwd_ms": None, "fwdbwd_ms": None,
           "fwd_tflops": None, "fwdbwd_tflops": None, "max_T": None, "max_T_stopped": None,
           "docs_per_row": packed[1] if packed else None, "status": skip_reason(exp, impl, T)}
    if row["status"]:
        return row
    q, k, v, d_out = make_inputs(exp, key, batch, T, D)
    attn = attention_fn(impl, causal, interpret, jnp.asarray(packed[0]) if packed else None)
    flops = 4.0 * batch * exp.heads * T * T * D / (2 if causal else 1)
    try:
        fwd_s = median_seconds(jax.jit(attn), (q, k, v), exp.warmup, exp.iters)
        fwdbwd_s = median_seconds(fwdbwd_fn(attn), (q, k, v, d_out), exp.warmup, exp.iters)
    except NotImplementedError as e:
        row["status"] = f"skipped: {str(e).splitlines()[0] if str(e) else 'not implemented'}"
    except Interrupted:
        raise                   # a signal stops the experiment; it is no row's failure
    except Exception as e:   # noqa: BLE001 - every failure becomes the row's status
        row["status"] = "OOM" if out_of_memory(e) else f"error: {str(e).splitlines()[0]}"
    else:
        row.update(fwd_ms=fwd_s * 1e3, fwdbwd_ms=fwdbwd_s * 1e3, fwd_tflops=flops / fwd_s / 1e12,
                   fwdbwd_tflops=3.5 * flops / fwdbwd_s / 1e12, status="ok")
    return row


def longest_fitting(exp: AttentionSettings, impl: str, D: int, causal: bool, start_T: int,
                    limit: int, interpret: bool, key) -> tuple[int | None, str]:
    """(longest T whose forward+backward ran at batch 1, why the doubling stopped: "OOM", "limit",
    "skipped: ..." or "error: ...")."""
    fits, T = None, start_T
    while T <= limit:
        if reason := skip_reason(exp, impl, T):
            return fits, reason
        q, k, v, d_out = make_inputs(exp, key, 1, T, D)
        try:
            jax.block_until_ready(fwdbwd_fn(attention_fn(impl, causal, interpret))(q, k, v, d_out))
        except Exception as e:   # noqa: BLE001 - the search reports why it stopped
            return fits, "OOM" if out_of_memory(e) else f"error: {str(e).splitlines()[0]}"
        finally:
            del q, k, v, d_out
        fits, T = T, 2 * T
    return fits, "limit"


def interpreted() -> bool:
    return jax.default_backend() != "gpu"


def max_t_limit(exp: AttentionSettings) -> int:
    return exp.max_t_limit if exp.max_t_limit is not None else 0 if interpreted() else 131072


def check(cfg: AttentionConfig) -> AttentionConfig:
    """The settings both modes read, before any work; a length whose forward+backward needs more
    than the device's memory (on the CPU, the host's available memory) is a ConfigError that
    suggests a bound which fits (``check_memory``): a CPU running out of memory aborts, no
    error."""
    exp = cfg.experiment
    parse_list(exp.impls, "experiment.impls", valid=IMPLS)
    parse_list(exp.seq_lens, "experiment.seq_lens", kind=int)
    parse_list(exp.layouts, "experiment.layouts", valid=LAYOUTS)   # a typo before the memory
    head_dims = parse_list(exp.head_dims, "experiment.head_dims", kind=int)
    kv_heads = exp.kv_heads or exp.heads
    if kv_heads < 1 or exp.heads % kv_heads:
        raise ConfigError(f"kv_heads={kv_heads} does not divide heads={exp.heads}; choose "
                          f"kv_heads dividing heads", field="experiment.kv_heads")
    if exp.tune and exp.tuning_file is None and interpreted():
        raise ConfigError("tuning off the GPU times the Pallas interpreter; pass --tuning-file "
                          "PATH to write that table elsewhere than the one GPUs read",
                          field="experiment.tuning_file")
    if exp.tune:
        tune_grid(exp)
    check_memory(exp, max(head_dims))       # last: it may compile
    return cfg


# The memory a row needs. XLA's attention keeps float32 T x T scores per row and head for the
# backward pass (the probabilities and their gradient at least: 8 bytes a score; 16 measured),
# so its need grows with T squared; the kernels' grows with T. The cheap bounds below decide
# most shapes; between them XLA's compiled memory analysis of the row's own forward+backward
# (compiled from abstract inputs: nothing is allocated) is the need.
DENSE_IMPLS = ("xla",)
SCORE_BYTES_AT_LEAST, SCORE_BYTES_AT_MOST = 8, 32
IO_FACTOR_AT_MOST = 8       # the kernels' float32 working copies of q, k, v, out and gradients
# The Pallas interpreter's bookkeeping per pair of query and key positions, whatever the heads
# (about a byte per hundred pairs measured; none on a GPU): at most a byte per 16.
KERNEL_PAIRS_PER_BYTE_AT_MOST = 16
OVERHEAD_AT_MOST = 64 << 20


@dataclasses.dataclass(frozen=True)
class Need:
    """What one forward+backward takes: its bytes, the implementation and whether the number is
    a lower bound (no compile was needed to know it does not fit)."""

    bytes: int
    impl: str
    at_least: bool = False


def counted_impls(exp: AttentionSettings, T: int) -> list[str]:
    """The implementations whose rows run at length ``T`` here (skipped ones allocate nothing);
    ``--tune`` runs our kernel and XLA's reference."""
    names = ("pallas", "xla") if exp.tune else parse_list(exp.impls, "experiment.impls",
                                                          valid=IMPLS)
    return [impl for impl in names if not skip_reason(exp, impl, T)]


def need_bounds(exp: AttentionSettings, impl: str, batch: int, T: int, D: int) -> tuple[int, int]:
    """(at least, at most) the bytes of one forward+backward of ``impl`` at ``batch`` x ``T``,
    without compiling: q, k, v, the cotangent, dq, dk and dv, and XLA's score matrices."""
    itemsize = jnp.dtype(DTYPES[exp.dtype]).itemsize
    io = batch * T * D * (3 * exp.heads + 4 * (exp.kv_heads or exp.heads)) * itemsize
    if impl in DENSE_IMPLS:
        scores = batch * exp.heads * T * T
        return (io + SCORE_BYTES_AT_LEAST * scores,
                IO_FACTOR_AT_MOST * io + SCORE_BYTES_AT_MOST * scores + OVERHEAD_AT_MOST)
    return io, (IO_FACTOR_AT_MOST * io + batch * T * T // KERNEL_PAIRS_PER_BYTE_AT_MOST
                + OVERHEAD_AT_MOST)


def compiled_need(exp: AttentionSettings, impl: str, batch: int, T: int, D: int) -> int | None:
    """The bytes XLA allocates for one forward+backward of ``impl`` (arguments, outputs and
    temporaries), from its compiled memory analysis; None where the backend gives none or the
    implementation does not compile the shape (its row reports why)."""
    from jaxaccel.step.compiled import memory_bytes

    q = jax.ShapeDtypeStruct((batch, T, exp.heads, D), DTYPES[exp.dtype])
    kv = jax.ShapeDtypeStruct((batch, T, exp.kv_heads or exp.heads, D), DTYPES[exp.dtype])
    causal = CAUSAL[exp.causal][0]
    try:
        executable = fwdbwd_fn(attention_fn(impl, causal, interpreted())).lower(
            q, kv, kv, q).compile()
    except Exception:   # noqa: BLE001 - a shape the implementation refuses is its row's status
        return None
    return memory_bytes(executable).get("total")


def need_of(exp: AttentionSettings, batch: int, T: int, D: int, have: int) -> Need:
    """The largest need among the implementations that run at ``T``: a lower bound where one
    already exceeds ``have``; else each one's upper bound where that fits, and its compiled
    need where it does not (its lower bound where nothing was compiled)."""
    bounds = {impl: need_bounds(exp, impl, batch, T, D) for impl in counted_impls(exp, T)}
    beyond = [Need(low, impl, at_least=True) for impl, (low, _) in bounds.items() if low > have]
    if beyond:
        return max(beyond, key=lambda n: n.bytes)
    needs = [Need(high if high <= have else compiled_need(exp, impl, batch, T, D) or low, impl)
             for impl, (low, high) in bounds.items()]
    return max(needs, key=lambda n: n.bytes, default=Need(0, "none"))


def largest_fitting(need_at, have: int, below: int) -> int:
    """The largest x < ``below`` (``below`` does not fit) with ``need_at(x) <= have``, to within
    1 %; 0 if none does. ``need_at`` grows with x, as x to a power between 1 and 2: each guess
    is on the line through log x and log need of the nearest x that fits and the nearest that
    does not (before both are known, a power that undershoots), kept a sixteenth of the bracket
    inside it so that every measurement narrows it."""
    lo, hi, known = 0, below, {}
    x = below - 1
    for _ in range(24):
        known[x] = need_at(x)
        if known[x] <= have:
            lo = x
        else:
            hi = x
        if hi - lo <= max(1, lo // 100):
            break
        if lo and hi in known:
            power = np.log(known[hi] / known[lo]) / np.log(hi / lo)
            guess = lo * (have / known[lo]) ** (1 / min(max(power, 1.0), 2.0))
            if guess - lo <= lo / 100:      # the crossing is within 1 % of lo
                break
        elif known[x] > have:           # shrinking: as if linear, which undershoots
            guess = x * have / known[x]
        else:                           # growing: as if quadratic, which undershoots
            guess = x * (have / max(known[x], 1)) ** 0.5
        margin = max(1, (hi - lo) // 16)
        x = min(max(int(guess), lo + margin), hi - margin)
    return lo


def check_memory(exp: AttentionSettings, D: int):
    """Every timed length at its batch, and the longest length the memory search may try at
    batch 1, against the device's memory: beyond it, a ConfigError with the bound that fits."""
    have, owner = hardware.device_memory_bytes(), hardware.memory_owner()
    field = "experiment.tune_seq_lens" if exp.tune else "experiment.seq_lens"
    lengths = parse_list(getattr(exp, field.partition(".")[2]), field, kind=int)
    searched = [] if exp.tune or not max_t_limit(exp) else [max_t_limit(exp)]
    for T, batch, field in ([(T, batch_rows(exp, T), field) for T in lengths]
                            + [(T, 1, "experiment.max_t_limit") for T in searched]):
        need = need_of(exp, batch, T, D, have)
        if need.bytes <= have:
            continue
        fix, fix_field = memory_fix(exp, batch, T, D, have, field)
        raise ConfigError(
            f"T={T:,}: one forward+backward of {need.impl} attention ({batch:,} x {T:,} tokens, "
            f"{exp.heads} heads, D={D}, {exp.dtype}) takes {'at least ' * need.at_least}"
            f"{need.bytes:,} bytes, more than {owner} ({have:,}); {fix}", field=fix_field)


def memory_fix(exp: AttentionSettings, batch: int, T: int, D: int, have: int,
               field: str) -> tuple[str, str]:
    """The fix of a length that does not fit, and its field: a smaller batch at this length if
    one row fits, else the longest length that fits at batch 1 (measured, as the check does)."""
    if batch > 1:
        rows = largest_fitting(lambda b: need_of(exp, b, T, D, have).bytes, have, batch)
        if rows and exp.batch:
            return f"pass --batch of at most {rows:,}", "experiment.batch"
        if rows:
            return (f"pass --batch-tokens of at most {rows * T:,} ({rows:,} "
                    f"row{'s' * (rows > 1)} of {T:,})", "experiment.batch_tokens")
    longest = largest_fitting(lambda t: need_of(exp, 1, t, D, have).bytes, have, T)
    flag = "--" + field.partition(".")[2].replace("_", "-")
    if not longest:
        return ("not even one token fits; lower --heads or --head-dims", "experiment.heads")
    one_row = "" if field == "experiment.max_t_limit" or exp.batch == 1 else " with --batch 1"
    return f"pass {flag} of at most {longest:,}{one_row}", field


def rows(cfg: AttentionConfig) -> list[Row]:
    """A row per implementation, head dim and causality: its lengths, dense then packed."""
    exp = cfg.experiment
    parse_list(exp.layouts, "experiment.layouts", valid=LAYOUTS)
    return [Row(f"{impl} D={D} causal={causal}", fields={"impl": impl, "D": D, "causal": causal})
            for impl in parse_list(exp.impls, "experiment.impls", valid=IMPLS)
            for D in parse_list(exp.head_dims, "experiment.head_dims", kind=int)
            for causal in CAUSAL[exp.causal]]


def shared(cfg: AttentionConfig) -> dict:
    """The dense rows' lengths, and the packed batch's segment ids per length."""
    exp = cfg.experiment
    seq_lens = parse_list(exp.seq_lens, "experiment.seq_lens", kind=int)
    layouts = parse_list(exp.layouts, "experiment.layouts", valid=LAYOUTS)
    return {"dense": seq_lens if "dense" in layouts else [],
            "packed": {T: packed_segment_ids(exp, T, batch_rows(exp, T)) for T in seq_lens}
            if "packed" in layouts else {}}


def measure(run: RowRun) -> list[dict]:
    """The dense rows, the longest length that fits, then the packed rows, each printed as it
    is measured: a long sweep shows its figures as it goes, and a cut one keeps them."""
    exp, fields = run.cfg.experiment, run.row.fields
    impl, D, causal = fields["impl"], fields["D"], fields["causal"]
    interpret, key, limit = interpreted(), jax.random.PRNGKey(exp.seed), max_t_limit(exp)

    def timed(T: int, packed: tuple[np.ndarray, float] | None = None) -> dict:
        row = time_row(exp, impl, T, D, causal, interpret, key, packed)
        what = (f"fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwdbwd_ms']:.3f} ms "
                f"({row['fwdbwd_tflops']:.1f} TFLOP/s)" if row["status"] == "ok" else row["status"])
        print(f"  {impl} {row['layout']} T={T} D={D} causal={causal}: {what}", flush=True)
        return row

    dense = [timed(T) for T in run.shared["dense"]]
    ok = [r["T"] for r in dense if r["status"] == "ok"]
    if limit and ok:
        max_T, stopped = longest_fitting(exp, impl, D, causal, max(ok), limit, interpret, key)
        for r in dense:
            r.update(max_T=max_T, max_T_stopped=stopped)
    return dense + [timed(T, segments) for T, segments in run.shared["packed"].items()]


def compare(cfg: AttentionConfig, rows: list[dict], partial) -> dict:
    """Our rows' throughput over the others' at the same layout, packed rows' dense time over
    theirs; where each memory search stopped, for the meta."""
    for row in rows:
        shape = {"T": row["T"], "D": row["D"], "causal": row["causal"]}
        if row["layout"] == "packed":
            relative([row], first(rows, impl=row["impl"], layout="dense", **shape),
                     packed_vs_dense=("fwdbwd_ms", "inverse"))
        for other, keys in RIVALS if row["impl"] == "pallas" else ():
            relative([row], first(rows, impl=other, layout=row["layout"], **shape),
                     **{f"{key}_vs_{other}": (key, "ratio") for key in keys})
    return {"max_t_search": {r["label"]: {"max_T": r["max_T"], "stopped": r["max_T_stopped"]}
                             for r in rows if r["max_T_stopped"]}}


def meta(cfg: AttentionConfig, rows: list[dict]) -> dict:
    exp = cfg.experiment
    return {**{k: getattr(exp, k) for k in ("dtype", "heads", "batch", "batch_tokens", "warmup",
                                            "iters")},
            "kv_heads": exp.kv_heads or exp.heads, "interpret": interpreted(),
            "max_t_limit": max_t_limit(exp), "max_t_search": {},
            "layouts": parse_list(exp.layouts, "experiment.layouts", valid=LAYOUTS),
            "packed_batch": {"data": exp.data, "tokenizer": exp.tokenizer, "seed": exp.seed,
                             "min_docs_per_row": exp.packed_docs,
                             "docs_per_row": {r["T"]: r["docs_per_row"] for r in rows
                                              if r["layout"] == "packed"}},
            "flops": "forward 4*B*H*T*T*D (halved when causal); forward+backward 3.5x that; "
                     "packed rows count their dense shape's"}


def notes(cfg: AttentionConfig, rows: list[dict], meta: dict) -> list[str]:
    """Our kernel's throughput over the others' (on a GPU); where the memory searches stopped."""
    lines = []
    for r in rows if not meta["interpret"] else []:
        ratios = ", ".join(f"{k.replace('_tflops', '')} {r[k]:.2f}x" for k in r
                           if "_tflops_vs_" in k and r[k])
        if r["impl"] == "pallas" and ratios:
            lines.append(f"pallas {r['layout']} T={r['T']} D={r['D']} causal={r['causal']}: "
                         f"{ratios}")
    if meta["max_t_limit"]:
        lines.append(f"max T: the longest T whose forward+backward ran at batch 1, doubling up "
                     f"to {meta['max_t_limit']}; the search stopped at: "
                     + "; ".join(f"{k}: {v['stopped']}" for k, v in meta["max_t_search"].items()))
    return lines


EXPERIMENT = Experiment(
    name="attention", doc=__doc__, config=AttentionConfig, rows=rows, columns=COLUMNS,
    trains=False, prepare=check, shared=shared, measure=measure, compare=compare, meta=meta,
    notes=notes,
    setup=lambda cfg: (f"{cfg.experiment.dtype}, {cfg.experiment.heads} heads "
                       f"({cfg.experiment.kv_heads or cfg.experiment.heads} key/value)"
                       + ("; Pallas interpreted, not a speed" if interpreted() else "")),
    # a row or a memory search that ended in an error (not a skip or OOM): exit code 1
    failed=lambda rows: any(why.startswith("error") for r in rows
                            for why in (r["status"], r["max_T_stopped"] or "")),
    # --tune: the tuning sweep, a loop of its own (below)
    mode=lambda cfg: (lambda cfg: tune(cfg.experiment)) if cfg.experiment.tune else None)


def tune_grid(exp: AttentionSettings) -> autotune.Grid:
    """The ``--tune-*`` grid; ConfigError for a block that is no power of two >= the smallest."""
    blocks = parse_list(exp.tune_blocks, "experiment.tune_blocks", kind=int)
    backends = parse_list(exp.tune_backends, "experiment.tune_backends", valid=tuning.BACKENDS)
    bad = [b for b in blocks if b < tuning.MIN_BLOCK or b & (b - 1)]
    if bad:
        raise ConfigError(f"tune_blocks {bad} are not powers of two >= {tuning.MIN_BLOCK}; pass "
                          f"e.g. 32,64,128", field="experiment.tune_blocks")
    warps = parse_list(exp.tune_warps, "experiment.tune_warps", kind=int)
    stages = parse_list(exp.tune_stages, "experiment.tune_stages", kind=int)
    return autotune.Grid(tuple(blocks), tuple(warps), tuple(stages), tuple(backends))


def tune(exp: AttentionSettings) -> int:
    """``--tune``: the sweep, the table entry, the printed tables; the experiment's exit code."""
    head_dims = parse_list(exp.head_dims, "experiment.head_dims", kind=int)
    causal_modes, interpret = CAUSAL[exp.causal], interpreted()
    seq_lens = parse_list(exp.tune_seq_lens, "experiment.tune_seq_lens", kind=int)
    path = tuning.table_path() if exp.tuning_file is None else Path(exp.tuning_file)
    tuning.read_table(path)   # a table that is there must be one, before any work
    for D in head_dims:
        if D > flash.MAX_HEAD_DIM:
            raise ConfigError(f"head dim {D} is above {flash.MAX_HEAD_DIM}, the kernel's "
                              f"largest; pass head dims up to it", field="experiment.head_dims")
    grid = tune_grid(exp)   # checked before any work
    key, env = jax.random.PRNGKey(exp.seed), environment()
    meta = {**env, "command": "python -m experiments.attention " + " ".join(sys.argv[1:]),
            "dtype": exp.dtype, "heads": exp.heads, "kv_heads": exp.kv_heads or exp.heads,
            "batch_tokens": exp.batch_tokens, "batch": exp.batch, "seq_lens": seq_lens,
            "causal": list(causal_modes), "interpret": interpret,
            "score": "median seconds summed over the shapes; forward alone for the forward "
                     "pass, forward+backward for dkv and dq"}

    def shapes(D: int) -> list[autotune.Shape]:
        return [autotune.Shape(*make_inputs(exp, key, batch_rows(exp, T), T, D), causal=causal,
                               interpret=interpret)
                for T in seq_lens for causal in causal_modes]

    try:
        result = autotune.sweep(
            head_dims, shapes, grid, path=path, meta=meta, interpret=interpret,
            timing=lambda fn, args: median_seconds(fn, args, exp.warmup, exp.iters),
            stops=(Interrupted,), log=lambda line: print(line, flush=True),
            score=autotune.score)    # looked up here, at each run: a test wraps it
    except autotune.NoCandidate as e:
        print(f"error: {e}; the table keeps only the passes tuned before it", file=sys.stderr)
        return 1
    print(f"\ntuning {env['device']}, jax {env['jax_version']}, {exp.dtype}, T "
          f"{', '.join(map(str, seq_lens))}{'; interpreted, not a speed' if interpret else ''}")
    print(format_table(result.rows, autotune.COLUMNS))
    print(format_table(result.summary, autotune.SUMMARY_COLUMNS))
    print(f"wrote the tuned rows of {env['device']} to {path}")
    write_json(exp.json, result.rows, {**meta, "summary": result.summary, "tuning_file": str(path)})
    return 0


main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
