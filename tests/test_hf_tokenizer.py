"""Hugging Face tokenizer files of each tokenizer kind, read by the ``tokenizers`` library as
transformers reads them: the same ids as ours (BOS prepended), the same text back, the special
tokens at our ids; and the SentencePiece model reader."""

import io
import json
import random

import pytest
from tokenizers import Tokenizer

from jaxaccel.data import hf_tokenizer as ht
from jaxaccel.core import tokenizer as tok_lib

TEXTS = [f"def function_{i}(value):\n    return value * {i} + 'héllo wörld'\n"
         for i in range(200)]
# Characters that SentencePiece normalises (NFKC, ideographic space), that a small vocabulary
# lacks (unknown pieces, byte fallback), and runs of whitespace.
ALPHABET = [*"abcdefxyz _()=+*'\n\t  #~", "é", "ö", "日", "🚀", "\u3000", "ﬁ", "Ａ"]


def probe_texts(n=150, seed=0):
    rng = random.Random(seed)
    return [ht.PROBE, "", " ", "  two  spaces  ", "\n", "return value * 3", TEXTS[7],
            *("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
              for _ in range(n))]


def sentencepiece(tmp_path, name, **options):
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_writer=model,
                                   minloglevel=2, **options)
    (tmp_path / name).write_bytes(model.getvalue())
    return tok_lib.open_file(str(tmp_path / name))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """One of each kind: bytes, a bpe:N tokenizer.json, a GPT-2-like tokenizer.json (BOS = EOS,
    no PAD), SentencePiece Unigram (no PAD: a new id after its pieces) and BPE with byte
    fallback and Llama's identity normaliser."""
    tmp = tmp_path_factory.mktemp("hf")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    gpt2.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300,
                                                        special_tokens=["<|endoftext|>"]))
    gpt2.save(str(tmp / "gpt2.json"))
    return {"bytes": tok_lib.ByteTokenizer(),
            "bpe": tok_lib.train_bpe(iter(TEXTS), 400, str(tmp / "bpe.json")),
            "gpt2": tok_lib.open_file(str(tmp / "gpt2.json")),
            "sp_unigram": sentencepiece(tmp, "unigram.model", vocab_size=120),
            "sp_bpe": sentencepiece(tmp, "bpe.model", vocab_size=300, model_type="bpe",
                                    byte_fallback=True, normalization_rule_name="identity",
                                    remove_extra_whitespaces=False)}


def exported(tok, tmp_path):
    """(tokenizers.Tokenizer of the written tokenizer.json, tokenizer_config, generation_config)."""
    files = ht.files(tok, context=64, model_vocab=tok.padded_vocab_size)
    for name, content in files.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
    config = json.loads(files[ht.TOKENIZER_CONFIG])
    hf = Tokenizer.from_file(str(tmp_path / ht.TOKENIZER_JSON))
    hf.encode_special_tokens = config["split_special_tokens"]    # as transformers sets it
    return hf, config, json.loads(files[ht.GENERATION_CONFIG])


KINDS = ["bytes", "bpe", "gpt2", "sp_unigram", "sp_bpe"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_exported_tokenizer_encodes_frames_and_decodes_like_ours(kind, tokenizers, tmp_path):
    tok = tokenizers[kind]
    hf, config, _ = exported(tok, tmp_path)
    for text in probe_texts():
        framed = tok.encode(text, bos=True, eos=False).tolist()
        assert hf.encode(text).ids == framed, text                  # BOS, as training framed
        assert framed[0] == tok.bos_id
        assert hf.encode(text, add_special_tokens=False).ids == framed[1:], text
        document = tok.encode(text).tolist()                        # BOS ... EOS
        assert hf.decode(document, skip_special_tokens=True) == tok.decode(document), text
    # PAD and the padded vocabulary's tail decode to nothing, as ours.
    ids = [*tok.encode("return value").tolist(), tok.pad_id, tok.padded_vocab_size - 1]
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids) == "return value"
    assert not config["add_eos_token"] and config["add_bos_token"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_special_tokens_are_ours_by_name_and_id(kind, tokenizers, tmp_path):
    tok = tokenizers[kind]
    hf, config, generation = exported(tok, tmp_path)
    for role in ("bos", "eos", "pad"):
        token_id = getattr(tok, f"{role}_id")
        assert hf.token_to_id(config[f"{role}_token"]) == token_id, role
        assert hf.id_to_token(token_id) == config[f"{role}_token"]
        assert generation[f"{role}_token_id"] == token_id
    special = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    assert {config["bos_token"], config["eos_token"], config["pad_token"]} <= special
    assert hf.get_vocab_size(with_added_tokens=True) == tok.vocab_size
    assert generation["suppress_tokens"] == list(range(tok.vocab_size, tok.padded_vocab_size))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == 64 and not config["clean_up_tokenization_spaces"]


def test_byte_ids_and_literal_special_text(tokenizers, tmp_path):
    tok = tokenizers["bytes"]
    hf, config, _ = exported(tok, tmp_path)
    assert (config["pad_token"], config["bos_token"], config["eos_token"]) \
        == ("<|pad|>", "<|bos|>", "<|eos|>")
    # Every byte is its own id b + 3, whatever the text; invalid UTF-8 decodes as ours.
    for data in (bytes(range(256)), b"\xff\xfe", "é".encode()[:1], b"a\xe2\x82b", b"\xf0\x9f"):
        ids = [tok_lib.BOS_ID, *(b + tok_lib.BYTE_OFFSET for b in data)]
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    text = "".join(map(chr, range(1, 256)))
    assert hf.encode(text).ids == tok.encode(text, eos=False).tolist()
    # A special token's text is bytes to us; split_special_tokens makes it bytes to them too.
    literal = "a<|bos|>b<|eos|>"
    assert config["split_special_tokens"]
    assert hf.encode(literal).ids == tok.encode(literal, eos=False).tolist()


def test_a_tokenizer_json_keeps_its_own_pieces_and_specials(tokenizers, tmp_path):
    tok = tokenizers["gpt2"]               # BOS = EOS = <|endoftext|>, PAD new after the vocab
    hf, config, _ = exported(tok, tmp_path)
    assert config["bos_token"] == config["eos_token"] == "<|endoftext|>"
    assert tok.pad_id == tok.base_size and hf.token_to_id(config["pad_token"]) == tok.pad_id
    assert not config["split_special_tokens"]       # ours matches a special's text too
    assert hf.encode("x<|endoftext|>").ids == tok.encode("x<|endoftext|>", eos=False).tolist()
    written = json.loads((tmp_path / ht.TOKENIZER_JSON).read_text())
    original = json.loads(open(tok.path).read())
    assert written["model"] == original["model"]
    assert written["post_processor"]["type"] == "Sequence"      # its ByteLevel kept, BOS after
    assert tok_lib.open_file(str(tmp_path / ht.TOKENIZER_JSON)).vocab_size == tok.vocab_size


def test_sentencepiece_pad_after_the_model_and_unknown_pieces(tokenizers, tmp_path):
    tok = tokenizers["sp_unigram"]
    hf, config, _ = exported(tok, tmp_path)
    assert tok.pad_id == 120 == tok.vocab_size - 1              # not in the .model
    assert config["pad_token"] == "<|pad|>" and hf.token_to_id("<|pad|>") == 120
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    text = "🚀 return 日本"                  # pieces the model lacks: one unknown id each run
    ids = tok.encode(text).tolist()
    assert 0 in ids and hf.encode(text).ids == ids[:-1]
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)   # ' ⁇ ' as ours


def test_a_sentencepiece_model_with_user_defined_and_control_pieces(tmp_path):
    tok = sentencepiece(tmp_path, "sym.model", vocab_size=120, normalization_rule_name="nfkc_cf",
                        user_defined_symbols=["<tab>"], control_symbols=["<ctl>"], pad_id=3)
    hf, config, _ = exported(tok, tmp_path)
    assert (tok.pad_id, config["pad_token"]) == (3, "<pad>")
    for text in [*probe_texts(60, seed=1), "x<tab>y <tab> Ａ"]:
        assert hf.encode(text).ids == tok.encode(text, eos=False).tolist(), text
        ids = tok.encode(text).tolist()
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)


def test_the_model_reader_matches_protobuf(tokenizers):
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    for kind in ("sp_unigram", "sp_bpe"):
        data = open(tokenizers[kind].path, "rb").read()
        ours, theirs = ht.read_proto(data), pb.ModelProto.FromString(data)
        assert [(p["piece"], p["type"]) for p in ours["pieces"]] \
            == [(p.piece, p.type) for p in theirs.pieces]
        assert [p["score"] for p in ours["pieces"]] == pytest.approx(
            [p.score for p in theirs.pieces])
        for section, fields in (("trainer_spec", ("model_type", "byte_fallback", "unk_id",
                                                  "unk_surface")),
                                ("normalizer_spec", ("precompiled_charsmap", "add_dummy_prefix",
                                                     "remove_extra_whitespaces"))):
            for field in fields:
                assert ours[section][field] == getattr(getattr(theirs, section), field), field
