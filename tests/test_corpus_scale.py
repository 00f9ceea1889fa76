"""experiments.corpus_scale: generate, tokenize in fresh processes, time the loader."""

import json

import numpy as np

from experiments import corpus_scale
from jaxaccel.data.corpus import load_corpus


def test_a_small_corpus_is_generated_tokenized_and_loaded(corpus_path, tmp_path, capsys):
    out, work = tmp_path / "cs.json", tmp_path / "work"
    code = corpus_scale.main([
        "--corpus-mb", "1", "--tokenizers", "bytes,bpe:300", "--loader-batches", "5",
        "--seq-len", "64", "--batch-size", "4", "--work-dir", str(work),
        "--cache-dir", str(tmp_path / "bpe"), "--bpe-data", corpus_path, "--keep",
        "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    tokenize = {r["tokenizer"]: r for r in result["rows"] if r["part"] == "tokenize"}
    loader = [r for r in result["rows"] if r["part"] == "loader"]
    assert list(tokenize) == ["bytes", "bpe:300"]
    for row in tokenize.values():
        assert row["seconds"] > 0 and row["mb_per_s"] > 0 and row["tokens"] > 0
        assert row["peak_rss_mb"] > 0 and row["cache_mb"] > 0 and row["documents"] > 100
        assert row["speed_target"] in ("met", "MISSED")
    assert 0.99 < tokenize["bytes"]["bytes_per_token"] < 1.0        # each document's EOS
    assert tokenize["bpe:300"]["bytes_per_token"] > 1.0 and tokenize["bpe:300"]["train_s"] > 0
    assert [(r["tokenizer"], r["source"].split(",")[0]) for r in loader] == [
        (t, s) for t in ("bytes", "bpe:300") for s in ("mmap", "mmap", "memory")]
    for row in loader:
        assert row["batches"] == 5 and 0 < row["real_tokens"] <= 5 * 4 * 64
        assert row["tokens_per_s"] > 0 and row["vs_memory"] > 0
    corpus = work / "corpus.jsonl"
    assert abs(corpus.stat().st_size - 2**20) < 0.1 * 2**20
    assert result["meta"]["corpus"]["bytes"] == corpus.stat().st_size
    assert all(json.loads(line)["text"] for line in corpus.open())
    assert "| tokenizer" in capsys.readouterr().out
    # Kept: the next run reuses the corpus; without --keep it deletes only the caches.
    assert corpus_scale.main([
        "--corpus-mb", "1", "--tokenizers", "bytes", "--loader-batches", "2", "--seq-len", "64",
        "--batch-size", "4", "--work-dir", str(work)]) == 0
    assert "(reused)" in capsys.readouterr().out
    assert corpus.is_file() and not (work / "cache-0-bytes").exists()
    assert (work / "cache-1-bpe-300").is_dir()         # the first run's, kept


def test_the_corpus_is_deterministic_and_copies_differ(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    corpus_scale.generate_corpus(str(a), 2**20, seed=1)
    corpus_scale.generate_corpus(str(b), 2**20, seed=1)
    assert a.read_bytes() == b.read_bytes()
    files = corpus_scale.stdlib_files()
    text = open(files[0], encoding="utf-8").read()
    names = ["self", "value", "result"]
    copies = {corpus_scale.perturb(text, names, c, np.random.default_rng([1, c, 0]))
              for c in range(3)}
    assert len(copies) == 3 and text not in copies


def test_the_in_memory_copy_of_only_the_documents_read_gives_the_same_batches(corpus_path,
                                                                           tmp_path, monkeypatch):
    train = load_corpus(corpus_path, cache_dir=str(tmp_path)).train
    exp = corpus_scale.CorpusScaleSettings(seq_len=32, batch_size=2, loader_batches=4)
    monkeypatch.setattr(corpus_scale, "host_memory_bytes", lambda: 0)    # force the subset copy
    documents, source = corpus_scale.in_memory(train, exp)
    assert source.startswith("memory (") and len(documents.tokens) < len(train.tokens)
    mapped, copied = (corpus_scale.DataStream(d, strategy="pack", seq_len=32, batch_size=2)
                      for d in (train, documents))
    for _ in range(4):
        one, other = next(mapped), next(copied)
        assert all(np.array_equal(one[k], other[k]) for k in one)


def test_bad_input_is_one_line(capsys, tmp_path):
    code = corpus_scale.main(["--corpus-mb", "0", "--work-dir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--corpus-mb" in err[0], err
    code = corpus_scale.main(["--tokenizers", "bytes,bpe:12", "--work-dir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--tokenizers" in err[0], err
    # a tokenizer file that is not there: before the corpus is generated, not after
    code = corpus_scale.main(["--tokenizers", "bytes,nothere.json", "--work-dir",
                              str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "nothere.json does not exist" in err[0], err
    assert "--tokenizers" in err[0]
    assert not (tmp_path / "w").exists()
