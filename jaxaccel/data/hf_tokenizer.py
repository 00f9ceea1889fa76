"""The run's tokenizer as Hugging Face files, so ``AutoTokenizer`` encodes, frames and decodes
as training and ``experiments.sample`` did.

``files(tok, context, model_vocab)`` gives the contents of:

- ``tokenizer.json`` (the ``tokenizers`` library's format) for every kind. Bytes: a byte-level
  BPE without merges whose vocabulary is PAD, BOS, EOS at 0, 1, 2 and byte b at b + 3, as
  ``ByteTokenizer``. A ``tokenizer.json`` run: its own file. SentencePiece: the ``.model``
  converted (``sentencepiece_json``: its normalizer spec, pieces and scores as a Unigram or BPE
  model, byte fallback, its decoding). In each, PAD, BOS and EOS are special added tokens at our
  ids (one the file lacks at the new id ``jaxaccel.core.tokenizer`` gave it, as a SentencePiece
  run's PAD after the ``.model``'s pieces), and the post-processor prepends BOS, as training framed
  a document and ``experiments.sample`` a prompt (``add_special_tokens=False`` leaves it out; EOS
  is not appended: it ends a document, not a prompt).
- ``tokenizer_config.json``: the class (``PreTrainedTokenizerFast``, which transformers 5 reads
  as ``TokenizersBackend``), the three special tokens by name, ``add_bos_token`` true and
  ``add_eos_token`` false (transformers 5 rebuilds the same post-processor from them),
  ``model_max_length`` (the model's context), no clean-up of spaces on decoding, and
  ``split_special_tokens`` where our tokenizer reads a special token's text as text (bytes and
  SentencePiece; a ``tokenizer.json``'s own specials are matched in text, by us as by it).
- ``generation_config.json`` (for the Llama layout): the special ids and ``suppress_tokens``, the
  padded vocabulary's tail, which ``experiments.sample`` never picks either.

Decoding drops PAD, BOS and EOS (``skip_special_tokens=True``), as ours does.
"""

import json
import struct

from jaxaccel.core.errors import ConfigError
from jaxaccel.core.tokenizer import BPE_SPECIALS, BYTE_OFFSET, NUM_BYTES, SPECIAL_NAMES

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
SPACE = "\u2581"                 # SentencePiece's whitespace symbol
UNK_STAND_IN = "\uffff"           # a noncharacter: the unknown piece while decoding
UNREACHABLE = -1e9               # Unigram score of the pieces SentencePiece never matches in text
# A probe of the read-back check: code, runs of spaces, tabs, accents, CJK, an emoji.
PROBE = "def f(x):\n    return x  *  2  # héllo wörld\t日本 🚀 \n"


# --- SentencePiece's ModelProto, read without protobuf ---------------------------------------

# SentencePiece piece types (sentencepiece_model.proto)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
# (message, field number) -> (name, wire decoding), for the fields the conversion reads.
_FIELDS = {
    ("model", 1): ("pieces", "message"), ("model", 2): ("trainer_spec", "message"),
    ("model", 3): ("normalizer_spec", "message"),
    ("pieces", 1): ("piece", "str"), ("pieces", 2): ("score", "float"),
    ("pieces", 3): ("type", "int"),
    ("trainer_spec", 3): ("model_type", "int"), ("trainer_spec", 24):
        ("treat_whitespace_as_suffix", "bool"), ("trainer_spec", 35): ("byte_fallback", "bool"),
    ("trainer_spec", 40): ("unk_id", "int"), ("trainer_spec", 44): ("unk_surface", "str"),
    ("normalizer_spec", 2): ("precompiled_charsmap", "bytes"),
    ("normalizer_spec", 3): ("add_dummy_prefix", "bool"),
    ("normalizer_spec", 4): ("remove_extra_whitespaces", "bool"),
    ("normalizer_spec", 5): ("escape_whitespaces", "bool"),
}
_DEFAULTS = {"pieces": {"type": NORMAL, "score": 0.0},
             "trainer_spec": {"model_type": UNIGRAM, "treat_whitespace_as_suffix": False,
                              "byte_fallback": False, "unk_id": 0, "unk_surface": " \u2047 "},
             "normalizer_spec": {"precompiled_charsmap": b"", "add_dummy_prefix": True,
                                 "remove_extra_whitespaces": True, "escape_whitespaces": True},
             "model": {}}


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at


def read_proto(data: bytes, message: str = "model") -> dict:
    """The fields of a SentencePiece ``ModelProto`` the conversion needs (``_FIELDS``, with
    proto2's defaults), from the protobuf wire format; ``pieces`` is a list."""
    out = dict(_DEFAULTS[message], **({"pieces": []} if message == "model" else {}))
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            raw, at = _varint(data, at)
        elif wire == 1:
            raw, at = data[at:at + 8], at + 8
        elif wire == 2:
            size, at = _varint(data, at)
            raw, at = data[at:at + size], at + size
        elif wire == 5:
            raw, at = data[at:at + 4], at + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if (message, number) not in _FIELDS:
            continue
        name, kind = _FIELDS[message, number]
        if kind == "message":
            value = read_proto(raw, name)
        elif kind == "str":
            value = raw.decode("utf-8")
        elif kind == "float":
            value = struct.unpack("<f", raw)[0]
        elif kind == "int":
            value = raw - (1 << 64) if raw >= 1 << 63 else raw      # int32 as a 10-byte varint
        elif kind == "bool":
            value = bool(raw)
        else:
            value = raw
        if name == "pieces":
            out["pieces"].append(value)
        else:
            out[name] = value
    for name in ("trainer_spec", "normalizer_spec"):
        if message == "model" and name not in out:
            out[name] = dict(_DEFAULTS[name])
    return out


# --- tokenizer.json ---------------------------------------------------------------------------

def _added(token_id: int, content: str, special: bool = True) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": special}


def _bos_template(bos: str, bos_id: int) -> dict:
    """BOS before a sequence (and before each of a pair), nothing after: training's framing of a
    document's start, and transformers 5's template for add_bos_token without add_eos_token."""
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def _tokenizer(added: list[dict], normalizer, pre_tokenizer, decoder, model) -> dict:
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "decoder": decoder, "model": model}


def bytes_json() -> dict:
    """``ByteTokenizer`` as a tokenizer.json: byte-level BPE, no merges, no regex split (the
    whole text is one word of byte characters, each one token), byte b at id b + 3."""
    alphabet = _byte_alphabet()
    vocab = {name: i for i, name in enumerate(BPE_SPECIALS)}
    vocab.update({alphabet[b]: BYTE_OFFSET + b for b in range(NUM_BYTES)})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "ignore_merges": False, "vocab": vocab, "merges": []}
    return _tokenizer([_added(i, name) for i, name in enumerate(BPE_SPECIALS)], None,
                      byte_level, dict(byte_level), model)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character map (the ``ByteLevel`` pre-tokenizer's), by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(NUM_BYTES + extra)
            extra += 1
    return [chars[b] for b in range(NUM_BYTES)]


def sentencepiece_json(data: bytes) -> dict:
    """A SentencePiece ``.model`` (Unigram or BPE) as a tokenizer.json that encodes and decodes
    as SentencePiece does: its normalizer (precompiled character map; leading, trailing and
    repeated spaces removed; spaces as U+2581; the dummy prefix), the pieces at their ids
    (Unigram: with their scores, user-defined pieces scored as SentencePiece's lattice scores
    them, and the pieces SentencePiece never matches in text (control, unknown, unused, byte)
    given ``UNREACHABLE``; BPE: a merge for every split of a normal piece into two, ranked by the
    piece's score, as SentencePiece merges the best-scoring pair first), byte fallback, and its
    decoding (U+2581 as a space, bytes, the unknown piece as its surface, the first space
    dropped). One difference is left: ``tokenizers``' Unigram can still match such a piece's
    name spelled out in the text (``<s>``, ``<unk>``, ``<0x41>``) where the model lacks one of its
    characters (an unknown character costs it more). ConfigError for a model type other than
    Unigram and BPE."""
    proto = read_proto(data)
    trainer, norm, pieces = proto["trainer_spec"], proto["normalizer_spec"], proto["pieces"]
    if trainer["model_type"] not in (UNIGRAM, BPE) or trainer["treat_whitespace_as_suffix"]:
        raise ConfigError("the run's SentencePiece model cannot be written as a tokenizer.json "
                          "(only Unigram and BPE models with whitespace as a prefix are "
                          "converted); train with such a model to export", field="run_dir")
    normalizers = []
    if norm["precompiled_charsmap"]:
        import base64
        normalizers.append({"type": "Precompiled", "precompiled_charsmap":
                            base64.b64encode(norm["precompiled_charsmap"]).decode()})
    if norm["remove_extra_whitespaces"]:
        normalizers += [_replace(r"\A +| +\z", ""), _replace(" {2,}", " ")]
    if norm["add_dummy_prefix"]:
        normalizers.append({"type": "Prepend", "prepend": " "})
    if norm["escape_whitespaces"]:
        normalizers.append(_replace(" ", SPACE, regex=False))
    unk_id, unk = trainer["unk_id"], pieces[trainer["unk_id"]]["piece"]
    if trainer["model_type"] == UNIGRAM:
        # A user-defined piece scores as in SentencePiece's lattice: above any normal pieces.
        best = max((p["score"] for p in pieces if p["type"] == NORMAL), default=0.0)
        score = {NORMAL: lambda p: p["score"],
                 USER_DEFINED: lambda p: len(p["piece"]) * best - 0.1}
        vocab = [[p["piece"], score.get(p["type"], lambda p: UNREACHABLE)(p)] for p in pieces]
        model = {"type": "Unigram", "unk_id": unk_id, "vocab": vocab,
                 "byte_fallback": trainer["byte_fallback"]}
    else:
        ids = {p["piece"]: i for i, p in enumerate(pieces)}
        mergeable = [(i, p) for i, p in enumerate(pieces) if p["type"] in (NORMAL, USER_DEFINED)]
        merges = [(-p["score"], i, k, [p["piece"][:k], p["piece"][k:]])
                  for i, p in mergeable for k in range(1, len(p["piece"]))
                  if p["piece"][:k] in ids and p["piece"][k:] in ids]
        model = {"type": "BPE", "dropout": None, "unk_token": unk,
                 "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                 "byte_fallback": trainer["byte_fallback"], "ignore_merges": False,
                 "vocab": ids, "merges": [m[-1] for m in sorted(merges)]}
    # The unknown piece's surface goes in after the first space is dropped (SentencePiece keeps
    # its space), through a stand-in character while the pieces are joined.
    decoders = [_replace(unk, UNK_STAND_IN, regex=False), _replace(SPACE, " ", regex=False),
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if norm["add_dummy_prefix"] or norm["remove_extra_whitespaces"]:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    decoders.append(_replace(UNK_STAND_IN, trainer["unk_surface"], regex=False))
    # Control pieces are special (decoding drops them); a BPE model's user-defined pieces are
    # added tokens, matched in the text before normalisation (as transformers converts them).
    kept = (CONTROL, USER_DEFINED) if trainer["model_type"] == BPE else (CONTROL,)
    added = [_added(i, p["piece"], special=p["type"] == CONTROL) for i, p in enumerate(pieces)
             if p["type"] in kept]
    return _tokenizer(added, {"type": "Sequence", "normalizers": normalizers}, None,
                      {"type": "Sequence", "decoders": decoders}, model)


def _replace(pattern: str, content: str, *, regex: bool = True) -> dict:
    return {"type": "Replace", "pattern": {"Regex" if regex else "String": pattern},
            "content": content}


def _new_name(role: str, taken) -> str:
    """A name for a special token a file lacks, not already one of its tokens."""
    candidates = (*SPECIAL_NAMES[role], f"<|jaxaccel_{role}|>")
    return next(name for name in candidates if name not in taken)


def tokenizer_json(tok) -> dict:
    """The tokenizer.json of jaxaccel tokenizer ``tok`` (module docstring): its pieces, PAD, BOS
    and EOS as special added tokens at ``tok``'s ids, BOS prepended by the post-processor."""
    if tok.kind == "bytes":
        out = bytes_json()
    elif tok.kind == "hf":
        with open(tok.path, encoding="utf-8") as f:
            out = json.load(f)
    else:
        with open(tok.path, "rb") as f:
            out = sentencepiece_json(f.read())
    names = _names(out)
    added = {t["id"]: t for t in out["added_tokens"]}
    for role in ("pad", "bos", "eos"):        # a role's new id after the others: tokenizer.py
        token_id = getattr(tok, f"{role}_id")
        if token_id not in names:
            if token_id != max([*names, -1]) + 1:
                raise ConfigError(f"the tokenizer's {role} id {token_id} is not next after its "
                                  f"vocabulary; it cannot be written as a tokenizer.json",
                                  field="run_dir")
            names[token_id] = _new_name(role, set(names.values()))
        added[token_id] = {**added.get(token_id, _added(token_id, names[token_id])),
                           "special": True}
    out["added_tokens"] = [added[i] for i in sorted(added)]
    bos_template = _bos_template(names[tok.bos_id], tok.bos_id)
    old = out.get("post_processor")
    keep = [old] if old and old.get("type") == "ByteLevel" else []   # offsets only
    out["post_processor"] = ({"type": "Sequence", "processors": keep + [bos_template]}
                             if keep else bos_template)
    return out


def _names(tokenizer: dict) -> dict[int, str]:
    """Token names by id of a tokenizer.json's model and added tokens."""
    model = tokenizer["model"]
    if model["type"] == "Unigram":
        names = {i: piece for i, (piece, _) in enumerate(model["vocab"])}
    else:
        vocab = model["vocab"]
        names = {i: piece for piece, i in vocab.items()} if isinstance(vocab, dict) \
            else dict(enumerate(vocab))
    names.update({t["id"]: t["content"] for t in tokenizer["added_tokens"]})
    return names


def tokenizer_config(tok, tokenizer: dict, context: int) -> dict:
    """transformers' tokenizer_config.json for ``tokenizer`` (``tokenizer_json(tok)``)."""
    names = _names(tokenizer)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": names[tok.bos_id],
            "eos_token": names[tok.eos_id], "pad_token": names[tok.pad_id],
            "add_bos_token": True, "add_eos_token": False, "model_max_length": context,
            "clean_up_tokenization_spaces": False, "split_special_tokens": tok.kind != "hf"}


def generation_config(tok, model_vocab: int) -> dict:
    """transformers' generation_config.json: the special ids, and the padded vocabulary's ids
    past the tokenizer's suppressed (``experiments.sample`` samples only below
    ``tok.vocab_size``)."""
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
            "suppress_tokens": list(range(tok.vocab_size, model_vocab))}


def files(tok, context: int, model_vocab: int | None = None) -> dict[str, str]:
    """The Hugging Face tokenizer files of ``tok`` by name, as text; the generation config too
    when ``model_vocab`` (the model's padded vocabulary) is given."""
    tokenizer = tokenizer_json(tok)
    out = {TOKENIZER_JSON: json.dumps(tokenizer, ensure_ascii=False),
           TOKENIZER_CONFIG: _pretty(tokenizer_config(tok, tokenizer, context))}
    if model_vocab is not None:
        out[GENERATION_CONFIG] = _pretty(generation_config(tok, model_vocab))
    return out


def _pretty(record: dict) -> str:
    return json.dumps(record, indent=2, ensure_ascii=False) + "\n"


def load(tokenizer_path: str, config: dict):
    """The ``tokenizers.Tokenizer`` of an exported tokenizer.json, with its config's
    ``split_special_tokens`` applied as transformers applies it."""
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(tokenizer_path)
    hf.encode_special_tokens = bool(config.get("split_special_tokens"))
    return hf


def mismatch(tok, hf, texts=(PROBE,)) -> str | None:
    """The first way ``hf`` (``load``) encodes or decodes ``texts`` unlike ``tok``, or None."""
    for text in texts:
        ours = tok.encode(text, bos=True, eos=False).tolist()
        theirs = hf.encode(text).ids
        if theirs != ours:
            return f"{text!r} encodes as {theirs[:12]}..., ours {ours[:12]}..."
        framed = tok.encode(text).tolist()
        if hf.decode(framed, skip_special_tokens=True) != tok.decode(framed):
            return f"{text!r} decodes as {hf.decode(framed, skip_special_tokens=True)!r}"
    return None
