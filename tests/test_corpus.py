"""Corpus loading: stdlib, directory and JSONL sources, the split, the cache and user errors."""

import json

import numpy as np
import pytest
from conftest import CORPUS_CACHE_DIR

from jaxaccel.data import corpus as corpus_lib
from jaxaccel.data.corpus import load_corpus
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.tokenizer import BOS_ID, EOS_ID, ByteTokenizer


@pytest.fixture(scope="module")
def stdlib_cache():
    return CORPUS_CACHE_DIR        # the run's, which test_batching_strategies.py shares


@pytest.fixture(scope="module")
def stdlib(stdlib_cache):
    return load_corpus("stdlib", cache_dir=stdlib_cache)


def _texts(docs):
    return [ByteTokenizer().decode(doc) for doc in docs]


def _write_files(root, contents):
    for name, data in contents.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return root


def test_stdlib_counts_are_plausible(stdlib):
    stats = stdlib.stats
    assert stats["files"] >= 500
    assert 0 <= stats["unparsable_files"] < 0.02 * stats["files"]
    assert stats["train_documents"] > stats["files"]
    assert stats["val_documents"] > 0
    assert stats["train_documents"] == len(stdlib.train) == len(stdlib.train_sources)
    assert stats["val_documents"] == len(stdlib.val) == len(stdlib.val_sources)
    assert stats["train_tokens"] == sum(len(doc) for doc in stdlib.train) > 10_000_000
    assert stats["val_tokens"] == sum(len(doc) for doc in stdlib.val)
    assert stats["empty_documents_skipped"] >= 0


def test_stdlib_documents_are_framed_views_of_one_mapped_buffer(stdlib):
    assert isinstance(stdlib.train.tokens.base, np.memmap)      # a view of the mapped file
    assert stdlib.val.tokens is stdlib.train.tokens
    docs = stdlib.train + stdlib.val
    for doc in docs[::97]:
        assert doc.dtype == np.uint16 and doc[0] == BOS_ID and doc[-1] == EOS_ID
        assert np.all(doc[1:-1] >= 3)
        assert not doc.flags.writeable


def test_stdlib_documents_are_top_level_definitions(stdlib):
    sources = stdlib.train_sources + stdlib.val_sources
    json_docs = [
        text
        for text, source in zip(_texts(stdlib.train + stdlib.val), sources)
        if source == "json/__init__.py"
    ]
    assert any(text.startswith("def dumps(") for text in json_docs)
    assert any(text.startswith("r\"\"\"JSON") for text in json_docs)  # module docstring and imports


def test_module_documents_cover_every_line_once():
    source = (
        b"# header\nimport os\n\n@decorate(1)\n@other\ndef f(x):\n    return x\n\n"
        b"class C:\n    pass\nX = 1\nasync def g():\n    await h()\n"
    )
    rest, f, c, g = corpus_lib._module_documents(source)
    assert f == b"@decorate(1)\n@other\ndef f(x):\n    return x\n"
    assert c == b"class C:\n    pass\n"
    assert g == b"async def g():\n    await h()\n"
    assert rest == b"# header\nimport os\n\n\nX = 1\n"
    assert corpus_lib._module_documents(b"print 'python 2'\n") is None


def test_stdlib_split_keeps_each_file_on_one_side(stdlib):
    train_files, val_files = set(stdlib.train_sources), set(stdlib.val_sources)
    assert not train_files & val_files
    assert 0.005 < len(val_files) / (len(train_files) + len(val_files)) < 0.05


def test_stdlib_unigram_bits(stdlib):
    assert 4.0 < stdlib.unigram_bits_per_token() < 5.5


def test_stdlib_second_load_is_served_from_cache(stdlib, stdlib_cache, monkeypatch):
    def no_reading(root, stats):
        raise AssertionError("the stdlib was re-read despite the cache")

    monkeypatch.setattr(corpus_lib, "_read_stdlib", no_reading)
    again = load_corpus("stdlib", cache_dir=stdlib_cache)
    assert again.stats == stdlib.stats
    assert again.train_sources == stdlib.train_sources and again.val_sources == stdlib.val_sources
    for a, b in zip(again.train + again.val, stdlib.train + stdlib.val):
        np.testing.assert_array_equal(a, b)


def test_split_follows_val_percent_without_rereading(stdlib, stdlib_cache):
    more_val = load_corpus("stdlib", cache_dir=stdlib_cache, val_percent=20)
    assert set(stdlib.val_sources) <= set(more_val.val_sources)
    assert more_val.stats["val_documents"] > 5 * stdlib.stats["val_documents"]


@pytest.fixture
def text_dir(tmp_path):
    files = {f"src/file_{i}.txt": f"document {i}\n" * (i + 1) for i in range(20)}
    files |= {"empty.txt": "", "blank.md": "  \n\t\n", "é.txt": "ünïcode"}
    files["image.bin"] = b"\x89PNG\xff\xfe\x00"
    return _write_files(tmp_path / "data", files)


def test_directory_source(text_dir, tmp_path):
    corpus = load_corpus(str(text_dir), cache_dir=str(tmp_path / "cache"), val_percent=30)
    stats = corpus.stats
    assert stats["files"] == 24
    assert stats["undecodable_files_skipped"] == 1
    assert stats["empty_documents_skipped"] == 2
    assert stats["train_documents"] + stats["val_documents"] == 21
    assert corpus.val and corpus.train and not set(corpus.train_sources) & set(corpus.val_sources)
    expected = {f"src/file_{i}.txt": f"document {i}\n" * (i + 1) for i in range(20)}
    expected["é.txt"] = "ünïcode"
    got = dict(zip(corpus.train_sources + corpus.val_sources, _texts(corpus.train + corpus.val)))
    assert got == expected


def test_path_cache_is_refreshed_when_a_file_changes(text_dir, tmp_path):
    cache = str(tmp_path / "cache")
    load_corpus(str(text_dir), cache_dir=cache, val_percent=30)
    (text_dir / "src/file_0.txt").write_text("edited and longer\n")
    corpus = load_corpus(str(text_dir), cache_dir=cache, val_percent=30)
    texts = dict(zip(corpus.train_sources + corpus.val_sources, _texts(corpus.train + corpus.val)))
    assert texts["src/file_0.txt"] == "edited and longer\n"


def test_corrupt_cache_is_rebuilt(text_dir, tmp_path):
    cache = tmp_path / "cache"
    first = load_corpus(str(text_dir), cache_dir=str(cache), val_percent=30)
    (entry,) = cache.glob("corpus-*")
    tokens = entry / "tokens.bin"
    size = tokens.stat().st_size
    tokens.write_bytes(tokens.read_bytes()[:-10])       # a damaged entry ...
    second = load_corpus(str(text_dir), cache_dir=str(cache), val_percent=30)
    assert second.stats == first.stats                 # ... is tokenized again
    assert tokens.stat().st_size == size
    (entry / "progress.json").write_text("{not json")
    third = load_corpus(str(text_dir), cache_dir=str(cache), val_percent=30)
    assert _texts(third.train) == _texts(first.train)
    assert not list(entry.glob("*.tmp"))


def test_cache_dir_from_environment(text_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXACCEL_CACHE_DIR", str(tmp_path / "env_cache"))
    load_corpus(str(text_dir), val_percent=30)
    assert len(list((tmp_path / "env_cache").glob("corpus-*"))) == 1


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_jsonl_source(tmp_path):
    lines = [json.dumps({"text": f"line {i} text", "id": i}) for i in range(30)]
    lines[3] = json.dumps({"text": ""})
    lines[7] = ""
    path = _write_jsonl(tmp_path / "d.jsonl", lines)
    corpus = load_corpus(path, cache_dir=str(tmp_path), val_percent=20)
    assert corpus.stats["files"] == 1
    assert corpus.stats["empty_documents_skipped"] == 2
    assert corpus.stats["train_documents"] + corpus.stats["val_documents"] == 28
    got = dict(zip(corpus.train_sources + corpus.val_sources, _texts(corpus.train + corpus.val)))
    assert got["1"] == "line 0 text" and got["30"] == "line 29 text"
    assert "4" not in got and "8" not in got


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("not json", "line 3 is not valid JSON"),
        ('{"txt": "x"}', 'line 3 has no string "text"'),
        ('{"text": 5}', 'line 3 has no string "text"'),
        ('["text"]', 'line 3 has no string "text"'),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"text": "fine"})
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, good, bad_line, good])
    with pytest.raises(ConfigError, match=message) as info:
        load_corpus(path, cache_dir=str(tmp_path))
    assert "bad.jsonl" in str(info.value) and "\n" not in str(info.value)


def test_missing_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; pass 'stdlib'") as info:
        load_corpus(str(tmp_path / "nowhere"), cache_dir=str(tmp_path))
    assert info.value.field == "data.path"


def test_unsupported_file_is_a_config_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="neither a directory, a .jsonl file nor a .parquet"):
        load_corpus(str(tmp_path / "notes.txt"), cache_dir=str(tmp_path))


def test_empty_corpus_is_a_config_error(tmp_path):
    data = _write_files(tmp_path / "data", {"a.txt": "", "b.txt": " \n"})
    with pytest.raises(ConfigError, match="has no non-empty documents"):
        load_corpus(str(data), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ConfigError, match="has no non-empty documents"):
        load_corpus(str(tmp_path / "nothing"), cache_dir=str(tmp_path / "cache"))


def test_one_sided_split_is_a_config_error(tmp_path):
    data = _write_files(tmp_path / "data", {"only.txt": "one file cannot fill two splits"})
    with pytest.raises(ConfigError, match="pass a corpus with more of them"):
        load_corpus(str(data), cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("val_percent", [0, 100, -1])
def test_bad_val_percent_is_a_config_error(tmp_path, val_percent):
    with pytest.raises(ConfigError, match="val_percent"):
        load_corpus("stdlib", cache_dir=str(tmp_path), val_percent=val_percent)


def test_stdlib_unigram_bits_per_byte(stdlib):
    stats = stdlib.stats
    assert stats["train_targets"] == stats["train_tokens"] - stats["train_documents"]
    # Bytes: one target per byte plus each document's EOS.
    assert stats["train_targets"] == stats["train_text_bytes"] + stats["train_documents"]
    ratio = stats["train_targets"] / stats["train_text_bytes"]
    assert stdlib.unigram_bits_per_byte() == pytest.approx(stdlib.unigram_bits_per_token() * ratio)
    assert stdlib.bits_per_byte(np.log(2), "train") == pytest.approx(ratio)


def _numbered_files(root, count=40):
    return _write_files(root, {f"f{i:02d}.txt": f"file {i}: " + "some words here " * (i % 7 + 1)
                               for i in range(count)})


def test_bits_per_byte_agree_for_bytes_and_an_identity_like_bpe(tmp_path):
    """bpe:259 has no merges (3 specials + 256 bytes): one token per byte, other ids."""
    data = _numbered_files(tmp_path / "data")
    as_bytes = load_corpus(str(data), cache_dir=str(tmp_path / "c"), val_percent=20)
    as_bpe = load_corpus(str(data), tokenizer="bpe:259", cache_dir=str(tmp_path / "c"),
                         val_percent=20)
    assert as_bpe.tokenizer.kind == "hf" and as_bpe.tokenizer.vocab_size == 259
    for key in ("train_targets", "train_text_bytes", "val_targets", "val_text_bytes"):
        assert as_bpe.stats[key] == as_bytes.stats[key]
    assert as_bpe.unigram_bits_per_byte() == pytest.approx(as_bytes.unigram_bits_per_byte(),
                                                           rel=1e-12)
    assert as_bpe.bits_per_byte(1.3) == pytest.approx(as_bytes.bits_per_byte(1.3), rel=1e-12)
    assert as_bpe.fingerprint != as_bytes.fingerprint
    merged = load_corpus(str(data), tokenizer="bpe:300", cache_dir=str(tmp_path / "c"),
                         val_percent=20)                # merges: fewer tokens, same bytes
    assert merged.stats["train_tokens"] < as_bytes.stats["train_tokens"]
    assert merged.stats["train_text_bytes"] == as_bytes.stats["train_text_bytes"]
    assert [merged.tokenizer.decode(d) for d in merged.train] == _texts(as_bytes.train)


def test_bpe_is_trained_on_the_train_split_once_and_cached(tmp_path, monkeypatch):
    data = _numbered_files(tmp_path / "data")
    trained = []
    real = corpus_lib.tok_lib.train_bpe
    monkeypatch.setattr(corpus_lib.tok_lib, "train_bpe",
                        lambda texts, n, path: trained.append(list(texts)) or real(
                            iter(trained[-1]), n, path))
    first = load_corpus(str(data), tokenizer="bpe:300", cache_dir=str(tmp_path / "c"),
                        val_percent=20)
    again = load_corpus(str(data), tokenizer="bpe:300", cache_dir=str(tmp_path / "c"),
                        val_percent=20)
    assert len(trained) == 1
    assert sorted(trained[0]) == sorted(first.tokenizer.decode(d) for d in first.train)
    assert again.tokenizer.fingerprint == first.tokenizer.fingerprint


def test_tokenizing_resumes_where_an_interruption_stopped_it(tmp_path, monkeypatch):
    data = _numbered_files(tmp_path / "data")
    whole = load_corpus(str(data), cache_dir=str(tmp_path / "whole"), val_percent=20)
    encoded = []
    real = ByteTokenizer.encode_documents

    def interrupted(self, docs):
        if len(encoded) == 3:
            raise KeyboardInterrupt
        encoded.append(len(docs))
        return real(self, docs)

    monkeypatch.setattr(ByteTokenizer, "encode_documents", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_corpus(str(data), cache_dir=str(tmp_path / "c"), val_percent=20,
                    tokenize_batch_mb=300 / 2**20)       # about 300 bytes of text at a time
    assert sum(encoded) < 40
    done_before = sum(encoded)
    monkeypatch.setattr(ByteTokenizer, "encode_documents",
                        lambda self, docs: encoded.append(len(docs)) or real(self, docs))
    resumed = load_corpus(str(data), cache_dir=str(tmp_path / "c"), val_percent=20,
                          tokenize_batch_mb=300 / 2**20)
    assert sum(encoded) == 40                           # nothing tokenized twice
    assert max(encoded) < 40 and done_before > 0
    assert resumed.fingerprint == whole.fingerprint
    assert resumed.train_sources == whole.train_sources
    assert _texts(resumed.train + resumed.val) == _texts(whole.train + whole.val)


def test_a_corpus_beyond_the_memory_cap_streams_and_batches_lazily(tmp_path, monkeypatch):
    """Tokenizing holds at most the cap (plus one document) of text; batching plans from the
    lengths and reads only the documents of the batch it makes."""
    from jaxaccel.data.batching import DataStream
    data = _numbered_files(tmp_path / "data", count=60)
    text_bytes = sum(p.stat().st_size for p in data.iterdir())
    cap = 500
    seen = []
    real = ByteTokenizer.encode_documents
    monkeypatch.setattr(ByteTokenizer, "encode_documents",
                        lambda self, docs: seen.append(sum(map(len, docs))) or real(self, docs))
    corpus = load_corpus(str(data), cache_dir=str(tmp_path / "c"), val_percent=10,
                         tokenize_batch_mb=cap / 2**20)
    assert text_bytes > 4 * cap and len(seen) > 4
    assert max(seen) < cap + max(p.stat().st_size for p in data.iterdir())
    reads = []

    class Counting(corpus_lib.Documents):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    docs = Counting(corpus.train.tokens, corpus.train.starts, corpus.train.lengths)
    stream = DataStream(docs, strategy="pack", seq_len=64, batch_size=2)
    assert stream.stats["real_tokens_per_epoch"] > 0 and reads == []
    batch = next(stream)
    assert 0 < len(set(reads)) < len(docs)
    assert batch["inputs"].dtype == np.int32


def test_token_dtype_fits_the_vocabulary():
    class Big:
        vocab_size = 70_000
    assert corpus_lib._token_dtype(ByteTokenizer()) == np.uint16
    assert corpus_lib._token_dtype(Big()) == np.uint32


def test_parquet_and_saved_dataset_sources(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [f"row {i}: " + "text " * (i % 5 + 1) for i in range(50)]
    table = pa.table({"content": texts, "id": list(range(50))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=16)
    datasets.Dataset.from_dict({"content": texts}).save_to_disk(str(tmp_path / "saved"))
    for source in (tmp_path / "t.parquet", tmp_path / "saved"):
        corpus = load_corpus(str(source), text_column="content", val_percent=20,
                             cache_dir=str(tmp_path / "c"))
        assert corpus.stats["train_documents"] + corpus.stats["val_documents"] == 50
        assert sorted(_texts(corpus.train + corpus.val)) == sorted(texts)
        assert not set(corpus.train_sources) & set(corpus.val_sources)
    with pytest.raises(ConfigError, match="no column 'text'.*--text-column") as info:
        load_corpus(str(tmp_path / "t.parquet"), cache_dir=str(tmp_path / "c"))
    assert info.value.field == "data.text_column"
    with pytest.raises(ConfigError, match="nothing is downloaded"):
        load_corpus("allenai/c4", cache_dir=str(tmp_path / "c"))
