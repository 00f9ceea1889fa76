"""Attention implementations side by side: forward and forward+backward TFLOP/s, and the longest
sequence each fits in memory.

    python -m experiments.attention                   # a GPU: T 1k-16k, D 64 and 128, bf16, 4 impls
    python -m experiments.attention --json attention.json
    python -m experiments.attention --seq-lens 64,128 --head-dims 64 --heads 2 --impls xla,pallas

Implementations: ``xla`` (jaxaccel's plain jnp attention), ``cudnn``
(``jax.nn.dot_product_attention(implementation="cudnn")``), ``jax_reference`` (the Pallas kernel
JAX ships, ``jax.experimental.pallas.ops.gpu.attention.mha``) and ``pallas`` (ours,
``jaxaccel.kernels.flash_attention``). Off the GPU the two Pallas kernels run in the Pallas
interpreter: the table then checks that the program works, it measures no kernel speed. An
implementation that cannot run a row (cuDNN off an NVIDIA GPU, the reference kernel with
grouped-query heads or a length not a multiple of its 128-row blocks) is reported as skipped
with the reason.

FLOPs: 4 B H T^2 D forward (the two matmuls), halved when causal; the backward counts 2.5 times
the forward, so forward+backward is 3.5 times. Times are medians of ``--iters`` runs after
``--warmup`` runs, each ended with ``block_until_ready``; the forward+backward run is one jitted
``jax.vjp`` with a fixed random cotangent. Each row's batch is ``--batch-tokens`` / T rows (at
least one) unless ``--batch`` is given. The longest length doubles T from the longest timed one
(batch 1) until the forward+backward runs out of device memory or passes ``--max-t-limit``.
"""

import dataclasses
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp

from experiments.common import check_stop, command, environment, parse_list, write_json
from jaxaccel.attention import dot_product_attention
from jaxaccel.config import parse, setting
from jaxaccel.errors import ConfigError
from jaxaccel.kernels import flash_attention
from jaxaccel.report import format_table

IMPLS = ("xla", "cudnn", "jax_reference", "pallas")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
REFERENCE_BLOCK = 128   # the reference kernel's default forward block


@dataclasses.dataclass
class AttentionSettings:
    seq_lens: str = setting("1024,2048,4096,8192,16384", "comma-separated sequence lengths T")
    head_dims: str = setting("64,128", "comma-separated head dims D")
    impls: str = setting(",".join(IMPLS), "comma-separated implementations")
    causal: str = setting("both", "causal rows, full (non-causal) rows or both",
                          choices=("both", "causal", "full"))
    heads: int = setting(16, "query heads")
    kv_heads: int | None = setting(None, "key/value heads (default: --heads); JAX's reference "
                                         "kernel takes only equal counts")
    batch: int | None = setting(None, "rows per batch (default: --batch-tokens / T, at least 1)")
    batch_tokens: int = setting(16384, "tokens per batch when --batch is not given")
    dtype: str = setting("bfloat16", "input dtype", choices=tuple(DTYPES))
    warmup: int = setting(2, "untimed runs per measurement")
    iters: int = setting(10, "timed runs per measurement (median)")
    max_t_limit: int | None = setting(None, "longest T the memory search tries; 0: no search "
                                            "(default: 131072 on a GPU, no search elsewhere, "
                                            "where running out of host memory is no clean error)")
    seed: int = setting(0, "seed of the random inputs")
    json: str | None = setting(None, "also write the rows as JSON to this path")


@dataclasses.dataclass
class AttentionConfig:
    """The rows to time and how: this experiment trains nothing, so it has only its own section."""

    experiment: AttentionSettings = dataclasses.field(default_factory=AttentionSettings)


COLUMNS = [
    ("impl", "impl", ""),
    ("T", "T", "d"),
    ("D", "D", "d"),
    ("causal", "causal", ""),
    ("batch", "batch", "d"),
    ("fwd_ms", "fwd ms", ".3f"),
    ("fwdbwd_ms", "fwd+bwd ms", ".3f"),
    ("fwd_tflops", "fwd TFLOP/s", ".3g"),
    ("fwdbwd_tflops", "fwd+bwd TFLOP/s", ".3g"),
    ("max_T", "max T", "d"),
    ("status", "status", ""),
]


def attention_fn(impl: str, causal: bool, interpret: bool):
    """``fn(q, k, v) -> out`` for one implementation, in [B, T, H, D] layout."""
    if impl in ("xla", "cudnn"):
        return lambda q, k, v: dot_product_attention(q, k, v, causal=causal, implementation=impl)
    if impl == "pallas":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, interpret=interpret)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as reference

    return lambda q, k, v: reference.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5,
                                         causal=causal, interpret=interpret)


def skip_reason(impl: str, T: int, heads: int, kv_heads: int) -> str | None:
    """Why an implementation cannot run this row on this backend, or None."""
    if impl == "cudnn" and jax.default_backend() != "gpu":
        return f"skipped: cuDNN needs an NVIDIA GPU, the backend is {jax.default_backend()}"
    if impl == "jax_reference" and kv_heads != heads:
        return "skipped: the reference kernel has no grouped-query attention"
    if impl == "jax_reference" and T % min(REFERENCE_BLOCK, T):
        return f"skipped: the reference kernel needs T a multiple of {REFERENCE_BLOCK}"
    return None


def make_inputs(key, batch: int, T: int, heads: int, kv_heads: int, D: int, dtype):
    keys = jax.random.split(key, 4)
    shapes = [(batch, T, heads, D), (batch, T, kv_heads, D), (batch, T, kv_heads, D),
              (batch, T, heads, D)]
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def median_seconds(fn, args, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(iters):
        check_stop()
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def is_out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def fwd_and_fwdbwd(attn):
    """The jitted forward, and the jitted forward+backward (a vjp with a given cotangent)."""
    fwd = jax.jit(attn)
    fwdbwd = jax.jit(lambda q, k, v, d_out: jax.vjp(attn, q, k, v)[1](d_out))
    return fwd, fwdbwd


def measure(exp: AttentionSettings, impl: str, T: int, D: int, causal: bool, interpret: bool,
            key) -> dict:
    """One row: median times and TFLOP/s, or the reason it has none."""
    heads, kv_heads = exp.heads, exp.kv_heads or exp.heads
    batch = exp.batch or max(1, exp.batch_tokens // T)
    row = {"impl": impl, "T": T, "D": D, "causal": causal, "batch": batch, "fwd_ms": None,
           "fwdbwd_ms": None, "fwd_tflops": None, "fwdbwd_tflops": None, "max_T": None,
           "status": skip_reason(impl, T, heads, kv_heads)}
    if row["status"]:
        return row
    q, k, v, d_out = make_inputs(key, batch, T, heads, kv_heads, D, DTYPES[exp.dtype])
    fwd, fwdbwd = fwd_and_fwdbwd(attention_fn(impl, causal, interpret))
    flops = 4.0 * batch * heads * T * T * D / (2 if causal else 1)
    try:
        fwd_s = median_seconds(fwd, (q, k, v), exp.warmup, exp.iters)
        fwdbwd_s = median_seconds(fwdbwd, (q, k, v, d_out), exp.warmup, exp.iters)
    except Exception as e:   # noqa: BLE001 - every failure becomes the row's status
        row["status"] = "OOM" if is_out_of_memory(e) else f"error: {str(e).splitlines()[0]}"
        return row
    row.update(fwd_ms=fwd_s * 1e3, fwdbwd_ms=fwdbwd_s * 1e3, fwd_tflops=flops / fwd_s / 1e12,
               fwdbwd_tflops=3.5 * flops / fwdbwd_s / 1e12, status="ok")
    return row


def longest_fitting(exp: AttentionSettings, impl: str, D: int, causal: bool, start_T: int,
                    limit: int, interpret: bool, key) -> tuple[int | None, str]:
    """(longest T whose forward+backward ran at batch 1, why the doubling stopped: "OOM", "limit",
    "skipped: ..." or "error: ...")."""
    heads, kv_heads = exp.heads, exp.kv_heads or exp.heads
    fits, T = None, start_T
    while T <= limit:
        reason = skip_reason(impl, T, heads, kv_heads)
        if reason:
            return fits, reason
        q, k, v, d_out = make_inputs(key, 1, T, heads, kv_heads, D, DTYPES[exp.dtype])
        try:
            jax.block_until_ready(fwd_and_fwdbwd(attention_fn(impl, causal, interpret))[1](
                q, k, v, d_out))
        except Exception as e:   # noqa: BLE001 - the search reports why it stopped
            return fits, "OOM" if is_out_of_memory(e) else f"error: {str(e).splitlines()[0]}"
        finally:
            del q, k, v, d_out
        fits, T = T, 2 * T
    return fits, "limit"


def compare(rows: list[dict]):
    """On our rows: forward and forward+backward throughput over cuDNN's and the reference's."""
    by_key = {(r["impl"], r["T"], r["D"], r["causal"]): r for r in rows}
    for row in rows:
        if row["impl"] != "pallas":
            continue
        for other, fields in (("cudnn", ("fwd_tflops", "fwdbwd_tflops")),
                              ("jax_reference", ("fwdbwd_tflops",))):
            them = by_key.get((other, row["T"], row["D"], row["causal"]))
            for field in fields:
                mine, theirs = row[field], them and them[field]
                row[f"{field}_vs_{other}"] = mine / theirs if mine and theirs else None


@command(AttentionConfig)
def main(argv=None) -> int:
    cfg = parse(argv, AttentionConfig, description=__doc__.split("\n\n")[0])
    exp = cfg.experiment
    impls = parse_list(exp.impls, "experiment.impls", valid=IMPLS)
    seq_lens = parse_list(exp.seq_lens, "experiment.seq_lens", kind=int)
    head_dims = parse_list(exp.head_dims, "experiment.head_dims", kind=int)
    for field in ("heads", "iters", "batch"):
        value = getattr(exp, field)
        if value is not None and value < 1:
            raise ConfigError(f"{field} must be at least 1, got {value}",
                              field=f"experiment.{field}")
    kv_heads = exp.kv_heads or exp.heads
    if kv_heads < 1 or exp.heads % kv_heads:
        raise ConfigError(f"kv_heads={kv_heads} does not divide heads={exp.heads}; choose "
                          f"kv_heads dividing heads", field="experiment.kv_heads")
    if exp.warmup < 0:
        raise ConfigError(f"warmup must be >= 0, got {exp.warmup}", field="experiment.warmup")

    gpu = jax.default_backend() == "gpu"
    interpret = not gpu
    limit = exp.max_t_limit if exp.max_t_limit is not None else (131072 if gpu else 0)
    causal_modes = {"both": (True, False), "causal": (True,), "full": (False,)}[exp.causal]
    key = jax.random.PRNGKey(exp.seed)
    rows, search = [], {}
    for impl in impls:
        for D in head_dims:
            for causal in causal_modes:
                impl_rows = [measure(exp, impl, T, D, causal, interpret, key)
                             for T in seq_lens]
                timed = [r["T"] for r in impl_rows if r["status"] == "ok"]
                if limit and timed:
                    max_T, stop = longest_fitting(exp, impl, D, causal, max(timed), limit,
                                                  interpret, key)
                    search[f"{impl} D={D} causal={causal}"] = {"max_T": max_T, "stopped": stop}
                    for r in impl_rows:
                        r["max_T"] = max_T
                rows += impl_rows
    compare(rows)
    meta = {"dtype": exp.dtype, "heads": exp.heads, "kv_heads": kv_heads,
            "batch": exp.batch, "batch_tokens": exp.batch_tokens, "warmup": exp.warmup,
            "iters": exp.iters, "interpret": interpret, "max_t_limit": limit,
            "max_t_search": search,
            "flops": "forward 4*B*H*T*T*D (halved when causal); forward+backward 3.5x that",
            **environment()}
    print(f"\n{exp.dtype}, {exp.heads} heads ({kv_heads} key/value); {meta['device']}, "
          f"jax {meta['jax_version']}" + ("; Pallas interpreted, not a speed" if interpret
                                          else ""))
    print(format_table(rows, COLUMNS))
    for r in rows if not interpret else []:
        ratios = ", ".join(f"{k.replace('_tflops', '')} {r[k]:.2f}x" for k in r
                           if "_vs_" in k and r[k])
        if ratios:
            print(f"pallas T={r['T']} D={r['D']} causal={r['causal']}: {ratios}")
    if limit:
        print(f"max T: the longest T whose forward+backward ran at batch 1, doubling up to "
              f"{limit}; the search stopped at: "
              + "; ".join(f"{k}: {v['stopped']}" for k, v in search.items()))
    write_json(exp.json, rows, meta)
    errors = [r["status"] for r in rows] + [v["stopped"] for v in search.values()]
    return 1 if any(e.startswith("error") for e in errors) else 0


if __name__ == "__main__":
    sys.exit(main())
