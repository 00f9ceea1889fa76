"""Embedding lookups side by side: forward+backward time of each method per vocabulary size and
id distribution, and each gradient's error against a float64 scatter.

    python -m experiments.embedding                  # a GPU: V 320 to 50,304, 16 x 1024 tokens
    python -m experiments.embedding --vocabs 320,50304 --ids bytes --json embedding.json
    python -m experiments.embedding --vocabs 64,512 --d-model 64 --batch 2 --seq-len 128

Methods (``jaxaccel.model.embedding``, the training flag ``--embedding``): ``gather`` (the gather;
its backward is XLA's scatter-add, whose atomic adds collide on the rows many tokens share),
``one_hot`` (a matmul of the one-hot ids with the table, both ways) and ``sorted_sum`` (the gather,
its backward the tokens sorted by id and each id's rows summed by a segmented scan, every row
written once). ``auto`` marks the method the library picks for that vocabulary.

Id distributions (``--ids``): ``uniform`` (every id equally likely: the case that hides the
scatter's collisions), ``zipf`` (id of rank r drawn with probability proportional to
r^-``--zipf-power``, ranks shuffled over the vocabulary: a stand-in for subword text) and
``bytes`` (the byte ids of ``--data``'s first tokens, as the byte model trains on them: spaces,
'e' and newlines dominate; vocabularies smaller than the byte tokenizer's are skipped).

Each row times one jitted function returning the lookup's output and the table's gradient for a
fixed random cotangent (median of ``--iters`` runs after ``--warmup``, each ended with
``block_until_ready``). ``grad error`` is the norm of the difference between its gradient and a
float64 NumPy scatter-add of the same cotangent, over the latter's norm; every method's output
is checked to equal the gather's exactly.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import (Experiment, Row, RowRun, config_of, first, main_of,
                                median_seconds, out_of_memory, parse_list, relative)
from jaxaccel.model import embedding
from jaxaccel.run.config import setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.model.gpt import ACTIVATION_AXES

METHODS = tuple(m for m in embedding.METHODS if m != "auto")
ID_KINDS = ("uniform", "zipf", "bytes")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


@dataclasses.dataclass
class EmbeddingSettings:
    vocabs: str = setting("320,2048,8192,50304", "comma-separated vocabulary sizes V")
    methods: str = setting(",".join(METHODS), "comma-separated lookup methods")
    ids: str = setting(",".join(ID_KINDS), "comma-separated id distributions")
    batch: int = setting(16, "rows of token ids", at_least=1)
    seq_len: int = setting(1024, "tokens per row", at_least=1)
    d_model: int = setting(768, "embedding width D", at_least=1)
    dtype: str = setting("bfloat16", "the table's and the cotangent's dtype (a bf16 policy's "
                                     "compute dtype: the table is cast before the lookup)",
                         choices=tuple(DTYPES))
    zipf_power: float = setting(1.0, "zipf ids: the exponent of the rank", above=0)
    data: str = setting("stdlib", "bytes ids: the corpus (see experiments.train --data)")
    warmup: int = setting(3, "untimed runs per row", at_least=0)
    iters: int = setting(20, "timed runs per row (median)", at_least=1)
    seed: int = setting(0, "seed of the table, the cotangent and the random ids")
    json: str | None = setting(None, "also write the rows as JSON to this path")


# The rows to time and how: this experiment trains nothing, so it has only its own section.
EmbeddingConfig = config_of(EmbeddingSettings, base=None)


def rows(cfg: EmbeddingConfig) -> list[Row]:
    """A row per vocabulary size and id distribution; its measurement gives one per method."""
    exp = cfg.experiment
    vocabs = parse_list(exp.vocabs, "experiment.vocabs", kind=int)
    parse_list(exp.methods, "experiment.methods", valid=METHODS)
    check_vocabs(vocabs, exp)
    return [Row(f"V={V} {kind}", fields={"V": V, "ids": kind}) for V in vocabs
            for kind in parse_list(exp.ids, "experiment.ids", valid=ID_KINDS)]


# Token ids are int32, as a training step's are.
MAX_VOCAB = 2**31 - 1


def check_vocabs(vocabs: list[int], exp) -> None:
    """A ConfigError for a V the ids cannot index, or whose table and its gradient (each V x D
    in the experiment's dtype) take more than half the device's memory (the host's, on a CPU:
    the lookup's inputs, outputs and XLA's buffers need the rest); the largest V that fits."""
    from jaxaccel.core import hardware

    per_row = 2 * exp.d_model * jnp.dtype(DTYPES[exp.dtype]).itemsize
    memory = hardware.device_memory_bytes()
    largest = min(MAX_VOCAB, memory // 2 // per_row)
    for V in vocabs:
        if V < 1 or V > largest:
            why = ("V must be at least 1" if V < 1 else
                   f"V={V:,} is more than token ids of int32 can index" if V > MAX_VOCAB else
                   f"V={V:,}'s table and its gradient ({V:,} x {exp.d_model} {exp.dtype}, "
                   f"twice: {V * per_row:,} bytes) take more than half the memory here "
                   f"({memory:,} bytes)")
            raise ConfigError(f"{why}; pass --vocabs of sizes from 1 to {largest:,}",
                              field="experiment.vocabs")


def shared(cfg: EmbeddingConfig) -> dict:
    """The random stream every row's inputs are drawn from, in row order, and the corpus of the
    bytes ids (loaded, or failing, before any row runs)."""
    from jaxaccel.data import corpus

    exp = cfg.experiment
    return {"rng": np.random.default_rng(exp.seed),
            "corpus": corpus.load_corpus(exp.data, tokenizer="bytes")
            if "bytes" in parse_list(exp.ids, "experiment.ids", valid=ID_KINDS) else None}


def token_ids(kind: str, V: int, n: int, rng: np.random.Generator, exp,
              data) -> np.ndarray | str:
    """``n`` int32 ids of distribution ``kind`` (module docstring; ``data``: the bytes ids'
    corpus), or the reason it has none for a vocabulary of ``V``."""
    if kind == "uniform":
        return rng.integers(0, V, n, dtype=np.int32)
    if kind == "zipf":
        p = np.arange(1, V + 1, dtype=np.float64) ** -exp.zipf_power
        ranks = rng.choice(V, size=n, p=p / p.sum())
        return rng.permutation(V).astype(np.int32)[ranks]
    if V < data.tokenizer.padded_vocab_size:
        return f"skipped: bytes ids need V >= {data.tokenizer.padded_vocab_size}"
    taken, total = [], 0
    for doc in data.train:
        taken.append(np.asarray(doc, np.int32)[: n - total])
        total += len(taken[-1])
        if total == n:
            return np.concatenate(taken)
    return f"skipped: {exp.data} holds {total} training tokens, fewer than {n}"


def lookup_and_grad(how: str):
    """jit(table, ids, cotangent) -> (the lookup's output, the table's gradient)."""

    def fn(table_VD, ids_BT, g_BTD):
        out_BTD, vjp = jax.vjp(lambda t: embedding.lookup(t, ids_BT, ACTIVATION_AXES, how),
                               table_VD)
        return out_BTD, vjp(g_BTD)[0]

    return jax.jit(fn)


def measure(run: RowRun) -> list[dict]:
    """One vocabulary size and id distribution: a result per method on the same inputs, or the
    reason it has none (skipped, out of memory)."""
    exp, rng, V, kind = run.cfg.experiment, run.shared["rng"], *run.row.fields.values()
    methods = parse_list(exp.methods, "experiment.methods", valid=METHODS)
    B, T, D = exp.batch, exp.seq_len, exp.d_model
    ids = token_ids(kind, V, B * T, rng, exp, run.shared["corpus"])
    if isinstance(ids, str):
        return [{"method": m, "auto": "", "status": ids} for m in methods]
    counts = np.bincount(ids, minlength=V)
    base = {"distinct": int((counts > 0).sum()), "top_share": float(counts.max() / ids.size)}
    dtype = DTYPES[exp.dtype]
    table_VD = jnp.asarray(rng.standard_normal((V, D), np.float32) * 0.02, dtype)
    g_BTD = jnp.asarray(rng.standard_normal((B, T, D), np.float32), dtype)
    ids_BT = jnp.asarray(ids.reshape(B, T))
    exact_VD = np.zeros((V, D))
    np.add.at(exact_VD, ids, np.asarray(g_BTD, np.float64).reshape(-1, D))
    expected_BTD = np.asarray(table_VD)[ids.reshape(B, T)]
    rows = []
    for how in methods:
        row = {**base, "method": how,
               "auto": "*" if embedding.method(V, dtype=dtype) == how else ""}
        fn = lookup_and_grad(how)
        try:
            out_BTD, grad_VD = jax.block_until_ready(fn(table_VD, ids_BT, g_BTD))
            seconds = median_seconds(fn, (table_VD, ids_BT, g_BTD), exp.warmup, exp.iters)
        except Exception as e:      # noqa: BLE001 - a method that cannot run is a row's status
            if not out_of_memory(e):
                raise
            rows.append({**row, "status": "out of memory"})
            continue
        diff = np.asarray(grad_VD, np.float64) - exact_VD
        rows.append({**row, "ms": seconds * 1e3,
                     "grad_error": float(np.linalg.norm(diff) / np.linalg.norm(exact_VD)),
                     "status": "ok" if np.array_equal(np.asarray(out_BTD), expected_BTD)
                     else "error: output differs from the gather's"})
    relative(rows, first(rows, method="gather"), vs_gather=("ms", "inverse"))
    return rows


def fastest(rows: list[dict], dtype) -> list[str]:
    """Per vocabulary and id distribution: the fastest method, and the one ``auto`` picks for a
    table of ``dtype``."""
    lines = []
    for key in dict.fromkeys((r["V"], r["ids"]) for r in rows):
        timed = [r for r in rows if (r["V"], r["ids"]) == key and r.get("status") == "ok"]
        if not timed:
            continue
        best = min(timed, key=lambda r: r["ms"])
        pick = embedding.method(key[0], dtype=dtype)
        auto = next((r for r in timed if r["method"] == pick), None)
        verdict = (f"auto picks {pick}" + (f", {auto['ms'] / best['ms']:.2f}x the fastest's time"
                                           if auto else " (not timed)"))
        lines.append(f"V={key[0]} {key[1]}: fastest {best['method']} ({best['ms']:.3f} ms); "
                     f"{verdict}")
    return lines


EXPERIMENT = Experiment(
    name="embedding", doc=__doc__, config=EmbeddingConfig, rows=rows, trains=False,
    shared=shared, measure=measure,
    setup=lambda cfg: (f"{cfg.experiment.batch} x {cfg.experiment.seq_len} ids, "
                       f"D={cfg.experiment.d_model}, {cfg.experiment.dtype}"),
    columns=[("V", "V", "d"), ("ids", "ids", ""), ("distinct", "distinct ids", "d"),
             ("top_share", "top id share", ".3f"), ("method", "method", ""),
             ("auto", "auto", ""), ("ms", "fwd+bwd ms", ".3f"), ("vs_gather", "vs gather", ".2f"),
             ("grad_error", "grad error", ".1e"), ("status", "status", "")],
    meta=lambda cfg, rows: {
        **{k: getattr(cfg.experiment, k) for k in ("batch", "seq_len", "d_model", "dtype",
                                                   "zipf_power", "data", "warmup", "iters")},
        "one_hot_max_vocab": embedding.ONE_HOT_MAX_VOCAB,
        "timed": "jit(lookup output, table gradient) for a fixed cotangent"},
    notes=lambda cfg, rows, meta: fastest(rows, DTYPES[cfg.experiment.dtype]),
    failed=lambda rows: any(r["status"].startswith("error") for r in rows))
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
