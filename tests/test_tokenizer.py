"""Byte tokenizer: ids, round trips and vocabulary padding."""

import numpy as np
import pytest

from jaxaccel.errors import ConfigError
from jaxaccel.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer


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
