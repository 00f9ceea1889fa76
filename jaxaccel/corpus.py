"""Text corpora as tokenized documents, split into train and validation by file.

A source is one of

* ``"stdlib"``: the Python files of the running interpreter's standard library, one document
  per top-level function or class and one for the rest of each module. It is on every machine,
  so experiments run anywhere without a download.
* a directory: every regular file under it that is utf-8 text is one document.
* a ``.jsonl`` file: one document per line, from the line's ``"text"`` field.

Documents are stored as BOS + bytes + EOS token arrays (see ``tokenizer``), all views into one
buffer. The split is a stable hash of each document's file (or JSONL line), so a file never
contributes to both train and validation, and the split does not depend on the order of files.

Tokenized documents are cached in one ``.npz`` per source (before the split, which is cheap to
redo for any ``val_percent``). The cache key is the interpreter version for ``stdlib`` and the
resolved path plus the size and mtime of every file for a path source, so an edited corpus is
re-read. The cache lives in ``cache_dir``, else ``$JAXACCEL_CACHE_DIR``, else ``~/.cache/jaxaccel``.
"""

import ast
import dataclasses
import functools
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from jaxaccel.errors import ConfigError
from jaxaccel.tokenizer import BOS_ID, BYTE_OFFSET, EOS_ID, ByteTokenizer

CACHE_FORMAT_VERSION = 1
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "__pycache__"})
_SOURCES_HELP = "pass 'stdlib', a directory of text files or a .jsonl file"

# (split key, document bytes) pairs as a reader produces them; the key names the file or line.
KeyedDocs = list[tuple[str, bytes]]


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Tokenized documents of one source, split into train and validation.

    Attributes:
      name: the source as given to ``load_corpus``.
      train, val: int32 token arrays, BOS + bytes + EOS of one document each (read-only views).
      stats: counts of files, documents and tokens, including everything skipped.
      train_sources, val_sources: the file (or JSONL line number) of each document, in order.
    """

    name: str
    train: list[np.ndarray]
    val: list[np.ndarray]
    stats: dict
    train_sources: tuple[str, ...]
    val_sources: tuple[str, ...]
    fingerprint: str = ""     # of the documents' names and lengths: a resume checks it

    def unigram_bits_per_token(self) -> float:
        """Entropy in bits of the unigram distribution of the train split's target tokens.

        Targets are every token but BOS. A model that has learned nothing beyond token
        frequencies reaches this loss, so it is the baseline the training loss must beat.
        """
        counts_V = np.zeros(ByteTokenizer.vocab_size, dtype=np.int64)
        for doc in self.train:
            counts_V += np.bincount(doc[1:], minlength=ByteTokenizer.vocab_size)
        p_V = counts_V[counts_V > 0] / counts_V.sum()
        return float(-(p_V * np.log2(p_V)).sum())


class _Tokenized(NamedTuple):
    """All N documents of a source in one buffer: what the cache stores."""

    tokens: np.ndarray  # int32, documents back to back
    offsets: np.ndarray  # int64 [N + 1], document n is tokens[offsets[n]:offsets[n + 1]]
    key_index_N: np.ndarray  # int32, index into keys of each document's split key
    keys: list[str]
    stats: dict


def load_corpus(
    source: str = "stdlib", *, cache_dir: str | None = None, val_percent: float = 2.0
) -> Corpus:
    """Loads, tokenizes (or reads from the cache) and splits the corpus named by ``source``.

    Args:
      source: ``"stdlib"``, a directory of text files or a ``.jsonl`` file with a ``text`` field.
      cache_dir: where tokenized corpora are cached (see the module docstring for the default).
      val_percent: the percentage of files (JSONL: lines) that go to the validation split.
    """
    if not 0 < val_percent < 100:
        raise ConfigError(f"val_percent must be in (0, 100), got {val_percent}; pass e.g. 2")
    read, signature = _resolve_source(source)
    signature = {"format": CACHE_FORMAT_VERSION, **signature}
    cache_path = _cache_root(cache_dir) / f"corpus-{_digest(signature)}.npz"
    tokenized = _read_cache(cache_path, signature)
    if tokenized is None:
        keyed_docs, stats = read()
        tokenized = _tokenize(keyed_docs, stats)
        _write_cache(cache_path, signature, tokenized)
    return _split(source, tokenized, val_percent)


def _resolve_source(source: str) -> tuple[Callable[[], tuple[KeyedDocs, dict]], dict]:
    """Returns the reader for ``source`` and the signature that keys its cache entry."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        signature = {
            "source": "stdlib",
            "root": str(root),
            "python": list(sys.version_info),
            "cache_tag": sys.implementation.cache_tag,
        }
        return functools.partial(_read_stdlib, root), signature
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"data path {source} does not exist; {_SOURCES_HELP}", field="data.path")
    path = path.resolve()
    if path.is_dir():
        skipped = {}
        rel_paths = _directory_files(path, skipped=skipped)
        files = [[rel, *_size_and_mtime(path / rel)] for rel in rel_paths]
        signature = {"source": "directory", "root": str(path), "files": files,
                     "skipped": skipped}
        return functools.partial(_read_directory, path, rel_paths, skipped), signature
    if path.is_file() and path.suffix == ".jsonl":
        signature = {"source": "jsonl", "path": str(path), "file": _size_and_mtime(path)}
        return functools.partial(_read_jsonl, path), signature
    raise ConfigError(
        f"data path {source} is neither a directory nor a .jsonl file; {_SOURCES_HELP}",
        field="data.path",
    )


def _size_and_mtime(path: Path) -> list[int]:
    """The cheap signature of a file's content: an edit changes its size or its mtime."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _read_stdlib(root: Path) -> tuple[KeyedDocs, dict]:
    """Splits every standard library module into its top-level definitions and the rest."""
    rel_paths = _directory_files(root, skip_dirs=_STDLIB_SKIP_DIRS)
    rel_paths = [rel for rel in rel_paths if rel.endswith(".py")]
    keyed_docs, unparsable = [], 0
    for rel in rel_paths:
        source = (root / rel).read_bytes()
        docs = _module_documents(source)
        if docs is None:
            unparsable += 1
            docs = [source]
        keyed_docs += [(rel, doc) for doc in docs]
    return keyed_docs, _reader_stats(len(rel_paths), unparsable=unparsable)


def _module_documents(source: bytes) -> list[bytes] | None:
    """The module's top-level lines outside definitions, then each definition with its decorators.

    Works on the file's bytes, so every byte lands in exactly one document and non-utf-8
    files keep their bytes. Returns None when the file is not valid Python for this interpreter.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for invalid escapes in test data
            tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return None
    lines = source.splitlines(keepends=True)  # \n, \r\n and \r: the line ends ast counts
    in_definition = [False] * len(lines)
    definitions = []
    for node in tree.body:
        if isinstance(node, _DEFINITIONS):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            definitions.append(b"".join(lines[first : node.end_lineno]))
            in_definition[first : node.end_lineno] = [True] * (node.end_lineno - first)
    rest = b"".join(line for line, used in zip(lines, in_definition) if not used)
    return [rest] + definitions


def _directory_files(root: Path, skip_dirs: frozenset[str] = frozenset(),
                     skipped: dict | None = None) -> list[str]:
    """Paths, relative to root and sorted, of every regular file under root outside skip_dirs.
    Folders that cannot be listed and symlinked folders (not followed: no cycles, no file read
    twice) are counted in ``skipped`` (``unreadable_dirs_skipped``, ``symlinked_dirs_skipped``)."""
    skipped = {} if skipped is None else skipped
    skipped.setdefault("unreadable_dirs_skipped", 0)
    skipped.setdefault("symlinked_dirs_skipped", 0)

    def unreadable(error):
        skipped["unreadable_dirs_skipped"] += 1

    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        skipped["symlinked_dirs_skipped"] += len(links)
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and d not in links]
        rel_paths += [
            Path(dirpath, f).relative_to(root).as_posix()
            for f in filenames
            if Path(dirpath, f).is_file()
        ]
    return sorted(rel_paths)


def _read_directory(root: Path, rel_paths: list[str], skipped: dict | None = None
                    ) -> tuple[KeyedDocs, dict]:
    """One document per file that is utf-8 text; other files are counted and skipped, as are
    the folders ``_directory_files`` could not or would not enter (``skipped``)."""
    keyed_docs, undecodable = [], 0
    for rel in rel_paths:
        try:
            data = (root / rel).read_bytes()
        except OSError as e:
            raise ConfigError(
                f"cannot read {root / rel}: {e.strerror}; "
                f"fix its permissions or move it out of {root}"
            ) from e
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            undecodable += 1
            continue
        keyed_docs.append((rel, data))
    return keyed_docs, {**_reader_stats(len(rel_paths), undecodable=undecodable),
                        **(skipped or {})}


def _read_jsonl(path: Path) -> tuple[KeyedDocs, dict]:
    """One document per line, from its ``text`` field; a blank line is an empty document."""
    keyed_docs = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                keyed_docs.append((str(lineno), b""))
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ConfigError(
                    f"{path} line {lineno} is not valid JSON ({getattr(e, 'msg', e)}); "
                    'write one JSON object per line, like {"text": "..."}'
                ) from e
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(
                    f'{path} line {lineno} has no string "text" field; '
                    'write one JSON object per line, like {"text": "..."}'
                )
            keyed_docs.append((str(lineno), text.encode("utf-8", errors="replace")))
    return keyed_docs, _reader_stats(1)


def _reader_stats(files: int, *, unparsable: int = 0, undecodable: int = 0) -> dict:
    """The counters every reader reports, so that stats have the same keys for every source."""
    return {
        "files": files,
        "unparsable_files": unparsable,
        "undecodable_files_skipped": undecodable,
        "unreadable_dirs_skipped": 0,
        "symlinked_dirs_skipped": 0,
    }


SKIP_REASONS = {"undecodable_files_skipped": "files not UTF-8 text",
                "unreadable_dirs_skipped": "folders that could not be listed",
                "symlinked_dirs_skipped": "symlinked folders (not followed)"}


def skipped_inputs(stats: dict) -> dict[str, int]:
    """What a corpus source left out, by reason (only the reasons that occurred)."""
    return {reason: int(stats.get(key, 0)) for key, reason in SKIP_REASONS.items()
            if stats.get(key, 0)}


def _tokenize(keyed_docs: KeyedDocs, stats: dict) -> _Tokenized:
    """Packs the non-blank documents as BOS + bytes + EOS into one int32 buffer."""
    kept = [(key, doc) for key, doc in keyed_docs if doc.strip()]
    stats = {**stats, "empty_documents_skipped": len(keyed_docs) - len(kept)}
    lengths_N = np.array([len(doc) + 2 for _, doc in kept], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths_N)]).astype(np.int64)
    tokens = np.empty(offsets[-1], dtype=np.int32)
    is_byte = np.ones(len(tokens), dtype=bool)
    is_byte[offsets[:-1]] = is_byte[offsets[1:] - 1] = False
    tokens[offsets[:-1]] = BOS_ID
    tokens[offsets[1:] - 1] = EOS_ID
    byte_values = np.frombuffer(b"".join(doc for _, doc in kept), dtype=np.uint8)
    tokens[is_byte] = byte_values.astype(np.int32) + BYTE_OFFSET
    key_ids: dict[str, int] = {}
    key_index_N = np.array(
        [key_ids.setdefault(key, len(key_ids)) for key, _ in kept], dtype=np.int32
    )
    return _Tokenized(tokens, offsets, key_index_N, list(key_ids), stats)


def _split(name: str, tokenized: _Tokenized, val_percent: float) -> Corpus:
    """Assigns each document to train or validation by the hash of its split key."""
    tokens, offsets, key_index_N, keys, stats = tokenized
    stats = dict(stats)
    if len(key_index_N) == 0:
        left_out = ", ".join(f"{n} {r}" for r, n in skipped_inputs(stats).items())
        raise ConfigError(
            f"corpus {name} has no non-empty documents"
            + (f" (skipped: {left_out})" if left_out else "")
            + f"; {_SOURCES_HELP} with some text in it",
            field="data.path",
        )
    tokens.flags.writeable = False
    key_is_val = np.array([_is_val_key(key, val_percent) for key in keys], dtype=bool)
    is_val_N = key_is_val[key_index_N]
    splits = {}
    for split, ids in (("train", np.flatnonzero(~is_val_N)), ("val", np.flatnonzero(is_val_N))):
        if len(ids) == 0:
            raise ConfigError(
                f"corpus {name} has no {split} documents ({val_percent:g}% of its files, or "
                f"JSONL lines, go to validation): pass a corpus with more files or lines",
                field="data.path"
            )
        docs = [tokens[offsets[n] : offsets[n + 1]] for n in ids]
        stats[f"{split}_documents"] = len(ids)
        stats[f"{split}_tokens"] = int((offsets[ids + 1] - offsets[ids]).sum())
        splits[split] = (docs, tuple(keys[k] for k in key_index_N[ids]))
    (train, train_sources), (val, val_sources) = splits["train"], splits["val"]
    fingerprint = hashlib.sha256(np.asarray(offsets, dtype=np.int64).tobytes() + "\n".join(
        keys).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return Corpus(name, train, val, stats, train_sources, val_sources, fingerprint)


def _is_val_key(key: str, val_percent: float) -> bool:
    """Stable pseudo-random choice: the same key lands in the same split on every machine."""
    h = int.from_bytes(hashlib.sha1(key.encode("utf-8", "surrogateescape")).digest()[:8], "big")
    return h % 10000 < val_percent * 100


def _cache_root(cache_dir: str | None) -> Path:
    """The cache directory: the argument, else $JAXACCEL_CACHE_DIR, else ~/.cache/jaxaccel."""
    root = cache_dir or os.environ.get("JAXACCEL_CACHE_DIR") or "~/.cache/jaxaccel"
    return Path(root).expanduser()


def _digest(signature: dict) -> str:
    """A short stable name for a cache entry."""
    return hashlib.sha1(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:20]


def _read_cache(path: Path, signature: dict) -> _Tokenized | None:
    """The cached tokenized corpus, or None if it is missing, stale or corrupt."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            if json.loads(str(npz["signature"])) != signature:
                return None
            tokenized = _Tokenized(
                npz["tokens"].astype(np.int32),
                npz["offsets"],
                npz["key_index"],
                npz["keys"].tolist(),
                json.loads(str(npz["stats"])),
            )
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    offsets = tokenized.offsets
    consistent = (
        offsets.ndim == 1
        and len(offsets) == len(tokenized.key_index_N) + 1
        and offsets[0] == 0
        and offsets[-1] == len(tokenized.tokens)
        and bool(np.all(np.diff(offsets) >= 3))
    )
    return tokenized if consistent else None


def _write_cache(path: Path, signature: dict, tokenized: _Tokenized) -> None:
    """Writes the cache entry atomically; failing to write only costs speed, so it warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    signature=np.array(json.dumps(signature, sort_keys=True)),
                    tokens=tokenized.tokens.astype(np.uint16),
                    offsets=tokenized.offsets,
                    key_index=tokenized.key_index_N,
                    keys=np.array(tokenized.keys, dtype=np.str_),
                    stats=np.array(json.dumps(tokenized.stats)),
                )
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        warnings.warn(f"could not write corpus cache {path}: {e}; the next load re-reads the data")
