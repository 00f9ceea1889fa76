"""Text corpora as tokenized documents on disk, split into train and validation by file.

A source is ``"stdlib"`` (the running interpreter's standard library, a document per top-level
function or class and one for the rest of each module: no download needed), a directory (a
document per utf-8 text file), a ``.jsonl`` file (a document per line, its ``text_column``), or
Parquet files or a saved Hugging Face dataset (a document per row, ``jaxaccel.data.sources``).

A source is tokenized once (BOS + ids + EOS per document), streaming and resumably, into a cache
folder per source and tokenizer (``cache_root``): memory-mapped tokens (uint16 or uint32) and
each document's length, text bytes and split key. ``Documents`` view the mapping, so a corpus may
exceed memory. The split hashes each document's file (JSONL line, table row), and moves one
file if that left a split empty: >= 2 files always give both splits. ``bpe:N``
tokenizers are trained on the train split and cached there too (``load_tokenizer``)."""

import ast
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import itertools
import json
import math
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Callable

import numpy as np

from jaxaccel.data import sources
from jaxaccel.core import tokenizer as tok_lib
from jaxaccel.core.errors import ConfigError

CACHE_FORMAT_VERSION = 2
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "__pycache__"})
_SOURCES_HELP = ("pass 'stdlib', a directory of text files, a .jsonl file, Parquet files or a "
                 "Hugging Face dataset saved to disk")
_DOC_ARRAYS = ("lengths", "text_bytes", "key_index")     # int64 per document, a file each
_UNIGRAM_CHUNK = 1 << 24          # tokens counted at once by the unigram baseline


class Documents(Sequence):
    """Documents of a corpus: document i is a read-only view of its tokens in one buffer."""

    def __init__(self, tokens: np.ndarray, starts_N: np.ndarray, lengths_N: np.ndarray):
        self.tokens, self.starts, self.lengths = tokens, starts_N, lengths_N

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Documents(self.tokens, self.starts[i], self.lengths[i])
        start = int(self.starts[i])         # raises IndexError past the end, as lists do
        return self.tokens[start : start + int(self.lengths[i])]

    def __add__(self, other: "Documents") -> list:
        return list(self) + list(other)


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Source ``name``'s ``train`` and ``val`` ``Documents``, ``stats`` and resume fingerprint."""

    name: str
    train: Documents
    val: Documents
    stats: dict
    tokenizer: object
    fingerprint: str
    _keys: Callable[[], list[str]]      # every split key, read from the cache when asked for
    _key_index: dict                    # split -> int64 [N], each document's key

    @property
    def train_sources(self) -> tuple[str, ...]:
        """The file (JSONL line, table row) of each train document, in order."""
        return tuple(map(self._keys().__getitem__, self._key_index["train"]))

    @property
    def val_sources(self) -> tuple[str, ...]:
        """The same for the validation documents."""
        return tuple(map(self._keys().__getitem__, self._key_index["val"]))

    def bits_per_byte(self, nats_per_target: float, split: str = "val") -> float:
        """A mean loss in nats per target token of ``split`` as bits per byte of its text."""
        return tok_lib.bits_per_byte(nats_per_target, self.stats[f"{split}_targets"],
                                     self.stats[f"{split}_text_bytes"])

    def unigram_bits_per_token(self) -> float:
        """Entropy in bits of the train targets' unigram distribution: the baseline loss to beat."""
        counts_V = np.zeros(self.tokenizer.vocab_size, dtype=np.int64)
        pieces, size = [], 0
        for i, doc in enumerate(self.train):
            pieces.append(doc[1:])
            size += len(doc)
            if size >= _UNIGRAM_CHUNK or i == len(self.train) - 1:
                counts_V += np.bincount(np.concatenate(pieces), minlength=len(counts_V))
                pieces, size = [], 0
        p_V = counts_V[counts_V > 0] / counts_V.sum()
        return float(-(p_V * np.log2(p_V)).sum())

    def unigram_bits_per_byte(self) -> float:
        """The unigram baseline in bits per byte of the train split's text."""
        return self.bits_per_byte(self.unigram_bits_per_token() * math.log(2), "train")


def load_corpus(source: str = "stdlib", *, tokenizer: str = "bytes", cache_dir: str | None = None,
                val_percent: float = 2.0, text_column: str = "text", split: str | None = None,
                tokenize_batch_mb: float = 16.0) -> Corpus:
    """Loads, tokenizes (or reads from the cache) and splits the corpus ``source`` (module
    docstring). ``val_percent``: the percentage of files (JSONL lines, rows) for validation;
    ``split``: of a saved ``DatasetDict`` (default: train, or its only split)."""
    if not 0 < val_percent < 100:
        raise ConfigError(f"val_percent must be in (0, 100), got {val_percent}; pass e.g. 2")
    if not tokenize_batch_mb > 0:
        raise ConfigError(f"tokenize_batch_mb must be > 0, got {tokenize_batch_mb}; pass e.g. "
                          f"16", field="data.tokenize_batch_mb")
    read, signature = _resolve_source(source, text_column, split)
    root = cache_root(cache_dir)
    tok = load_tokenizer(tokenizer, read, signature, root, val_percent)
    signature = {"format": CACHE_FORMAT_VERSION, "tokenizer": tok.fingerprint, **signature}
    entry = root / f"corpus-{_digest(signature)}"
    cached = _open_cache(entry, signature, tok.vocab_size)
    if cached is None:
        with _locked(entry / ".lock"):     # one process tokenizes, the others read its entry
            cached = _open_cache(entry, signature, tok.vocab_size)
            if cached is None:
                _tokenize(read, tok, entry, signature, int(tokenize_batch_mb * 2**20))
                cached = _open_cache(entry, signature)
    if cached is None:
        raise ConfigError(f"the corpus cache {entry} could not be read back after tokenizing; "
                          f"check the disk, or pass another --cache-dir", field="data.cache_dir")
    return _split(source, tok, cached, val_percent)


@contextlib.contextmanager
def _locked(path: Path):
    """Holds an exclusive lock on the file ``path`` (processes of one run share the cache)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a")
    except OSError as e:
        raise ConfigError(f"cannot write the corpus cache {path.parent}: {e.strerror}; pass "
                          f"--cache-dir with a writable folder", field="data.cache_dir") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield       # closing the file releases the lock, on an error too


def corpus_of(data) -> Corpus:
    """The corpus of a ``DataConfig``: its path, tokenizer, cache and text settings."""
    return load_corpus(data.path, tokenizer=data.tokenizer or "bytes", cache_dir=data.cache_dir,
                       text_column=data.text_column, split=data.split,
                       tokenize_batch_mb=data.tokenize_batch_mb)


def load_tokenizer(spec: str, read: Callable[[dict], Iterator[sources.Doc]], signature: dict,
                   root: Path, val_percent: float):
    """The tokenizer ``spec`` names; ``bpe:N`` is trained on the train split once and cached."""
    kind, value = tok_lib.parse_spec(spec)
    if kind == "bytes":
        return tok_lib.ByteTokenizer()
    if kind == "file":
        return tok_lib.open_file(value, spec)
    import tokenizers
    key = {"source": signature, "vocab": value, "val_percent": val_percent,
           "tokenizers": tokenizers.__version__}
    path = root / f"tokenizer-bpe{value}-{_digest(key)}.json"
    if not path.is_file():
        with _locked(root / f"{path.stem}.lock"):        # one process trains it
            if not path.is_file():
                texts = (doc.decode("utf-8", errors="replace") for key, doc in read({})
                         if doc.strip() and not _is_val(_key_hash(key), val_percent))
                tok_lib.train_bpe(texts, value, str(path))
    return tok_lib.HFTokenizer(str(path), spec)


def _resolve_source(source: str, text_column: str, split: str | None
                    ) -> tuple[Callable[[dict], Iterator[sources.Doc]], dict]:
    """The reader for ``source`` (yields documents, fills the stats given) and its cache key."""
    if source == "stdlib":
        root = stdlib_root()
        signature = {"source": "stdlib", "root": str(root), "python": list(sys.version_info),
                     "cache_tag": sys.implementation.cache_tag}
        return functools.partial(_read_stdlib, root), signature
    try:        # a path that cannot be listed, opened or looked into is one line, not a traceback
        return _resolve_path(source, Path(source).expanduser(), text_column, split)
    except OSError as e:
        raise ConfigError(f"cannot read data path {e.filename or source}: "
                          f"{e.strerror or sources.one_line(e)}; fix its permissions or pass "
                          f"another --data", field="data.path") from e


def _resolve_path(source: str, given: Path, text_column: str, split: str | None):
    """``_resolve_source`` for a path: a file's suffix may be the link's or its target's."""
    if not given.exists():
        raise ConfigError(f"data path {source} does not exist; "
                          f"{sources.hub_name_hint(source) or _SOURCES_HELP}", field="data.path")
    path = given.resolve()
    if path.is_dir():
        with os.scandir(path):      # can it be listed?
            pass
    else:
        path.open("rb").close()     # can it be read?
    kind = sources.kind_of(given)
    if kind is not None:
        signature = sources.signature(path, kind, text_column, split)
        return functools.partial(_read_table, path, kind, text_column, split), signature
    if path.is_dir():
        skipped = {}
        rel_paths = _directory_files(path, skipped=skipped)
        files = [[rel, *sources.size_and_mtime(path / rel)] for rel in rel_paths]
        signature = {"source": "directory", "root": str(path), "files": files, "skipped": skipped}
        return functools.partial(_read_directory, path, rel_paths, skipped), signature
    if path.is_file() and ".jsonl" in (given.suffix, path.suffix):
        signature = {"source": "jsonl", "path": str(path), "file": sources.size_and_mtime(path),
                     "column": text_column}
        return functools.partial(_read_jsonl, path, text_column), signature
    raise ConfigError(f"data path {source} is neither a directory, a .jsonl file nor a .parquet "
                      f"file; {_SOURCES_HELP}", field="data.path")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """The stdlib's Python files outside site-packages and __pycache__, relative to root, sorted."""
    return [rel for rel in _directory_files(root, skip_dirs=_STDLIB_SKIP_DIRS)
            if rel.endswith(".py")]


def _read_stdlib(root: Path, stats: dict) -> Iterator[sources.Doc]:
    """Splits every standard library module into its top-level definitions and the rest."""
    rel_paths = stdlib_files(root)
    stats.update(_reader_stats(len(rel_paths)))
    for rel in rel_paths:
        source = (root / rel).read_bytes()
        docs = _module_documents(source)
        stats["unparsable_files"] += docs is None
        for doc in docs or [source]:
            yield rel, doc


def _module_documents(source: bytes) -> list[bytes] | None:
    """The module's top-level lines outside definitions, then each definition with its
    decorators: every byte lands in one document. None when the file is not valid Python."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for invalid escapes in test data
            tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return None
    lines = source.splitlines(keepends=True)  # \n, \r\n and \r: the line ends ast counts
    rest, definitions, end = [], [], 0
    for node in tree.body:
        if isinstance(node, _DEFINITIONS):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            rest += lines[end:first]
            definitions.append(b"".join(lines[first : node.end_lineno]))
            end = node.end_lineno
    return [b"".join(rest + lines[end:])] + definitions


def _directory_files(root: Path, skip_dirs: frozenset[str] = frozenset(),
                     skipped: dict | None = None) -> list[str]:
    """Paths, relative to root and sorted, of every regular file under root outside skip_dirs.
    Folders that cannot be listed and symlinked ones (not followed) are counted in ``skipped``."""
    skipped = {} if skipped is None else skipped
    skipped.update(unreadable_dirs_skipped=0, symlinked_dirs_skipped=0)

    def unreadable(error):
        skipped["unreadable_dirs_skipped"] += 1

    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        skipped["symlinked_dirs_skipped"] += len(links)
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and d not in links]
        rel_paths += [Path(dirpath, f).relative_to(root).as_posix() for f in filenames
                      if Path(dirpath, f).is_file()]
    return sorted(rel_paths)


def _read_directory(root: Path, rel_paths: list[str], skipped: dict, stats: dict
                    ) -> Iterator[sources.Doc]:
    """One document per file that is utf-8 text; other files are counted and skipped."""
    stats.update(_reader_stats(len(rel_paths)), **skipped)
    for rel in rel_paths:
        try:
            data = (root / rel).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read {root / rel}: {e.strerror}; fix its permissions or "
                              f"move it out of {root}", field="data.path") from e
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            stats["undecodable_files_skipped"] += 1
            continue
        yield rel, data


def _read_jsonl(path: Path, column: str, stats: dict) -> Iterator[sources.Doc]:
    """One document per line, from its ``column`` field; a blank line is an empty document. A
    lone surrogate (``"\\ud800"``), which is no character, is written as "?" and counted."""
    stats.update(_reader_stats(1))
    example = f'write one JSON object per line, like {{"{column}": "..."}}'
    try:
        f = path.open("rb")
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}; fix its permissions or pass "
                          f"another --data", field="data.path") from e
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                yield str(lineno), b""
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{path} line {lineno} is not valid JSON "
                                  f"({getattr(e, 'msg', e)}); {example}", field="data.path") from e
            except RecursionError as e:
                raise ConfigError(f"{path} line {lineno} is not valid JSON (nested too deeply "
                                  f"to parse); {example}", field="data.path") from e
            text = record.get(column) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f'{path} line {lineno} has no string "{column}" field; '
                                  f'{example}, or pass --text-column NAME',
                                  field="data.text_column")
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError:
                stats["lone_surrogates_replaced"] += sum(0xD800 <= ord(c) < 0xE000 for c in text)
                data = text.encode("utf-8", errors="replace")
            yield str(lineno), data


def _read_table(path: Path, kind: str, column: str, split: str | None, stats: dict
                ) -> Iterator[sources.Doc]:
    """One document per row of a Parquet or saved Hugging Face dataset
    (``jaxaccel.data.sources``)."""
    table_stats = {}
    docs = sources.documents(path, kind, column, table_stats, split)
    stats.update(_reader_stats(table_stats["files"]))
    yield from docs


def _reader_stats(files: int) -> dict:
    """The counters every reader reports, so that stats have the same keys for every source."""
    return {"files": files, "unparsable_files": 0, "undecodable_files_skipped": 0,
            "unreadable_dirs_skipped": 0, "symlinked_dirs_skipped": 0,
            "lone_surrogates_replaced": 0}


SKIP_REASONS = {"undecodable_files_skipped": "files not UTF-8 text",
                "unreadable_dirs_skipped": "folders that could not be listed",
                "symlinked_dirs_skipped": "symlinked folders (not followed)",
                "lone_surrogates_replaced": "lone surrogates in JSONL text (each written as '?')"}


def skipped_inputs(stats: dict) -> dict[str, int]:
    """What a corpus source left out, by reason (only the reasons that occurred)."""
    return {reason: int(stats.get(key, 0)) for key, reason in SKIP_REASONS.items()
            if stats.get(key, 0)}


# The cache entry: tokenize once, streaming, resumable; open as memory maps.

def _token_dtype(tok) -> np.dtype:
    """The smallest unsigned dtype that holds every id the tokenizer makes."""
    return np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)


def _tokenize(read: Callable[[dict], Iterator[sources.Doc]], tok, entry: Path, signature: dict,
              batch_bytes: int) -> None:
    """Tokenizes the source into ``entry``, ``batch_bytes`` at a time, resuming per progress."""
    progress = _read_progress(entry, signature)
    if progress is None or progress["done"] or not _holds(entry, progress):
        progress = {"signature": signature, "dtype": _token_dtype(tok).name, "raw_docs": 0,
                    "docs": 0, "tokens": 0, "keys": 0, "keys_bytes": 0, "empty": 0,
                    "last_key": None, "done": False}
    dtype = np.dtype(progress["dtype"])
    # Cut every file back to the recorded progress: what a stopped run wrote after it is redone.
    for name, size in _recorded_sizes(progress).items():
        with open(entry / name, "ab") as f:
            f.truncate(size)
    files = {name: open(entry / f"{name}.bin", "ab") for name in ("tokens", *_DOC_ARRAYS)}
    files["keys"] = open(entry / "keys.jsonl", "ab")
    stats, batch, batch_size = {}, [], 0
    try:
        for key, doc in itertools.islice(read(stats), progress["raw_docs"], None):
            batch.append((key, doc))
            batch_size += len(doc)
            if batch_size >= batch_bytes:
                _append(batch, tok, dtype, files, progress, entry)
                batch, batch_size = [], 0
        _append(batch, tok, dtype, files, progress, entry, stats=stats)
    finally:
        for f in files.values():
            f.close()


def _append(batch: list[sources.Doc], tok, dtype, files: dict, progress: dict, entry: Path,
            stats: dict | None = None) -> None:
    """Tokenizes and appends a batch, records the progress; ``stats`` marks the entry complete."""
    kept = [(key, doc) for key, doc in batch if doc.strip()]
    progress["empty"] += len(batch) - len(kept)
    progress["raw_docs"] += len(batch)
    if kept:
        tokens, lengths_N = tok.encode_documents([doc for _, doc in kept])
        key_index_N = np.empty(len(kept), dtype=np.int64)
        for n, (key, _) in enumerate(kept):
            if key != progress["last_key"]:     # a file's documents come one after another
                line = (json.dumps(key) + "\n").encode()
                files["keys"].write(line)
                progress["keys"] += 1
                progress["keys_bytes"] += len(line)
                progress["last_key"] = key
            key_index_N[n] = progress["keys"] - 1
        files["tokens"].write(tokens.astype(dtype).tobytes())
        files["lengths"].write(lengths_N.tobytes())
        files["text_bytes"].write(np.array([len(doc) for _, doc in kept], np.int64).tobytes())
        files["key_index"].write(key_index_N.tobytes())
        progress["docs"] += len(kept)
        progress["tokens"] += len(tokens)
    for f in files.values():
        f.flush()
    if stats is not None:
        progress.update(done=True, stats={**stats, "empty_documents_skipped": progress["empty"]})
    tmp = entry / f"progress.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(progress))
    os.replace(tmp, entry / "progress.json")


def _read_progress(entry: Path, signature: dict) -> dict | None:
    """The entry's recorded progress, or None if it has none or is another source's."""
    try:
        progress = json.loads((entry / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    return progress if progress.get("signature") == signature else None


def _recorded_sizes(progress: dict) -> dict[str, int]:
    """The bytes each file of an entry held when ``progress`` was recorded."""
    return {"tokens.bin": progress["tokens"] * np.dtype(progress["dtype"]).itemsize,
            "keys.jsonl": progress["keys_bytes"],
            **{f"{name}.bin": progress["docs"] * np.dtype(np.int64).itemsize
               for name in _DOC_ARRAYS}}


def _holds(entry: Path, progress: dict) -> bool:
    """Whether every file holds at least what ``progress`` recorded (else it was damaged)."""
    try:
        return all((entry / name).stat().st_size >= size
                   for name, size in _recorded_sizes(progress).items())
    except OSError:
        return False


def _open_cache(entry: Path, signature: dict, vocab_size: int | None = None) -> dict | None:
    """A complete, consistent entry's arrays (tokens memory-mapped), else None. With
    ``vocab_size`` the values are checked too: ids out of range cannot come from an interrupted
    write, only from damage, which is refused (ConfigError) rather than read."""
    progress = _read_progress(entry, signature)
    if progress is None or not progress.get("done"):
        return None
    try:
        dtype, docs = np.dtype(progress["dtype"]), progress["docs"]
        arrays = {name: np.fromfile(entry / f"{name}.bin", dtype=np.int64) for name in _DOC_ARRAYS}
        size = (entry / "tokens.bin").stat().st_size
        if size != progress["tokens"] * dtype.itemsize or any(
                len(a) != docs for a in arrays.values()):
            return None
        # A plain array over the mapping: slicing an np.memmap costs ~10x a plain view's.
        tokens = (np.asarray(np.memmap(entry / "tokens.bin", dtype=dtype, mode="r")) if size
                  else np.zeros(0, dtype))
    except (OSError, ValueError, TypeError):
        return None
    lengths = arrays["lengths"]
    if lengths.sum() != progress["tokens"] or (docs and lengths.min() < 3):
        return None
    if vocab_size is not None and docs:
        largest, key_index = _largest_id(entry / "tokens.bin", dtype), arrays["key_index"]
        damage = (f"a token id of {largest}, where the tokenizer has {vocab_size} ids"
                  if largest >= vocab_size else "a document key out of range"
                  if key_index.min() < 0 or key_index.max() >= progress["keys"] else None)
        if damage:
            raise ConfigError(f"the corpus cache {entry} is damaged ({damage}); delete that "
                              f"folder to have it rebuilt, or pass another --cache-dir",
                              field="data.cache_dir")

    @functools.cache
    def keys() -> list[str]:
        with (entry / "keys.jsonl").open("rb") as f:
            return [json.loads(line) for line in f]

    return {"tokens": tokens, "stats": progress["stats"], "keys": keys,
            "key_hash": _key_hashes(entry, keys, progress["keys"]), **arrays}


def _largest_id(path: Path, dtype: np.dtype) -> int:
    """The largest id in a token file, read a chunk at a time (not mapped: memory stays flat)."""
    largest = 0
    with path.open("rb") as f:
        while (chunk := np.fromfile(f, dtype=dtype, count=_UNIGRAM_CHUNK)).size:
            largest = max(largest, int(chunk.max()))
    return largest


def _key_hashes(entry: Path, keys: Callable[[], list[str]], count: int) -> np.ndarray:
    """Each split key's hash (``_key_hash``), computed once and kept in the entry."""
    path = entry / "key_hash.npy"
    with contextlib.suppress(OSError, ValueError):
        hashes = np.load(path)
        if hashes.shape == (count,):
            return hashes
    hashes = np.array([_key_hash(key) for key in keys()], dtype=np.uint64)
    tmp = path.with_name(f"key_hash.{os.getpid()}.tmp.npy")
    try:
        np.save(tmp, hashes)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"could not write {path}: {e}; the next load hashes the keys again")
    return hashes


def _split(name: str, tok, cached: dict, val_percent: float) -> Corpus:
    """Assigns each document to train or validation by the hash of its split key."""
    stats, lengths = dict(cached["stats"]), cached["lengths"]
    if len(lengths) == 0:
        left_out = ", ".join(f"{n} {r}" for r, n in skipped_inputs(stats).items())
        raise ConfigError(f"corpus {name} has no non-empty documents"
                          + (f" (skipped: {left_out})" if left_out else "")
                          + f"; {_SOURCES_HELP} with some text in it", field="data.path")
    starts = np.cumsum(lengths) - lengths
    key_hash = cached["key_hash"]
    is_val_K = _is_val(key_hash, val_percent)
    if len(key_hash) >= 2 and is_val_K.all() == is_val_K.any():
        # The hash gave one split all the files (JSONL lines, rows): the file nearest to the
        # cut goes to the other one, so that >= 2 of them always make both splits. (A bpe:N
        # tokenizer was trained before this, on the split the hash made.)
        near = key_hash % 10000 - val_percent * 100
        is_val_K[np.argmax(near) if is_val_K.all() else np.argmin(near)] = not is_val_K.all()
    is_val_N = is_val_K[cached["key_index"]]
    splits, key_index = {}, {}
    for split, ids in (("train", np.flatnonzero(~is_val_N)), ("val", np.flatnonzero(is_val_N))):
        if len(ids) == 0:
            raise ConfigError(f"corpus {name} has no {split} documents ({val_percent:g}% of its "
                              f"files, JSONL lines or rows go to validation): pass a corpus with "
                              f"more of them", field="data.path")
        splits[split] = Documents(cached["tokens"], starts[ids], lengths[ids])
        key_index[split] = cached["key_index"][ids]
        stats[f"{split}_documents"] = len(ids)
        stats[f"{split}_tokens"] = int(lengths[ids].sum())
        stats[f"{split}_targets"] = int(lengths[ids].sum()) - len(ids)
        stats[f"{split}_text_bytes"] = int(cached["text_bytes"][ids].sum())
    fingerprint = hashlib.sha256(lengths.tobytes() + cached["key_hash"].tobytes()
                                 + tok.fingerprint.encode()).hexdigest()[:16]
    return Corpus(name, splits["train"], splits["val"], stats, tok, fingerprint,
                  cached["keys"], key_index)


def _key_hash(key: str) -> int:
    """A stable pseudo-random number per split key: the same on every machine."""
    return int.from_bytes(hashlib.sha1(key.encode("utf-8", "surrogateescape")).digest()[:8], "big")


def _is_val(key_hash, val_percent: float):
    """Whether the documents of a split key (or of each, for an array) go to validation."""
    return key_hash % 10000 < val_percent * 100


def cache_root(cache_dir: str | None) -> Path:
    """The cache directory: the argument, else $JAXACCEL_CACHE_DIR, else ~/.cache/jaxaccel."""
    root = cache_dir or os.environ.get("JAXACCEL_CACHE_DIR") or "~/.cache/jaxaccel"
    return Path(root).expanduser()


def _digest(signature: dict) -> str:
    """A short stable name for a cache entry."""
    return hashlib.sha1(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:20]
