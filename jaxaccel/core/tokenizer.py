"""Tokenizers: bytes, a local tokenizer file, or a byte-level BPE trained on the training split.

``--tokenizer`` names one (``TOKENIZER_HELP``): ``bytes`` (PAD, BOS, EOS are ids 0, 1, 2 and byte b
is id b + 3), a Hugging Face ``tokenizer.json`` or SentencePiece ``.model`` file, or ``bpe:N``
(PAD, BOS, EOS first; trained by ``jaxaccel.data.corpus.load_tokenizer``). A file's special tokens
are found by name (``SPECIAL_NAMES``); one it lacks gets a new id after its vocabulary (GPT-2: BOS
= EOS = ``<|endoftext|>``, PAD new). ``padded_vocab_size`` rounds ``vocab_size`` up to a multiple
of 128 (64 for bytes) for the embedding. Decoding drops special and padding ids; the corpus
cache and resumes check ``fingerprint``."""

import hashlib
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np

from jaxaccel.core.errors import ConfigError

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
NUM_BYTES = 256
SUBWORD_PAD_MULTIPLE = 128
MAX_VOCAB = 2**31 - 1          # ids are int32 in a Batch
# The largest bpe:N trained: 4x the largest vocabularies in use (262,144). The trainer allocates
# by N before it reads any text: bpe:1000000000 aborted trying to allocate about 70 GB.
MAX_BPE_VOCAB = 2**20
ENCODE_CHUNK_BYTES = 4 << 20   # text a subword tokenizer encodes at once (its memory, not ours)
TOKENIZER_HELP = ("bytes, a tokenizer.json (Hugging Face tokenizers) or SentencePiece .model "
                  "file, or bpe:N (a byte-level BPE of N tokens trained on the training split)")
# The names a tokenizer file's special tokens go by, most specific first.
SPECIAL_NAMES = {"pad": ("<|pad|>", "<pad>", "[PAD]", "<|padding|>", "<|finetune_right_pad_id|>"),
                 "bos": ("<|bos|>", "<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>",
                         "[BOS]", "<|endoftext|>"),
                 "eos": ("<|eos|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<|endoftext|>")}
BPE_SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")      # ids 0, 1, 2 of a bpe:N tokenizer
RUN_FILES = {"hf": "tokenizer.json", "sentencepiece": "tokenizer.model"}  # in a run dir, by kind


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ByteTokenizer:
    """Maps text to byte ids and back."""

    kind = "bytes"
    spec = "bytes"
    vocab_size = BYTE_OFFSET + NUM_BYTES
    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    fingerprint = "bytes"

    def __init__(self, pad_multiple: int = 64):
        if pad_multiple < 1:
            raise ConfigError(f"pad_multiple must be >= 1, got {pad_multiple}; pass e.g. 64")
        self.pad_multiple = pad_multiple

    @property
    def padded_vocab_size(self) -> int:
        return _round_up(self.vocab_size, self.pad_multiple)

    def encode(self, text: str | bytes, *, bos: bool = True, eos: bool = True) -> np.ndarray:
        """Returns int32 ids of the utf-8 bytes of ``text``, optionally framed by BOS and EOS."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
        return np.concatenate([[BOS_ID] * bos, ids, [EOS_ID] * eos]).astype(np.int32)

    def encode_documents(self, docs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """All ``docs`` as BOS + ids + EOS back to back: (int32 tokens, int64 lengths [N])."""
        ids = np.frombuffer(b"".join(docs), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
        return _frame(ids, [len(doc) for doc in docs], BOS_ID, EOS_ID)

    def decode(self, ids) -> str:
        """The text of the byte ids in ``ids`` (others dropped); invalid utf-8 becomes U+FFFD."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        byte_values = ids[(ids >= BYTE_OFFSET) & (ids < self.vocab_size)] - BYTE_OFFSET
        return byte_values.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, run_dir: str) -> None:
        """Bytes need no file: a run directory without one is a bytes run."""


class _FileTokenizer:
    """What the tokenizers of a file share: special ids, padding, framing and fingerprint."""

    def _set_specials(self, base_size: int, found: dict[str, int | None]):
        """PAD, BOS and EOS: the file's own where it has them, else new ids after base_size."""
        self.base_size = self.vocab_size = base_size
        for role in ("pad", "bos", "eos"):
            if found.get(role) is None:
                found[role] = self.vocab_size
                self.vocab_size += 1
        self.pad_id, self.bos_id, self.eos_id = found["pad"], found["bos"], found["eos"]
        if self.vocab_size > MAX_VOCAB:
            raise ConfigError(f"tokenizer {self.spec} has {self.vocab_size} ids, more than "
                              f"int32 holds; pass a smaller vocabulary", field="data.tokenizer")
        self.padded_vocab_size = _round_up(self.vocab_size, SUBWORD_PAD_MULTIPLE)

    def encode(self, text: str | bytes, *, bos: bool = True, eos: bool = True) -> np.ndarray:
        ids = self._encode_texts([_as_text(text)])[0]
        return np.array([self.bos_id] * bos + ids + [self.eos_id] * eos, dtype=np.int32)

    def encode_documents(self, docs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """As ByteTokenizer's, encoded on every core ``ENCODE_CHUNK_BYTES`` at a time (the
        library's objects for a whole batch would take several times its text in memory)."""
        ids, id_counts, chunk, size = [np.zeros(0, np.int32)], [], [], 0
        for n, doc in enumerate(docs):
            chunk.append(_as_text(doc))
            size += len(doc)
            if size >= ENCODE_CHUNK_BYTES or n == len(docs) - 1:
                encoded = self._encode_texts(chunk)
                id_counts += map(len, encoded)
                ids.append(np.fromiter((i for doc_ids in encoded for i in doc_ids),
                                       dtype=np.int32, count=sum(map(len, encoded))))
                chunk, size = [], 0
        return _frame(np.concatenate(ids), id_counts, self.bos_id, self.eos_id)

    def decode(self, ids) -> str:
        """The text of ``ids``; special, new and padding ids are dropped."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        specials = [self.pad_id, self.bos_id, self.eos_id]
        keep = (ids >= 0) & (ids < self.base_size) & ~np.isin(ids, specials)
        return self._decode_ids(ids[keep].tolist())

    def save(self, run_dir: str) -> None:
        """Copies the tokenizer into the run directory (``RUN_FILES``) for its checkpoints."""
        target = os.path.join(run_dir, RUN_FILES[self.kind])
        if os.path.abspath(target) != os.path.abspath(self.path):
            shutil.copyfile(self.path, target)


class HFTokenizer(_FileTokenizer):
    """A Hugging Face ``tokenizers`` tokenizer from its ``tokenizer.json``."""

    kind = "hf"

    def __init__(self, path: str, spec: str | None = None):
        from tokenizers import Tokenizer
        self.path, self.spec = str(path), spec or str(path)
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as e:      # the library raises its own exception types
            raise ConfigError(f"cannot read tokenizer {path}: {str(e).splitlines()[0]}; pass "
                              f"a Hugging Face tokenizer.json", field="data.tokenizer") from e
        content = self._tok.get_vocab(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]
        found = {role: next((content[n] for n in names if n in content), None)
                 for role, names in SPECIAL_NAMES.items()}
        self._set_specials(self._tok.get_vocab_size(with_added_tokens=True), found)

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def _decode_ids(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class SentencePieceTokenizer(_FileTokenizer):
    """A SentencePiece model from its ``.model`` file."""

    kind = "sentencepiece"

    def __init__(self, path: str, spec: str | None = None):
        try:
            import sentencepiece
        except ImportError as e:
            raise ConfigError("a SentencePiece .model needs the sentencepiece package; install "
                              "jaxaccel[data]", field="data.tokenizer") from e
        self.path, self.spec = str(path), spec or str(path)
        data = Path(path).read_bytes()
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except Exception as e:      # RuntimeError or OSError, depending on the failure
            raise ConfigError(f"cannot read SentencePiece model {path}: {str(e).splitlines()[0]}; "
                              "pass a SentencePiece .model file", field="data.tokenizer") from e
        self.fingerprint = hashlib.sha256(data).hexdigest()[:16]
        ids = {"pad": self._sp.pad_id(), "bos": self._sp.bos_id(), "eos": self._sp.eos_id()}
        self._set_specials(self._sp.get_piece_size(),
                           {role: (i if i >= 0 else None) for role, i in ids.items()})

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=os.cpu_count() or 1)

    def _decode_ids(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


def _frame(ids: np.ndarray, id_counts: list[int], bos_id: int, eos_id: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """Documents lying back to back in ``ids`` (``id_counts`` each) as BOS + ids + EOS."""
    lengths_N = np.asarray(id_counts, dtype=np.int64) + 2
    ends = np.cumsum(lengths_N)
    tokens = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int32)
    is_id = np.ones(len(tokens), dtype=bool)
    is_id[ends - lengths_N] = is_id[ends - 1] = False
    tokens[ends - lengths_N] = bos_id
    tokens[ends - 1] = eos_id
    tokens[is_id] = ids
    return tokens, lengths_N


def _as_text(text: str | bytes) -> str:
    """Subword tokenizers take text: bytes that are not utf-8 become U+FFFD."""
    return text if isinstance(text, str) else text.decode("utf-8", errors="replace")


def parse_spec(spec: str) -> tuple[str, int | str]:
    """``("bytes", 0)``, ``("bpe", N)`` or ``("file", path)`` (not checked); else ConfigError."""
    if spec == "bytes":
        return "bytes", 0
    if match := re.fullmatch(r"bpe:(\d+)", spec):
        n = int(match.group(1))
        if not len(BPE_SPECIALS) + NUM_BYTES <= n:
            raise ConfigError(f"tokenizer {spec}: a byte-level BPE needs at least "
                              f"{len(BPE_SPECIALS) + NUM_BYTES} tokens (3 special + 256 bytes); "
                              f"pass e.g. bpe:8192", field="data.tokenizer")
        if n > MAX_BPE_VOCAB:
            raise ConfigError(f"tokenizer {spec}: a trained BPE may have at most "
                              f"{MAX_BPE_VOCAB:,} tokens (the largest vocabularies in use have "
                              f"about 256k); pass e.g. bpe:50257", field="data.tokenizer")
        return "bpe", n
    if spec.startswith("bpe"):
        raise ConfigError(f"tokenizer {spec!r} is not bpe:N; pass e.g. bpe:8192",
                          field="data.tokenizer")
    return "file", spec


def open_file(path: str, spec: str | None = None):
    """The tokenizer in ``path``: a ``.model`` is SentencePiece, anything else tokenizer.json."""
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer file {path} does not exist; pass {TOKENIZER_HELP}",
                          field="data.tokenizer")
    return (SentencePieceTokenizer if path.endswith(".model") else HFTokenizer)(path, spec)


def vocab_of(spec: str) -> int:
    """The padded vocabulary a model needs for ``spec``, known before any data is read: a bpe:N
    tokenizer has at most N ids (a small corpus may give fewer), so its model has N rounded up."""
    kind, value = parse_spec(spec)
    if kind == "bytes":
        return ByteTokenizer().padded_vocab_size
    if kind == "bpe":
        return _round_up(value, SUBWORD_PAD_MULTIPLE)
    return open_file(value).padded_vocab_size


def train_bpe(texts, vocab_size: int, path: str) -> HFTokenizer:
    """Trains a byte-level BPE of ``vocab_size`` tokens (``BPE_SPECIALS`` first) on ``texts``
    (str), deterministically, and writes it to ``path`` atomically."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BPE_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    tok.save(tmp)
    os.replace(tmp, path)
    return HFTokenizer(path, f"bpe:{vocab_size}")


def from_run(run_dir: str):
    """The tokenizer a run trained with: its saved file, else bytes."""
    for name in RUN_FILES.values():
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            return open_file(path)
    return ByteTokenizer()


def bits_per_byte(nats_per_target: float, targets: int, text_bytes: int) -> float:
    """A loss in nats per target token as bits per byte of text: total nats / bytes / ln 2."""
    return nats_per_target * targets / max(text_bytes, 1) / math.log(2)
