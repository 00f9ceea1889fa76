"""Bad data sources, caches and tokenizer specs: one clear error line (a ConfigError naming the
setting) before work, or a counted, reported skip; never a traceback or a silent loss."""

import glob
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxaccel.data import corpus as corpus_lib
from jaxaccel.core import tokenizer as tok_lib
from jaxaccel.data.corpus import load_corpus
from jaxaccel.core.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jsonl(path, texts):
    """A JSONL file of one {"text": ...} per text; None is a blank line."""
    path.write_text("".join("\n" if t is None else json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _docs(n):
    return [f"document {i} with some words in it" for i in range(n)]


def _refused(field, *needles, **kwargs):
    """The ConfigError load_corpus raises: its field and words of its message are checked."""
    with pytest.raises(ConfigError) as info:
        load_corpus(**kwargs)
    message = str(info.value)
    assert info.value.field == field and "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def _deny(monkeypatch, owner, name, target):
    """Makes ``owner.name(path, ...)`` raise PermissionError for ``target`` (root reads all)."""
    real = getattr(owner, name)

    def denied(path=".", *args, **kwargs):
        if isinstance(path, (str, os.PathLike)) and pathlib.Path(path) == target:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(owner, name, denied)


# 1. An unreadable .jsonl file or --data folder.

def test_unreadable_jsonl_is_one_line(tmp_path, monkeypatch):
    path = _jsonl(tmp_path / "x.jsonl", _docs(5))
    _deny(monkeypatch, pathlib.Path, "open", path)
    _refused("data.path", str(path), "Permission denied", "--data",
             source=str(path), cache_dir=str(tmp_path / "cache"))


def test_unreadable_data_folder_is_one_line(tmp_path, monkeypatch):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("some text")
    _deny(monkeypatch, os, "scandir", folder)
    _refused("data.path", str(folder), "Permission denied", "--data",
             source=str(folder), cache_dir=str(tmp_path / "cache"))


# 2. A JSON line nested too deeply to parse: an error line, as any line that is not JSON.

def test_deeply_nested_json_line_is_one_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + "[" * 100000 + "]" * 100000 + "\n")
    _refused("data.path", f"{path} line 2 is not valid JSON", "nested too deeply",
             source=str(path), cache_dir=str(tmp_path / "cache"))


def test_deeply_nested_json_line_on_the_command_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100000 + "]" * 100000 + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--data", str(path), "--model", "tiny",
         "--steps", "2", "--cache-dir", str(tmp_path / "cache")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "nested too deeply" in result.stderr and "--data" in result.stderr


# 3. A cache whose values were tampered with is refused when opened, naming --cache-dir.

@pytest.mark.parametrize("damage", ["tokens", "key_index"])
def test_tampered_cache_is_refused(tmp_path, damage):
    path = _jsonl(tmp_path / "x.jsonl", _docs(60))
    cache = tmp_path / "cache"
    load_corpus(str(path), cache_dir=str(cache))
    entry = glob.glob(str(cache / "corpus-*"))[0]
    dtype = np.uint16 if damage == "tokens" else np.int64
    values = np.memmap(f"{entry}/{damage}.bin", dtype=dtype, mode="r+")
    values[5::7] = 60000
    values.flush()
    del values
    _refused("data.cache_dir", entry, "damaged", "delete", "--cache-dir",
             source=str(path), cache_dir=str(cache))


# 4. A Parquet file with a good footer and corrupt pages.

def test_parquet_with_corrupt_pages_is_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(2000)]}), path,
                   compression="snappy", row_group_size=500)
    column = pq.read_metadata(path).row_group(1).column(0)
    end = column.data_page_offset + column.total_compressed_size
    data = bytearray(path.read_bytes())
    for i in range(end - 200, end - 100):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    assert pq.read_metadata(path).num_rows == 2000          # the footer is fine
    _refused("data.path", str(path), "could not be read", "--data",
             source=str(path), cache_dir=str(tmp_path / "cache"))


# 5. A BPE size no corpus could fill is refused before any work.

def test_huge_bpe_vocabulary_is_refused():
    for spec in ("bpe:1000000000", "bpe:1048577"):
        with pytest.raises(ConfigError, match="at most 1,048,576 tokens") as info:
            tok_lib.vocab_of(spec)
        assert info.value.field == "data.tokenizer"
    assert tok_lib.parse_spec(f"bpe:{tok_lib.MAX_BPE_VOCAB}") == ("bpe", tok_lib.MAX_BPE_VOCAB)


# 6. --data-split given for a dataset saved without splits.

def test_data_split_of_a_dataset_without_splits_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "plain"
    datasets.Dataset.from_dict({"text": _docs(3)}).save_to_disk(str(path))
    _refused("data.split", str(path), "no split 'train'", "leave --data-split out",
             source=str(path), split="train", cache_dir=str(tmp_path / "cache"))
    assert len(load_corpus(str(path), cache_dir=str(tmp_path / "cache")).train) >= 1


# 7. A lone surrogate in JSONL text is written as "?" and counted where skips are reported.

def test_lone_surrogates_are_counted(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "a\\ud800b\\udfffc"}\n' + "".join(
        json.dumps({"text": t}) + "\n" for t in _docs(60)))
    corpus = load_corpus(str(path), cache_dir=str(tmp_path / "cache"))
    assert corpus.stats["lone_surrogates_replaced"] == 2
    reported = corpus_lib.skipped_inputs(corpus.stats)
    assert reported == {corpus_lib.SKIP_REASONS["lone_surrogates_replaced"]: 2}
    docs = corpus.train + corpus.val
    assert "a?b?c" in [corpus.tokenizer.decode(doc) for doc in docs]


# 8. >= 2 files (JSONL lines) always make both splits; where the hash made both, nothing moves.

def test_small_corpus_always_gets_a_validation_document(tmp_path):
    # Line 2 is the only one of lines 1..10 the hash sends to validation: blank it.
    texts = _docs(10)
    texts[1] = None
    corpus = load_corpus(str(_jsonl(tmp_path / "x.jsonl", texts)), cache_dir=str(tmp_path / "c"))
    hashes = {key: corpus_lib._key_hash(key) % 10000 for key in map(str, (1, *range(3, 11)))}
    assert corpus.val_sources == (min(hashes, key=hashes.get),)
    assert len(corpus.train) == 8


def test_small_corpus_always_gets_a_train_document(tmp_path):
    corpus = load_corpus(str(_jsonl(tmp_path / "x.jsonl", _docs(2))), val_percent=99,
                         cache_dir=str(tmp_path / "c"))
    assert corpus.train_sources == ("1",) and corpus.val_sources == ("2",)


def test_split_is_unchanged_where_the_hash_makes_both(tmp_path):
    corpus = load_corpus(str(_jsonl(tmp_path / "x.jsonl", _docs(12))), cache_dir=str(tmp_path))
    assert corpus.val_sources == ("2", "11")        # the hash's own choice


# 9. A link's suffix as given counts: x.jsonl -> x.jsonl.v2, x.parquet -> x.parquet.v2.

def test_symlink_suffix_is_checked_as_given(tmp_path):
    target = _jsonl(tmp_path / "x.jsonl.v2", _docs(60))
    (tmp_path / "x.jsonl").symlink_to(target)
    corpus = load_corpus(str(tmp_path / "x.jsonl"), cache_dir=str(tmp_path / "cache"))
    assert len(corpus.train) + len(corpus.val) == 60


def test_parquet_symlink_suffix_is_checked_as_given(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": _docs(60)}), tmp_path / "x.parquet.v2")
    (tmp_path / "x.parquet").symlink_to(tmp_path / "x.parquet.v2")
    corpus = load_corpus(str(tmp_path / "x.parquet"), cache_dir=str(tmp_path / "cache"))
    assert len(corpus.train) + len(corpus.val) == 60
