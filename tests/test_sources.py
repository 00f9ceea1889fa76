"""Table sources: Parquet files and directories, datasets saved to disk, their errors and keys."""

import os

import pytest

from jaxaccel.data import sources
from jaxaccel.core.errors import ConfigError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _write_parquet(path, texts, column="text", row_group_size=None, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({column: pa.array(texts, pa.string()), **extra})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _read(path, column="text", split=None):
    stats = {}
    kind = sources.kind_of(path)
    docs = list(sources.documents(path, kind, column, stats, split))
    return docs, stats


@pytest.fixture(scope="module")
def hf():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    return datasets


def test_parquet_file_round_trip(tmp_path):
    path = _write_parquet(tmp_path / "c.parquet", ["hello", None, "héllo ✓ 世界", ""])
    assert sources.kind_of(path) == "parquet"
    docs, stats = _read(path)
    assert docs == [("c.parquet:0", b"hello"), ("c.parquet:1", b""),
                    ("c.parquet:2", "héllo ✓ 世界".encode()), ("c.parquet:3", b"")]
    assert stats == {"files": 1, "rows": 4}


def test_parquet_directory_is_read_in_path_order(tmp_path):
    _write_parquet(tmp_path / "data" / "train-00001-of-00002.parquet", ["c", "d", "e"])
    _write_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", ["a", "b"])
    _write_parquet(tmp_path / ".cache" / "ignored.parquet", ["hidden"])
    (tmp_path / "README.md").write_text("card")
    assert sources.kind_of(tmp_path) == "parquet"
    docs, stats = _read(tmp_path)
    assert docs == [("data/train-00000-of-00002.parquet:0", b"a"),
                    ("data/train-00000-of-00002.parquet:1", b"b"),
                    ("data/train-00001-of-00002.parquet:0", b"c"),
                    ("data/train-00001-of-00002.parquet:1", b"d"),
                    ("data/train-00001-of-00002.parquet:2", b"e")]
    assert stats == {"files": 2, "rows": 5}


def test_kind_of_other_paths(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    assert sources.kind_of(tmp_path) is None
    assert sources.kind_of(tmp_path / "a.txt") is None
    assert sources.kind_of(tmp_path / "missing") is None


def test_parquet_is_streamed_batch_by_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BATCH_ROWS", 100)
    path = _write_parquet(tmp_path / "big.parquet", [f"doc {i}" for i in range(5000)],
                          row_group_size=250)
    stats = {}
    docs = sources.documents(path, "parquet", "text", stats)
    assert stats == {"files": 1, "rows": 0}             # checked, nothing read yet
    assert next(docs) == ("big.parquet:0", b"doc 0")
    assert stats["rows"] == 100                         # one batch, not the file
    assert sum(1 for _ in docs) == 4999
    assert stats["rows"] == 5000


def test_array_bytes_handles_offsets_nulls_and_string_kinds():
    array = pa.array(["xx", "a", None, "bé", ""]).slice(1)
    assert list(sources._array_bytes(array)) == [b"a", b"", "bé".encode(), b""]
    assert list(sources._array_bytes(array.cast(pa.large_string()))) == [
        b"a", b"", "bé".encode(), b""]
    assert list(sources._array_bytes(pa.array(["p", "q", "p"]).dictionary_encode())) == [
        b"p", b"q", b"p"]


def test_saved_dataset(tmp_path, hf):
    hf.Dataset.from_dict({"text": ["one", None, "trois ✓"], "n": [1, 2, 3]}).save_to_disk(
        str(tmp_path / "ds"))
    assert sources.kind_of(tmp_path / "ds") == "hf_dataset"
    docs, stats = _read(tmp_path / "ds")
    assert [doc for _, doc in docs] == [b"one", b"", "trois ✓".encode()]
    assert [key.rsplit(":", 1)[1] for key, _ in docs] == ["0", "1", "2"]
    assert len({key.rsplit(":", 1)[0] for key, _ in docs}) == 1
    assert stats == {"files": 1, "rows": 3}


def test_saved_dataset_dict_splits(tmp_path, hf):
    path = tmp_path / "dd"
    hf.DatasetDict({"train": hf.Dataset.from_dict({"text": ["t0", "t1"]}),
                    "validation": hf.Dataset.from_dict({"text": ["v0"]})}).save_to_disk(str(path))
    assert sources.kind_of(path) == "hf_dataset"
    assert _read(path)[0] == [("train:0", b"t0"), ("train:1", b"t1")]
    assert _read(path, split="validation")[0] == [("validation:0", b"v0")]
    with pytest.raises(ConfigError, match="no split 'test'.*train, validation") as e:
        _read(path, split="test")
    assert e.value.field == "data.split"


def test_saved_dataset_dict_without_train_needs_a_split(tmp_path, hf):
    path = tmp_path / "dd"
    hf.DatasetDict({"a": hf.Dataset.from_dict({"text": ["x"]}),
                    "b": hf.Dataset.from_dict({"text": ["y"]})}).save_to_disk(str(path))
    with pytest.raises(ConfigError, match=r"splits a, b .*--data-split NAME") as e:
        sources.documents(path, "hf_dataset", "text", {})
    assert e.value.field == "data.split"
    assert _read(path, split="b")[0] == [("b:0", b"y")]
    hf.Dataset.from_dict({"text": ["y"]}, split="b").save_to_disk(str(tmp_path / "b_alone"))
    assert _read(tmp_path / "b_alone", split="b")[0] == [("b:0", b"y")]
    with pytest.raises(ConfigError, match="the 'b' split alone, not 'a'"):
        sources.documents(tmp_path / "b_alone", "hf_dataset", "text", {}, split="a")
    only = tmp_path / "only"
    hf.DatasetDict({"test": hf.Dataset.from_dict({"text": ["z"]})}).save_to_disk(str(only))
    assert _read(only)[0] == [("test:0", b"z")]


def test_missing_column_lists_the_columns(tmp_path, hf):
    path = _write_parquet(tmp_path / "c.parquet", ["a"], column="content", id=[1])
    with pytest.raises(ConfigError, match=r"no column 'text' \(columns: content, id\); "
                                          r"pass --text-column NAME") as e:
        sources.documents(path, "parquet", "text", {})
    assert e.value.field == "data.text_column"
    hf.Dataset.from_dict({"body": ["a"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ConfigError, match=r"columns: body\)"):
        sources.documents(tmp_path / "ds", "hf_dataset", "text", {})


def test_non_string_column(tmp_path, hf):
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": pa.array([1, 2], pa.int64())}), path)
    with pytest.raises(ConfigError, match="holds int64, not text") as e:
        sources.documents(path, "parquet", "text", {})
    assert e.value.field == "data.text_column"
    hf.Dataset.from_dict({"text": [1.5]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ConfigError, match="holds double, not text"):
        sources.documents(tmp_path / "ds", "hf_dataset", "text", {})


def test_empty_dataset(tmp_path, hf):
    path = _write_parquet(tmp_path / "e.parquet", [])
    with pytest.raises(ConfigError, match="has no rows") as e:
        sources.documents(path, "parquet", "text", {})
    assert e.value.field == "data.path"
    empty = hf.Dataset.from_dict({"text": []},
                                 features=hf.Features({"text": hf.Value("string")}))
    empty.save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ConfigError, match="has no rows"):
        sources.documents(tmp_path / "ds", "hf_dataset", "text", {})
    hf.DatasetDict({"train": hf.Dataset.from_dict({"text": ["t"]}), "validation": empty}
                   ).save_to_disk(str(tmp_path / "dd"))
    assert _read(tmp_path / "dd")[0] == [("train:0", b"t")]     # an empty other split is fine
    with pytest.raises(ConfigError, match="split 'validation' has no rows"):
        sources.documents(tmp_path / "dd", "hf_dataset", "text", {}, split="validation")


def test_directory_without_tables(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    for kind in ("parquet", "hf_dataset"):
        with pytest.raises(ConfigError, match="neither .parquet files nor a dataset written "
                                              "by save_to_disk") as e:
            sources.documents(tmp_path, kind, "text", {})
        assert e.value.field == "data.path"


def test_loading_script_is_refused(tmp_path):
    repo = tmp_path / "squad"
    repo.mkdir()
    (repo / "squad.py").write_text("import datasets\n")
    (repo / "README.md").write_text("card")
    assert sources.kind_of(repo) == "hf_dataset"
    with pytest.raises(ConfigError, match="loading script.*nothing is downloaded: save it with "
                                          "datasets.Dataset.save_to_disk or as Parquet") as e:
        sources.documents(repo, "hf_dataset", "text", {})
    assert e.value.field == "data.path"


def test_unloadable_saved_dataset(tmp_path):
    (tmp_path / "dataset_info.json").write_text("{}")
    (tmp_path / "state.json").write_text("not json")
    pytest.importorskip("datasets")
    with pytest.raises(ConfigError, match="load_from_disk.*nothing is downloaded"):
        sources.documents(tmp_path, "hf_dataset", "text", {})


def test_hub_name_hint():
    assert "nothing is downloaded" in sources.hub_name_hint("allenai/c4")
    assert "nothing is downloaded" in sources.hub_name_hint("wikitext")
    for path in ("corpus.jsonl", "data/train.parquet", "./x", "/abs/path", "a/b/c"):
        assert sources.hub_name_hint(path) is None


def test_signature_follows_the_files(tmp_path, hf):
    path = _write_parquet(tmp_path / "d" / "a.parquet", ["a"])
    sig = sources.signature(tmp_path / "d", "parquet", "text", None)
    assert sig["files"][0][0] == "a.parquet" and sig["column"] == "text"
    assert sources.signature(tmp_path / "d", "parquet", "body", None) != sig
    _write_parquet(path, ["a longer document"])
    assert sources.signature(tmp_path / "d", "parquet", "text", None) != sig
    sig = sources.signature(tmp_path / "d", "parquet", "text", None)
    _write_parquet(tmp_path / "d" / "sub" / "b.parquet", ["b"])
    assert sources.signature(tmp_path / "d", "parquet", "text", None) != sig

    hf.DatasetDict({"train": hf.Dataset.from_dict({"text": ["t"]})}).save_to_disk(
        str(tmp_path / "dd"))
    sig = sources.signature(tmp_path / "dd", "hf_dataset", "text", "train")
    assert {rel for rel, *_ in sig["files"]} == {
        "dataset_dict.json", "train/data-00000-of-00001.arrow", "train/dataset_info.json",
        "train/state.json"}
    assert sources.signature(tmp_path / "dd", "hf_dataset", "text", None) != sig
    hf.DatasetDict({"train": hf.Dataset.from_dict({"text": ["t", "u"]})}).save_to_disk(
        str(tmp_path / "dd"))
    assert sources.signature(tmp_path / "dd", "hf_dataset", "text", "train") != sig
    single = sources.signature(path, "parquet", "text", None)
    assert single["files"][0][0] == "a.parquet" and single["path"] == str(path.resolve())
