"""Byte tokenizer: ids, round trips and vocabulary padding."""

import numpy as np
import pytest

from jaxaccel.core.errors import ConfigError
from jaxaccel.core.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer


def test_special_ids_and_vocab_sizes():
    tok = ByteTokenizer()
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert tok.vocab_size == 259
    assert tok.padded_vocab_size == 320
    assert ByteTokenizer(pad_multiple=128).padded_vocab_size == 384
    assert ByteTokenizer(pad_multiple=1).padded_vocab_size == 259


def test_bad_pad_multiple_is_a_config_error():
    with pytest.raises(ConfigError, match="pad_multiple"):
        ByteTokenizer(pad_multiple=0)


def test_encode_frames_bytes_with_bos_and_eos():
    tok = ByteTokenizer()
    h, i = ord("h") + 3, ord("i") + 3
    ids = tok.encode("hi")
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [BOS_ID, h, i, EOS_ID])
    np.testing.assert_array_equal(tok.encode("hi", bos=False), [h, i, EOS_ID])
    np.testing.assert_array_equal(tok.encode("hi", eos=False), [BOS_ID, h, i])
    assert len(tok.encode("", bos=False, eos=False)) == 0
    np.testing.assert_array_equal(tok.encode(b"\x00\xff", bos=False, eos=False), [3, 258])


@pytest.mark.parametrize("text", ["def f(x):\n    return x\n", "héllo wörld — 日本語 🚀", ""])
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text.encode("utf-8"))) == text


def test_decode_drops_special_and_padding_ids():
    tok = ByteTokenizer()
    padding_ids = [tok.vocab_size, tok.padded_vocab_size - 1]
    ids = [PAD_ID, BOS_ID, ord("a") + 3, EOS_ID, *padding_ids, ord("b") + 3, PAD_ID]
    assert tok.decode(ids) == "ab"
    assert tok.decode(np.array([[ord("x") + 3], [ord("y") + 3]])) == "xy"


def test_decode_replaces_invalid_utf8():
    tok = ByteTokenizer()
    truncated = tok.encode("é", bos=False, eos=False)[:1]
    assert tok.decode(truncated) == "\ufffd"


# Subword tokenizers: a tokenizer.json, a SentencePiece model, a BPE trained here.

import io  # noqa: E402

from jaxaccel.core import tokenizer as tok_lib  # noqa: E402

TEXTS = [f"def function_{i}(value):\n    return value * {i} + 'héllo wörld'\n"
         for i in range(200)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "bpe.json"
    return tok_lib.train_bpe(iter(TEXTS), 400, str(path))


def test_trained_bpe_round_trips_with_its_special_ids(bpe):
    assert (bpe.pad_id, bpe.bos_id, bpe.eos_id) == (0, 1, 2)
    assert 259 < bpe.vocab_size <= 400 and bpe.padded_vocab_size == 512
    text = "def function_7(value):\n    return 'héllo' 日本 🚀\n"
    ids = bpe.encode(text)
    assert ids.dtype == np.int32 and ids[0] == 1 and ids[-1] == 2
    assert len(ids) < len(text.encode()) / 1.5          # merges learned from TEXTS
    assert bpe.decode(ids) == text
    assert bpe.decode([*ids[:-1], 0, bpe.vocab_size, bpe.padded_vocab_size - 1]) == text
    tokens, lengths = bpe.encode_documents([text.encode(), b"x", b"\xff bad utf-8"])
    np.testing.assert_array_equal(tokens[: lengths[0]], ids)
    assert lengths.sum() == len(tokens) and bpe.decode(tokens[lengths[0]:][:3]) == "x"
    assert bpe.decode(tokens[lengths[:2].sum():]) == "\ufffd bad utf-8"


def test_bpe_training_is_deterministic(bpe, tmp_path):
    again = tok_lib.train_bpe(iter(TEXTS), 400, str(tmp_path / "again.json"))
    assert again.fingerprint == bpe.fingerprint
    assert (tmp_path / "again.json").read_bytes() == open(bpe.path, "rb").read()
    other = tok_lib.train_bpe(iter(TEXTS[:50]), 300, str(tmp_path / "other.json"))
    assert other.fingerprint != bpe.fingerprint


def _hf_file(path, specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tok.save(str(path))
    return tok_lib.open_file(str(path))


def test_a_file_without_special_tokens_gets_new_ids_after_its_vocabulary(tmp_path):
    plain = _hf_file(tmp_path / "plain.json", [])
    n = plain.base_size
    assert (plain.pad_id, plain.bos_id, plain.eos_id, plain.vocab_size) == (n, n + 1, n + 2, n + 3)
    assert plain.padded_vocab_size == 384
    assert plain.decode(plain.encode("return value")) == "return value"
    gpt2_like = _hf_file(tmp_path / "gpt2.json", ["<|endoftext|>"])     # GPT-2's one special
    n = gpt2_like.base_size
    assert (gpt2_like.pad_id, gpt2_like.bos_id, gpt2_like.eos_id) == (n, 0, 0)
    assert gpt2_like.vocab_size == n + 1


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_writer=model,
                                   vocab_size=120, pad_id=3, minloglevel=2)
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    sp = tok_lib.open_file(str(tmp_path / "sp.model"))
    assert sp.kind == "sentencepiece" and (sp.pad_id, sp.bos_id, sp.eos_id) == (3, 1, 2)
    assert sp.vocab_size == 120 and sp.padded_vocab_size == 128
    ids = sp.encode("return value * 3")
    assert ids[0] == 1 and ids[-1] == 2 and sp.decode(ids) == "return value * 3"
    (tmp_path / "run").mkdir()
    sp.save(str(tmp_path / "run"))
    assert tok_lib.from_run(str(tmp_path / "run")).fingerprint == sp.fingerprint


def test_specs_and_their_vocabularies(bpe, tmp_path):
    assert tok_lib.vocab_of("bytes") == 320
    assert tok_lib.vocab_of("bpe:50257") == 50304
    assert tok_lib.vocab_of(bpe.path) == 512
    for spec, message in (("bpe:100", "at least 259 tokens"), ("bpe:x", "is not bpe:N"),
                          (str(tmp_path / "none.json"), "does not exist")):
        with pytest.raises(ConfigError, match=message) as info:
            tok_lib.vocab_of(spec)
        assert info.value.field == "data.tokenizer" and "\n" not in str(info.value)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read tokenizer"):
        tok_lib.open_file(str(tmp_path / "bad.json"))


def test_a_run_directory_keeps_its_tokenizer(bpe, tmp_path):
    assert tok_lib.from_run(str(tmp_path)).kind == "bytes"
    bpe.save(str(tmp_path))
    assert tok_lib.from_run(str(tmp_path)).fingerprint == bpe.fingerprint
