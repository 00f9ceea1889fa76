"""experiments.tokenization: bytes against BPEs on the same compute, in bits per byte."""

import json

from experiments import tokenization


def test_rows_train_the_same_steps_and_report_bits_per_byte(corpus_path, tmp_path, capsys):
    out = tmp_path / "t.json"
    code = tokenization.main([
        "--data", corpus_path, "--tokenizers", "bytes,bpe:300", "--d-model", "32",
        "--n-layers", "1", "--n-heads", "2", "--max-seq-len", "32", "--seq-len", "32",
        "--batch-size", "2", "--steps", "6", "--warmup-steps", "2", "--no-progress",
        "--final-eval-batches", "1", "--run-dir", str(tmp_path / "runs"), "--cache-dir",
        str(tmp_path / "cache"), "--json", str(out)])
    assert code == 0
    rows = {r["tokenizer"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["bytes", "bpe:300"]
    assert rows["bytes"]["vocab_size"] == 320 and rows["bpe:300"]["vocab_size"] == 384
    assert 0.95 < rows["bytes"]["bytes_per_token"] < 1.0        # each document's EOS
    assert rows["bpe:300"]["bytes_per_token"] > 1.5
    for row in rows.values():
        assert row["steps"] == 6 and row["val_bpb"] > 0 and row["unigram_bpb"] > 0
        assert row["text_bytes_per_s"] == row["tokens_per_s"] * row["bytes_per_token"]
    assert (tmp_path / "runs" / "bpe-300" / "tokenizer.json").is_file()
    assert (tmp_path / "runs" / "tokenization.png").stat().st_size > 1000
    assert "val bits/byte" in capsys.readouterr().out


def test_a_bad_tokenizer_is_one_line_before_any_row(capsys, tmp_path):
    code = tokenization.main(["--tokenizers", "bytes,bpe:12", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "at least 259 tokens" in err[0], err
    assert not any(tmp_path.iterdir())
