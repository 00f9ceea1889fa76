"""Corpus scale: tokenize gigabytes of text once, then feed packed batches from the memory map.

    python -m experiments.corpus_scale                     # 2048 MB of text, bytes and bpe:32768
    python -m experiments.corpus_scale --corpus-mb 100 --tokenizers bytes,bpe:32768 --json cs.json
    python -m experiments.corpus_scale --work-dir runs/cs --keep    # keep the text and caches

Issue 18's targets: tokenizing at >= 20 MB of text per second with ``tokenizers`` on a 2-core
machine with a peak resident memory <= 1.5 GB for a 2 GB corpus; the loader at >= 5 M real
tokens/s per core from memory-mapped tokens with packing. MB is 2^20 bytes, GB 2^30.

1. Corpus: ``--corpus-mb`` of JSONL (``{"text": ...}`` a line) in ``--work-dir``: the stdlib's
   Python files (not site-packages, __pycache__) cut at top-level definitions, copied until it
   is that large, in each copy of a file a random choice of identifiers renamed and comment
   lines naming the copy inserted (seeded by ``--seed``, the copy and the file). Written
   streaming; a kept one of the same size and seed is reused (``corpus.meta.json`` beside it).
2. Tokenizing: per tokenizer, ``load_corpus`` into a fresh cache in a fresh process,
   ``--tokenize-batch-mb`` at a time. A ``bpe:N`` is first trained on ``--bpe-data`` alone (in
   its own process, cached in ``--cache-dir``), since training a BPE on gigabytes is not what is
   measured; ``bpe train s`` is training it and tokenizing ``--bpe-data`` (n/a: read from the
   cache). ``seconds`` is inside ``load_corpus`` (read, encode, write, index), ``cores busy``
   CPU seconds / seconds, ``bytes/token`` per target token, ``peak RSS`` the process's own
   ``VmHWM`` (Linux's ``ru_maxrss`` would include the parent's peak, kept across fork and exec).
3. Loader: ``DataStream(train, strategy="pack")`` on the memory-mapped cache makes
   ``--loader-batches`` batches on one thread; real tokens are the sum of ``weights``; ``plan
   s`` is building the stream and its epoch statistics (lengths only, no token read). Three
   passes over the same batches: ``mmap, cold`` after asking the kernel to drop the token
   file's cached pages (fsync + ``POSIX_FADV_DONTNEED``; a virtual machine's host may still
   cache them), ``mmap, warm``, and ``memory``: the same documents in an in-memory array (all
   the tokens when they take at most a quarter of the available memory, else only the
   documents the batches read, compacted; the plan is the same). ``vs memory`` is a pass's
   tokens/s over the memory pass's.

``--json`` writes the rows (``part``: tokenize or loader) with the sizes, settings, command and
environment. Unless ``--keep``, the tokenized caches (gigabytes) are deleted after measuring,
and the text if this run generated it; Ctrl-C stops the tokenizing process too and cleans up
the same way.
"""

import builtins
import dataclasses
import json
import keyword
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

from experiments.common import (Experiment, Row, RowRun, check_stop, config_of, main_of,
                                parse_list, passing_signals_to)
from jaxaccel.run.config import check_writable, setting
from jaxaccel.data.corpus import Documents, cache_root, load_corpus, stdlib_root
from jaxaccel.data.corpus import stdlib_files as corpus_stdlib_files
from jaxaccel.data.batching import DataStream
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.hardware import host_memory_bytes
from jaxaccel.core.tokenizer import parse_spec

MB, GB = 2**20, 2**30
TOKENIZE_MB_PER_S = 20.0            # issue 18's targets
TOKENIZE_PEAK_BYTES = 1.5 * GB
TARGET_CORPUS_MB = 2048
LOADER_TOKENS_PER_S = 5e6           # per core: the loader runs on one thread
CORPUS_FORMAT = 2                   # of the generated corpus: a change regenerates it
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class CorpusScaleSettings:
    corpus_mb: float = setting(float(TARGET_CORPUS_MB), "size of the generated JSONL corpus in "
                                                        "MB (2^20 bytes)", above=0)
    work_dir: str | None = setting(None, "folder for the generated corpus and the tokenized "
                                         "caches (default: runs/corpus-scale-DATE); pass one "
                                         "with --keep to reuse the corpus")
    tokenizers: str = setting("bytes,bpe:32768", "comma-separated tokenizers (as --tokenizer "
                                                 "takes); a bpe:N is trained on --bpe-data")
    bpe_data: str = setting(
        "stdlib", "the corpus bpe:N tokenizers are trained on (as --data takes)")
    cache_dir: str | None = setting(
        None, "where the trained bpe:N tokenizers are cached (default: $JAXACCEL_CACHE_DIR, else "
        "~/.cache/jaxaccel)")
    tokenize_batch_mb: float = setting(
        16.0, "MB of text tokenized at once (the memory tokenizing takes)", above=0)
    seq_len: int = setting(1024, "tokens per packed row", at_least=1)
    batch_size: int = setting(16, "rows per batch", at_least=1)
    loader_batches: int = setting(500, "batches each loader pass makes (at most one epoch)",
                                  at_least=1)
    seed: int = setting(0, "seed of the corpus's perturbations and of the batch order")
    keep: bool = setting(False, "keep the generated corpus and the tokenized caches")
    json: str | None = setting(None, "also write the rows as JSON to this path")


CorpusScaleConfig = config_of(CorpusScaleSettings, base=None)


TOKENIZE_COLUMNS = [
    ("tokenizer", "tokenizer", ""), ("text_mb", "text MB", ",.1f"),
    ("documents", "documents", ",d"), ("tokens", "tokens", ",d"),
    ("bytes_per_token", "bytes/token", ".2f"), ("seconds", "seconds", ".1f"),
    ("mb_per_s", "MB/s", ".1f"), ("speed_target", ">= 20 MB/s", ""),
    ("cores_used", "cores busy", ".2f"), ("peak_rss_mb", "peak RSS MB", ",.0f"),
    ("memory_target", "<= 1.5 GB", ""), ("cache_mb", "cache MB", ",.1f"),
    ("train_s", "bpe train s", ".1f"),      # training and tokenizing --bpe-data; n/a: cached
]
LOADER_COLUMNS = [
    ("tokenizer", "tokenizer", ""), ("source", "tokens from", ""), ("plan_s", "plan s", ".2f"),
    ("batches", "batches", ",d"), ("real_tokens", "real tokens", ",d"),
    ("seconds", "seconds", ".2f"), ("tokens_per_s", "real tok/s", ",.0f"),
    ("tokens_per_cpu_s", "per CPU s", ",.0f"), ("vs_memory", "vs memory", ".2f"),
    ("loader_target", ">= 5 M/s/core", ""),
]


# ---------------------------------------------------------------------------------------------
# 1. The corpus: the stdlib, copied with perturbations.

_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b")
_RESERVED = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins))
_DEFINITION = re.compile(r"\n\n(?=(?:async def |def |class |@))")   # a top-level definition
_RENAMED = 8            # identifiers renamed per file and copy
_COMMENT_EVERY = 40     # lines per inserted comment line, on average
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def stdlib_files() -> list[str]:
    root = stdlib_root()
    return [str(root / rel) for rel in corpus_stdlib_files(root)]


def perturb(text: str, names: list[str], copy: int, rng: np.random.Generator) -> str:
    """``text`` with up to ``_RENAMED`` of its ``names`` renamed (a random suffix each) and a
    comment line naming the copy inserted about every ``_COMMENT_EVERY`` lines."""
    if names:
        chosen = rng.choice(len(names), size=min(_RENAMED, len(names)), replace=False)
        suffixes = ["".join(s) for s in _LETTERS[rng.integers(0, 26, (len(chosen), 4))]]
        mapping = {names[i]: f"{names[i]}_{s}" for i, s in zip(chosen.tolist(), suffixes)}
        pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, mapping)) + r")\b")
        text = pattern.sub(lambda m: mapping[m.group()], text)
    lines = text.split("\n")
    at = np.sort(rng.integers(0, len(lines), 1 + len(lines) // _COMMENT_EVERY)).tolist()
    tag = int(rng.integers(0, 2**32))
    pieces, previous = [], 0
    for p in at:
        pieces += lines[previous:p]
        indent = lines[p][: len(lines[p]) - len(lines[p].lstrip())]
        pieces.append(f"{indent}# copy {copy}: {tag:08x}")
        previous = p
    return "\n".join(pieces + lines[previous:])


def generate_corpus(path: str, target_bytes: int, seed: int) -> dict:
    """Writes ``path`` until it holds ``target_bytes``; what goes into the meta. Memory is the
    stdlib's text (about 30 MB) and one file's copy."""
    files = stdlib_files()
    if not files:
        raise ConfigError(f"no .py files under {stdlib_root()}: this "
                          f"interpreter has no standard library sources to generate from")
    sources: dict[int, tuple[str, list[str]]] = {}      # read on first use, then kept
    tmp = f"{path}.{os.getpid()}.tmp"
    written = documents = copy = 0
    began = time.perf_counter()
    try:
        with open(tmp, "wb", buffering=8 * MB) as out:
            while written < target_bytes:
                for i, file_path in enumerate(files):
                    if i not in sources:
                        with open(file_path, "rb") as f:
                            text = f.read().decode("utf-8", errors="replace")
                        sources[i] = (text, sorted(set(_IDENTIFIER.findall(text)) - _RESERVED))
                    rng = np.random.default_rng([seed, copy, i])
                    for doc in _DEFINITION.split(perturb(*sources[i], copy, rng)):
                        if doc.strip():
                            line = json.dumps({"text": doc}, ensure_ascii=False).encode() + b"\n"
                            out.write(line)
                            written += len(line)
                            documents += 1
                            if written >= target_bytes:
                                break
                    if i % 64 == 0:
                        check_stop()
                    if written >= target_bytes:
                        break
                copy += 1
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"bytes": written, "documents": documents, "copies": copy, "stdlib_files": len(files),
            "generate_s": time.perf_counter() - began}


# ---------------------------------------------------------------------------------------------
# 2. Tokenizing, each in a fresh process.

# The child: load_corpus into a fresh cache, then one JSON line with what it measured. It stops
# (SIGTERM) with the experiment (PR_SET_PDEATHSIG); a ConfigError is one JSON line too.
CHILD = r"""
import ctypes, json, os, resource, signal, sys, time
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[5]):
    sys.exit(1)
from jaxaccel.data.corpus import load_corpus
from jaxaccel.core.errors import ConfigError
source, spec, cache_dir, batch_mb = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
began, cpu = time.perf_counter(), time.process_time()     # CPU time of all its threads
try:
    corpus = load_corpus(source, tokenizer=spec, cache_dir=cache_dir, tokenize_batch_mb=batch_mb)
except ConfigError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(2)
seconds, cpu_s = time.perf_counter() - began, time.process_time() - cpu
try:
    peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
except (OSError, IndexError, ValueError):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
        1 if sys.platform == "darwin" else 1024)
print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "peak_rss": peak, "stats": corpus.stats,
                  "vocab_size": corpus.tokenizer.vocab_size,
                  "tokenizer_path": getattr(corpus.tokenizer, "path", None)}))
"""


class ChildFailed(Exception):
    """A tokenizing process failed for a reason other than bad input."""


def run_child(source: str, spec: str, cache_dir: str, batch_mb: float) -> dict:
    """``CHILD`` for ``source`` and ``spec``: what it measured. A signal the experiment gets is
    passed on to it."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, source, spec, cache_dir, str(batch_mb),
                             str(os.getpid())], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    with passing_signals_to(proc.send_signal):
        out, err = proc.communicate()
    check_stop()
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        result = {}
    if "error" in result:
        raise ConfigError(result["error"])
    if proc.returncode != 0 or "seconds" not in result:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise ChildFailed(f"tokenizing {source} with {spec} failed (exit code "
                          f"{proc.returncode}): {last}")
    result["process_s"] = time.perf_counter() - began
    return result


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def tokenize_row(exp: CorpusScaleSettings, spec: str, corpus_path: str, cache_dir: str) -> dict:
    kind, _ = parse_spec(spec)
    tokenizer, trained = spec, None
    if kind == "bpe":
        cache = str(cache_root(exp.cache_dir))
        before = set(os.listdir(cache)) if os.path.isdir(cache) else set()
        print(f"training {spec} on {exp.bpe_data} (or reading it from the cache {cache}) ...",
              flush=True)
        train = run_child(exp.bpe_data, spec, cache, exp.tokenize_batch_mb)
        tokenizer = train["tokenizer_path"]
        trained = None if os.path.basename(tokenizer) in before else train    # None: cached
    shutil.rmtree(cache_dir, ignore_errors=True)
    print(f"tokenizing {corpus_path} with {spec} ...", flush=True)
    result = run_child(corpus_path, tokenizer, cache_dir, exp.tokenize_batch_mb)
    stats, seconds, peak = result["stats"], result["seconds"], result["peak_rss"]
    text = stats["train_text_bytes"] + stats["val_text_bytes"]
    mb_per_s = text / MB / seconds
    docs = stats["train_documents"] + stats["val_documents"]
    tokens = stats["train_tokens"] + stats["val_tokens"]
    return {
        "part": "tokenize", "tokenizer": spec,
        "tokenizer_file": None if kind == "bytes" else tokenizer,
        "vocab_size": result["vocab_size"], "text_mb": text / MB, "documents": docs,
        "tokens": tokens, "bytes_per_token": text / (tokens - docs),    # BOS is no target
        "seconds": seconds, "process_s": result["process_s"], "mb_per_s": mb_per_s,
        "cpu_s": result["cpu_s"], "cores_used": result["cpu_s"] / seconds,
        "peak_rss_mb": peak / MB, "cache_mb": folder_bytes(cache_dir) / MB,
        "cache_dir": cache_dir, "speed_target": verdict(mb_per_s >= TOKENIZE_MB_PER_S),
        "memory_target": verdict(peak <= TOKENIZE_PEAK_BYTES),
        "train_s": trained["seconds"] if trained else None,
        "train_peak_rss_mb": trained["peak_rss"] / MB if trained else None,
        "tokenizer_cached": kind == "bpe" and trained is None,
    }


# ---------------------------------------------------------------------------------------------
# 3. The loader: memory-mapped tokens against the same tokens in memory.

class _Reading(Documents):
    """Documents that note which ones were read (to copy only those into memory)."""

    def __init__(self, documents: Documents):
        super().__init__(documents.tokens, documents.starts, documents.lengths)
        self.read: set[int] = set()

    def __getitem__(self, i):
        if not isinstance(i, slice):
            self.read.add(int(i))
        return super().__getitem__(i)


def packed(documents, exp: CorpusScaleSettings) -> DataStream:
    return DataStream(documents, strategy="pack", seq_len=exp.seq_len,
                      batch_size=exp.batch_size, seed=exp.seed)


def loader_pass(documents, exp: CorpusScaleSettings) -> dict:
    began = time.perf_counter()
    stream = packed(documents, exp)
    stats = stream.stats
    plan_s = time.perf_counter() - began
    count = min(exp.loader_batches, stats["batches_per_epoch"])
    real = 0.0
    began, cpu = time.perf_counter(), time.process_time()
    for i in range(count):
        real += float(next(stream)["weights"].sum(dtype=np.float64))
        if i % 32 == 0:
            check_stop()
    seconds, cpu_s = time.perf_counter() - began, time.process_time() - cpu
    return {"plan_s": plan_s, "batches": count, "real_tokens": int(real), "seconds": seconds,
            "tokens_per_s": real / seconds, "tokens_per_cpu_s": real / max(cpu_s, 1e-9),
            "batches_per_epoch": stats["batches_per_epoch"],
            "padding_efficiency": stats["padding_efficiency"]}


def drop_cached_pages(path: str) -> bool:
    """False where there is no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def in_memory(train: Documents, exp: CorpusScaleSettings) -> tuple[Documents, str]:
    """``train`` backed by an in-memory array, and its ``source``; the documents the batches
    read are found by an untimed pass."""
    if train.tokens.nbytes <= host_memory_bytes() // 4:
        return Documents(np.array(train.tokens), train.starts, train.lengths), "memory"
    reading = _Reading(train)
    stream = packed(reading, exp)
    for _ in range(min(exp.loader_batches, stream.batches_per_epoch)):
        next(stream)
    read = np.array(sorted(reading.read), dtype=np.int64)
    lengths = train.lengths[read]
    offsets = np.cumsum(lengths) - lengths
    compact = np.empty(int(lengths.sum()), dtype=train.tokens.dtype)
    for doc, offset, length in zip(read.tolist(), offsets.tolist(), lengths.tolist()):
        compact[offset : offset + length] = train[doc]
    starts = np.zeros(len(train), dtype=np.int64)     # documents never read: never sliced
    starts[read] = offsets
    return Documents(compact, starts, train.lengths), f"memory ({len(read):,} docs read)"


def loader_rows(exp: CorpusScaleSettings, spec: str, corpus_path: str, cache_dir: str,
                tokenizer: str) -> list[dict]:
    began = time.perf_counter()
    train = load_corpus(corpus_path, tokenizer=tokenizer, cache_dir=cache_dir,
                        tokenize_batch_mb=exp.tokenize_batch_mb).train
    load_s = time.perf_counter() - began
    base = {"part": "loader", "tokenizer": spec, "documents": len(train),
            "train_tokens": int(train.lengths.sum()), "load_s": load_s}
    token_file = getattr(train.tokens, "filename", None)
    cold = token_file is not None and drop_cached_pages(token_file)
    rows = [{**base, "source": "mmap, cold" if cold else "mmap", **loader_pass(train, exp)},
            {**base, "source": "mmap, warm", **loader_pass(train, exp)}]
    began = time.perf_counter()
    documents, source = in_memory(train, exp)
    copy_s = time.perf_counter() - began
    rows.append({**base, "source": source, "copy_s": copy_s, **loader_pass(documents, exp)})
    del documents
    for row in rows:
        row["vs_memory"] = row["tokens_per_s"] / rows[-1]["tokens_per_s"]
        row["loader_target"] = verdict(row["tokens_per_s"] >= LOADER_TOKENS_PER_S)
    return rows


# ---------------------------------------------------------------------------------------------

def remove(path: str) -> float:
    """Deletes a file or folder if it exists; the MB it held."""
    if os.path.isdir(path):
        size = folder_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        size = os.path.getsize(path)
        os.remove(path)
    else:
        return 0.0
    return size / MB


def rows(cfg: CorpusScaleConfig) -> list[Row]:
    """A row per tokenizer; every setting checked before any work."""
    exp = cfg.experiment
    specs = parse_list(exp.tokenizers, "experiment.tokenizers")
    kinds = [parse_spec(spec)[0] for spec in specs]   # a bad spec: one error line, before work
    missing = [spec for spec, kind in zip(specs, kinds) if kind == "file"
               and not os.path.isfile(os.path.expanduser(spec))]
    if missing:
        raise ConfigError(f"tokenizer file {missing[0]} does not exist; pass bytes, bpe:N or "
                          f"the path of a tokenizer.json or .model", field="experiment.tokenizers")
    if exp.work_dir is not None and not exp.work_dir.strip():
        raise ConfigError("work_dir is empty; pass a folder, or leave it out for the default",
                          field="experiment.work_dir")
    if "bpe" in kinds and exp.bpe_data != "stdlib" and \
            not os.path.exists(os.path.expanduser(exp.bpe_data)):
        raise ConfigError(f"bpe_data {exp.bpe_data} does not exist; pass stdlib or a corpus "
                          f"path", field="experiment.bpe_data")
    slugs = [re.sub(r"[^A-Za-z0-9_.-]+", "-", os.path.basename(s.rstrip("/")))[-60:]
             for s in specs]
    return [Row(spec, fields={"cache": f"cache-{i}-{slug}"})
            for i, (spec, slug) in enumerate(zip(specs, slugs))]


def workspace(cfg: CorpusScaleConfig) -> dict:
    """The work folder (made here); the first row generates (or finds) the corpus."""
    default = os.path.join("runs", time.strftime("corpus-scale-%Y%m%d"))
    work_dir = cfg.experiment.work_dir or default
    check_writable("experiment.work_dir", work_dir, may_create=True)
    created = not os.path.exists(work_dir)
    os.makedirs(work_dir, exist_ok=True)
    return {"work_dir": work_dir, "created": created, "caches": [], "generated": False,
            "corpus": None, "corpus_path": os.path.join(work_dir, "corpus.jsonl"),
            "meta_path": os.path.join(work_dir, "corpus.meta.json")}


def the_corpus(exp: CorpusScaleSettings, ws: dict):
    """Sets ``ws["corpus"]`` once: a kept corpus of the same settings, else a generated one."""
    if ws["corpus"] is not None:
        return
    target_bytes = max(1, round(exp.corpus_mb * MB))
    wanted = {"format": CORPUS_FORMAT, "target_bytes": target_bytes, "seed": exp.seed,
              "python": list(sys.version_info[:3]), "stdlib": str(stdlib_root())}
    try:
        with open(ws["meta_path"]) as f:
            corpus = json.load(f)
        if any(corpus.get(k) != v for k, v in wanted.items()) or \
                corpus.get("bytes") != os.path.getsize(ws["corpus_path"]):
            corpus = None
    except (OSError, ValueError):
        corpus = None
    if corpus is None:
        remove(ws["meta_path"])
        print(f"generating {exp.corpus_mb:g} MB of perturbed stdlib copies into "
              f"{ws['corpus_path']} ...", flush=True)
        ws["generated"] = True
        corpus = {**wanted, **generate_corpus(ws["corpus_path"], target_bytes, exp.seed)}
        with open(ws["meta_path"], "w") as f:
            json.dump(corpus, f, indent=2)
    print(f"corpus {ws['corpus_path']}: {corpus['bytes'] / MB:,.1f} MB, "
          f"{corpus['documents']:,} documents from {corpus['copies']} perturbed "
          f"cop{'y' if corpus['copies'] == 1 else 'ies'} (the last one partial) of "
          f"{corpus['stdlib_files']:,} stdlib files"
          + (f", generated in {corpus['generate_s']:.1f} s" if ws["generated"] else
             " (reused)"), flush=True)
    ws["corpus"] = corpus


def measure(run: RowRun) -> list[dict]:
    """The row's tokenize row and loader rows; a failed tokenizing process is the row's status
    (exit code 1 after the report)."""
    exp, ws, spec = run.cfg.experiment, run.shared, run.row.label
    the_corpus(exp, ws)
    cache_dir = os.path.join(ws["work_dir"], run.row.fields["cache"])
    ws["caches"].append(cache_dir)
    try:
        row = tokenize_row(exp, spec, ws["corpus_path"], cache_dir)
    except ChildFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return [{"part": "tokenize", "tokenizer": spec, "status": f"failed: {e}"}]
    return [row, *loader_rows(exp, spec, ws["corpus_path"], cache_dir,
                              row["tokenizer_file"] or spec)]


def clean_up(cfg: CorpusScaleConfig, ws: dict) -> dict:
    """Without --keep: delete the caches, and the corpus if this run generated it; the meta's
    keys on the corpus."""
    if not cfg.experiment.keep:
        removed = sum(remove(c) for c in ws["caches"])
        if ws["generated"]:
            removed += remove(ws["corpus_path"]) + remove(ws["meta_path"])
        what = "the generated corpus and " if ws["generated"] else ""
        print(f"removed {what}the tokenized caches ({removed:,.0f} MB); --keep keeps them",
              flush=True)
        if ws["created"]:
            try:
                os.rmdir(ws["work_dir"])          # only if empty
            except OSError:
                pass
    return {"corpus": ws["corpus"], "corpus_path": ws["corpus_path"],
            "corpus_generated": ws["generated"], "kept": cfg.experiment.keep}


def tables(cfg: CorpusScaleConfig, rows: list[dict], meta: dict) -> list:
    exp, corpus = cfg.experiment, meta["corpus"] or {"bytes": 0}
    return [(f"Tokenizing {corpus['bytes'] / MB:,.1f} MB of JSONL, each tokenizer in a fresh "
             f"process with a fresh cache, {exp.tokenize_batch_mb:g} MB of text at a time, "
             f"{meta['cpus']} cores", [r for r in rows if r["part"] == "tokenize"],
             TOKENIZE_COLUMNS),
            (f"Loader: pack, {exp.batch_size} x {exp.seq_len}, up to {exp.loader_batches:,} "
             f"batches on one thread; mmap cold after dropping the token file's cached pages, "
             f"warm after the cold pass read them", [r for r in rows if r["part"] == "loader"],
             LOADER_COLUMNS)]


def conclude(cfg: CorpusScaleConfig, rows: list[dict]) -> list[str]:
    corpus_mb, lines = cfg.experiment.corpus_mb, []
    scale = ("" if corpus_mb >= TARGET_CORPUS_MB else
             f" (measured on {corpus_mb:g} MB; the target is for {TARGET_CORPUS_MB} MB)")
    ran = [r for r in rows if "status" not in r]
    for r in (r for r in ran if r["part"] == "tokenize"):
        library = ("" if r["tokenizer_file"] else
                   " (bytes needs no tokenizers library: for reference)")
        lines.append(f"tokenizing >= {TOKENIZE_MB_PER_S:g} MB/s of text, {r['tokenizer']}: "
                     f"{r['mb_per_s']:.1f} MB/s on {r['cores_used']:.2f} busy cores: "
                     f"{r['speed_target']}{library}")
        lines.append(f"peak RSS <= 1.5 GB, {r['tokenizer']}: {r['peak_rss_mb']:,.0f} MB: "
                     f"{r['memory_target']}{scale}")
    return lines + [f">= {LOADER_TOKENS_PER_S / 1e6:g} M real tokens/s per core with packing, "
                    f"{r['tokenizer']} {r['source']}: {r['tokens_per_s'] / 1e6:.2f} M/s "
                    f"({r['vs_memory']:.2f}x the in-memory pass): {r['loader_target']}"
                    for r in ran if r["part"] == "loader" and r["source"].startswith("mmap")]


def meta(cfg: CorpusScaleConfig, rows: list[dict]) -> dict:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"settings": dataclasses.asdict(cfg.experiment), "cpus": cpus,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
            "targets": {"tokenize_mb_per_s": TOKENIZE_MB_PER_S,
                        "tokenize_peak_bytes": TOKENIZE_PEAK_BYTES,
                        "target_corpus_mb": TARGET_CORPUS_MB,
                        "loader_tokens_per_s_per_core": LOADER_TOKENS_PER_S}}


EXPERIMENT = Experiment(
    name="corpus_scale", doc=__doc__, config=CorpusScaleConfig, rows=rows, columns=[],
    setup=lambda cfg: f"Corpus scale: {cfg.experiment.corpus_mb:g} MB of text",
    trains=False, row_flags={"data.tokenizer": "experiment.tokenizers"},   # a bad spec's flag
    shared=workspace, measure=measure, finish=clean_up, tables=tables,
    conclude=conclude, meta=meta, failed=lambda rows: any("status" in r for r in rows))
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
