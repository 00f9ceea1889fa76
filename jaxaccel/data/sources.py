"""Corpus readers for tables on disk, one document per row of a string column (``text_column``):
``"parquet"`` (a ``.parquet`` file or a directory holding them at any depth, read in order of
relative POSIX paths) and ``"hf_dataset"`` (a ``save_to_disk`` directory of a ``Dataset`` or a
``DatasetDict``, one split read). One record batch of ``BATCH_ROWS`` rows is held at a time,
documents sliced from its Arrow buffers, and all is checked before the first document is read.
Nothing is downloaded: ``datasets`` runs offline; a dataset name or loading script is refused
with how to save the dataset first. ``pyarrow`` and ``datasets`` are optional imports."""

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from jaxaccel.core.errors import ConfigError

Doc = tuple[str, bytes]     # (split key naming the file or split and the row, utf-8 document)

BATCH_ROWS = 1024                       # rows per record batch held in memory at once
_HF_DATASET_FILES = ("dataset_info.json", "state.json")
_HF_DICT_FILE = "dataset_dict.json"
# What a Hugging Face hub repository holds beside its loading script.
_HUB_REPO_EXTRAS = frozenset({"README.md", "dataset_infos.json", "dataset_info.json"})
_SIGNATURE_SUFFIXES = (".parquet", ".arrow", ".json")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _save_first(what: str) -> str:
    return (f"{what}; nothing is downloaded: save it with datasets.Dataset.save_to_disk or as "
            "Parquet first, and pass that path")


def hub_name_hint(source: str) -> str | None:
    """Advice for a missing data path that looks like a hub dataset name (``"allenai/c4"``)."""
    if (_HUB_NAME.fullmatch(source) is None or source.startswith(".")
            or Path(source).suffix in {".jsonl", ".parquet", ".json", ".txt", ".arrow"}):
        return None
    return _save_first(f"'{source}' looks like a Hugging Face dataset name")


def kind_of(path: Path) -> str | None:
    """``"parquet"``, ``"hf_dataset"`` (also for a hub repository holding only a loading script,
    which ``documents`` refuses with advice) or None: the kind of table source at ``path``. A
    file is Parquet by its name as given or, for a symlink, its target's."""
    path = Path(path)
    if path.is_file():
        return "parquet" if ".parquet" in (path.suffix, path.resolve().suffix) else None
    if not path.is_dir():
        return None
    if _is_saved_dataset(path) or _is_loading_script_repo(path):
        return "hf_dataset"
    return "parquet" if any(True for _ in _walk_files(path, (".parquet",))) else None


def signature(path: Path, kind: str, text_column: str, split: str | None) -> dict:
    """The cache key of a table source, with every data file's [path, size, mtime_ns]."""
    path = Path(path).resolve()
    root, rel_paths = ((path.parent, [path.name]) if path.is_file()
                       else (path, _walk_files(path, _SIGNATURE_SUFFIXES)))
    return {"source": kind, "path": str(path), "column": text_column, "split": split,
            "files": [[rel, *size_and_mtime(root / rel)] for rel in rel_paths]}


def documents(path: Path, kind: str, text_column: str, stats: dict,
              split: str | None = None) -> Iterator[Doc]:
    """The ``(key, utf-8 bytes)`` documents of a table source, one per row of ``text_column``
    (null: ``b""``), checked now and read as the iterator advances; keys are ``"<file>:<row>"``
    (Parquet) or ``"<split>:<row>"``. ``stats`` gets ``files`` now and ``rows`` (read so far).
    ``split``: of a ``DatasetDict``; None picks ``"train"``, or the only split."""
    path = Path(path)
    if kind == "parquet":
        batches, n_files = _parquet_batches(path, text_column)
    elif kind == "hf_dataset":
        batches, n_files = _hf_batches(path, text_column, split)
    else:
        raise ValueError(f"unknown table source kind {kind!r}")
    stats.update(files=n_files, rows=0)
    return _documents(batches, stats)


def _parquet_batches(path: Path, column: str):
    """Checks the Parquet files at ``path``; returns (iterator of (file key, batch), files)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError("reading Parquet needs pyarrow; install jaxaccel[data] "
                          "(or pip install pyarrow)", field="data.path") from e
    if path.is_file():
        rel_paths, root = [path.name], path.parent
    else:
        rel_paths, root = list(_walk_files(path, (".parquet",))), path
        if not rel_paths:
            raise _not_a_table(path)
    metadata = []
    for rel in rel_paths:
        try:
            meta = pq.read_metadata(root / rel)
        except (OSError, ValueError) as e:      # pyarrow.ArrowInvalid is a ValueError
            raise ConfigError(f"{root / rel} is not a readable Parquet file ({one_line(e)}); "
                              "rewrite it or remove it", field="data.path") from e
        _check_column(meta.schema.to_arrow_schema(), column, root / rel)
        metadata.append(meta)
    if sum(meta.num_rows for meta in metadata) == 0:
        raise _empty(path)

    def batches():
        for rel, meta in zip(rel_paths, metadata):
            with _read_errors(root / rel), pq.ParquetFile(root / rel, metadata=meta) as f:
                for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=[column]):
                    yield rel, batch.column(0)

    return batches(), len(rel_paths)


def _hf_batches(path: Path, column: str, split: str | None):
    """Checks the saved dataset at ``path``; returns (iterator of (split, batch), files)."""
    if not _is_saved_dataset(path):
        if _is_loading_script_repo(path) or any(path.glob("*.py")):
            raise ConfigError(_save_first(f"{path} holds a dataset loading script, which would "
                                          "download the data"), field="data.path")
        raise _not_a_table(path)
    target, where, name = path, path, None
    if (path / _HF_DICT_FILE).is_file():
        name = _pick_split(path, split)
        target, where = path / name, f"{path} split '{name}'"
    try:        # load_from_disk fails on a Dataset that lists no data file: say what is wrong
        no_data = json.loads((target / "state.json").read_text())["_data_files"] == []
    except (OSError, ValueError, KeyError, TypeError):
        no_data = False            # load_from_disk reports it
    if no_data:
        raise _empty(where)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as e:
        raise ConfigError("reading a dataset saved with save_to_disk needs datasets; install "
                          "jaxaccel[data] (or pip install datasets)", field="data.path") from e
    try:
        dataset = datasets.load_from_disk(str(target))
    except Exception as e:      # any failure to read the files is the user's to fix
        raise ConfigError(_save_first(f"{target} could not be loaded with datasets.load_from_disk "
                                      f"({type(e).__name__}: {e})"), field="data.path") from e
    if not isinstance(dataset, datasets.Dataset):
        raise ConfigError(f"{target} is not one dataset split; pass a save_to_disk directory "
                          "of a Dataset or a DatasetDict", field="data.path")
    if name is None:
        if split is not None and dataset.split is None:
            raise ConfigError(f"{path} is a dataset saved without splits, so it has no split "
                              f"'{split}'; leave --data-split out", field="data.split")
        if split is not None and str(dataset.split) != split:
            raise ConfigError(f"{path} is the '{dataset.split}' split alone, not '{split}'; pass "
                              "its DatasetDict directory or drop --data-split", field="data.split")
        name = str(dataset.split) if dataset.split is not None else "data"
    _check_column(dataset.data.schema, column, where)
    if dataset.num_rows == 0:
        raise _empty(where)

    def batches():
        arrow = dataset.select_columns([column]).with_format("arrow")
        with _read_errors(where):
            for table in arrow.iter(batch_size=BATCH_ROWS):
                for chunk in table.column(0).chunks:
                    yield name, chunk

    return batches(), len(dataset.cache_files)


def _pick_split(path: Path, split: str | None) -> str:
    try:
        splits = json.loads((path / _HF_DICT_FILE).read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(_save_first(f"{path / _HF_DICT_FILE} is not a readable list of "
                                      f"splits ({e})"), field="data.path") from e
    splits = [str(name) for name in splits]
    if split is not None:
        if split not in splits:
            raise ConfigError(f"{path} has no split '{split}' (it has {', '.join(splits)}); "
                              "pass --data-split NAME with one of them", field="data.split")
        return split
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise ConfigError(f"{path} has splits {', '.join(splits)} and none is 'train'; pass "
                      "--data-split NAME to choose one", field="data.split")


@contextlib.contextmanager
def _read_errors(where):
    """Turns a failure to read a file's pages (its footer and schema were fine) into one line."""
    import pyarrow as pa
    try:
        yield
    except (OSError, ValueError, pa.ArrowException) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where} could not be read ({type(e).__name__}: {one_line(e)}): it is "
                          "damaged; rewrite or delete it, or pass another --data",
                          field="data.path") from e


def one_line(error: BaseException) -> str:
    """An exception's message on one line (pyarrow's can span several)."""
    return " ".join(str(error).split())


def _documents(batches, stats: dict) -> Iterator[Doc]:
    """Yields each row of each (key prefix, string array) batch as a document."""
    row, prefix = 0, None
    for key, array in batches:
        if key != prefix:
            row, prefix = 0, key
        stats["rows"] += len(array)
        for doc in _array_bytes(array):
            yield f"{key}:{row}", doc
            row += 1


def _array_bytes(array) -> Iterator[bytes]:
    """The utf-8 bytes of each value of a string Arrow array (null: ``b""``), not decoded."""
    import numpy as np
    import pyarrow as pa
    if pa.types.is_dictionary(array.type) or not (pa.types.is_string(array.type)
                                                  or pa.types.is_large_string(array.type)):
        array = array.cast(pa.large_string())           # string_view, dictionary<string>
    n = len(array)
    if n == 0:
        return
    _, offsets_buf, data_buf = array.buffers()
    offset_type = np.int64 if pa.types.is_large_string(array.type) else np.int32
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)[array.offset:array.offset + n + 1]
    offsets = offsets.tolist()
    data = memoryview(data_buf) if data_buf is not None else memoryview(b"")
    nulls = array.is_null().to_pylist() if array.null_count else None
    for i in range(n):
        yield b"" if nulls is not None and nulls[i] else bytes(data[offsets[i]:offsets[i + 1]])


def _check_column(schema, column: str, where) -> None:
    """Raises ``ConfigError`` unless ``schema`` has ``column`` and it holds strings."""
    import pyarrow as pa
    if column not in schema.names:
        raise ConfigError(f"{where} has no column '{column}' (columns: "
                          f"{', '.join(schema.names) or 'none'}); pass --text-column NAME",
                          field="data.text_column")
    kind = schema.field(column).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
        raise ConfigError(f"column '{column}' of {where} holds {kind}, not text; pass "
                          "--text-column NAME with a string column", field="data.text_column")


def _not_a_table(path: Path) -> ConfigError:
    return ConfigError(f"{path} holds neither .parquet files nor a dataset written by "
                       "save_to_disk; pass a .parquet file, a directory of them, or a "
                       "save_to_disk directory", field="data.path")


def _empty(where) -> ConfigError:
    return ConfigError(f"{where} has no rows; pass a dataset with at least one document",
                       field="data.path")


def _is_saved_dataset(path: Path) -> bool:
    return ((path / _HF_DICT_FILE).is_file()
            or all((path / name).is_file() for name in _HF_DATASET_FILES))


def _is_loading_script_repo(path: Path) -> bool:
    """A hub repository with a loading script: ``NAME/NAME.py`` beside only its card and infos."""
    return (path / f"{path.name}.py").is_file() and all(
        entry.name.startswith(".") or entry.name == f"{path.name}.py"
        or (entry.is_file() and entry.name in _HUB_REPO_EXTRAS) for entry in path.iterdir())


def _walk_files(root: Path, suffixes: tuple[str, ...]) -> Iterator[str]:
    """Sorted relative POSIX paths of the files under root ending in suffixes, not hidden."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        base = Path(dirpath).relative_to(root)
        found.extend((base / name).as_posix() for name in filenames
                     if name.endswith(suffixes) and not name.startswith("."))
    return iter(sorted(found))


def size_and_mtime(path: Path) -> list[int]:
    """The cheap signature of a file's content: an edit changes its size or its mtime."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]

