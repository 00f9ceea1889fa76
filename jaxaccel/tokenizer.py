"""Byte-level tokenizer: every byte is a token, plus three special ids.

Ids 0, 1, 2 are PAD, BOS and EOS; byte b has id b + 3, so 259 ids are real. The model's
embedding and output projection use ``padded_vocab_size`` (a multiple of 64 by default) so
that their matmuls have tensor-core friendly shapes; the extra ids are never produced.
"""

import numpy as np

from jaxaccel.errors import ConfigError

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_OFFSET = 3
NUM_BYTES = 256


class ByteTokenizer:
    """Maps text to byte ids and back.

    Args:
      pad_multiple: ``padded_vocab_size`` is ``vocab_size`` rounded up to a multiple of this.
    """

    vocab_size = BYTE_OFFSET + NUM_BYTES

    def __init__(self, pad_multiple: int = 64):
        if pad_multiple < 1:
            raise ConfigError(f"pad_multiple must be >= 1, got {pad_multiple}; pass e.g. 64")
        self.pad_multiple = pad_multiple

    @property
    def padded_vocab_size(self) -> int:
        """Size of the embedding table: vocab_size rounded up to a multiple of pad_multiple."""
        return -(-self.vocab_size // self.pad_multiple) * self.pad_multiple

    def encode(self, text: str | bytes, *, bos: bool = True, eos: bool = True) -> np.ndarray:
        """Returns int32 ids of the utf-8 bytes of ``text``, optionally framed by BOS and EOS."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.empty(len(data) + bos + eos, dtype=np.int32)
        ids[bos : bos + len(data)] = np.frombuffer(data, dtype=np.uint8)
        ids[bos : bos + len(data)] += BYTE_OFFSET
        if bos:
            ids[0] = BOS_ID
        if eos:
            ids[-1] = EOS_ID
        return ids

    def decode(self, ids) -> str:
        """Returns the text of the byte ids in ``ids``; special and out-of-range ids are dropped.

        Byte sequences that are not valid utf-8 (e.g. a sample cut mid-character) become U+FFFD.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        byte_values = ids[(ids >= BYTE_OFFSET) & (ids < self.vocab_size)] - BYTE_OFFSET
        return byte_values.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
