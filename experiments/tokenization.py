"""The tokenizer as an acceleration technique: bytes against byte-level BPEs of a few sizes, on
the same model and the same compute.

    python -m experiments.tokenization                    # bytes, bpe:1024, bpe:4096 on the CPU
    python -m experiments.tokenization --tokenizers bytes,bpe:8192 --model small --steps 2000
    python -m experiments.tokenization --json tokenization.json

Every row trains the same model shape (only its vocabulary follows the tokenizer) for the same
steps of the same batch shape, so each computes about as many token positions. A subword token
carries several bytes of text, so the same compute trains on more text. The table reports real
tokens/s, the bytes of text per token and per second trained on, and the validation loss in bits
per byte of text (total nats over the split / its UTF-8 bytes / ln 2), the figure that compares
across tokenizers, beside each tokenizer's unigram baseline in the same unit. A bpe:N tokenizer
is trained on the corpus's training split the first time and cached (``jaxaccel.core.tokenizer``);
``tokenize s`` is the time to load, tokenize or read back the corpus for the row.
"""

import dataclasses
import os
import sys
import time

from experiments.common import (Experiment, Row, config_of, gpt_shape, main_of, parse_list,
                                summary_fields, train_row)
from jaxaccel.run.config import setting
from jaxaccel.data.corpus import corpus_of
from jaxaccel.core.errors import ConfigError
from jaxaccel.step.metrics import plot_curves, read_metrics, token_curve
from jaxaccel.core.sections import describe
from jaxaccel.core.tokenizer import parse_spec


@dataclasses.dataclass
class TokenizationSettings:
    tokenizers: str = setting("bytes,bpe:1024,bpe:4096",
                              "comma-separated tokenizers to compare (each as --tokenizer takes)")


TokenizationConfig = config_of(TokenizationSettings)


def rows(cfg: TokenizationConfig) -> list[Row]:
    """One row per tokenizer, every spec checked before any row."""
    if not cfg.experiment.tokenizers.replace(",", "").strip():
        raise ConfigError("no tokenizers to compare; pass e.g. --tokenizers bytes,bpe:1024",
                          field="experiment.tokenizers")
    specs = parse_list(cfg.experiment.tokenizers, "experiment.tokenizers")
    for spec in specs:
        parse_spec(spec)
    # each row's directory is its spec made one folder name (Row.dirname): a tokenizer file's
    # path would put the row's run on that file
    return [Row(spec, {"data.tokenizer": spec}, {"tokenizer": spec}) for spec in specs]


def measure(run) -> dict:
    """Tokenize (a bpe:N is trained once; the run reads the cache), then train the row."""
    cfg = run.config()
    began = time.perf_counter()
    corpus = corpus_of(cfg.data)
    tokenize_s = time.perf_counter() - began
    bytes_per_token = corpus.stats["train_text_bytes"] / corpus.stats["train_targets"]
    summary = train_row(cfg)
    return {**summary_fields(summary), "vocab_size": cfg.model.vocab_size,
            "bytes_per_token": bytes_per_token, "tokens_per_s": summary.real_tokens_per_s,
            "text_bytes_per_s": summary.real_tokens_per_s * bytes_per_token,
            "text_mb": summary.real_tokens * bytes_per_token / 1e6, "tokenize_s": tokenize_s}


def plot(path: str, cfg: TokenizationConfig, rows: list[dict]):
    """Bits per byte against the bytes of text trained on: comparable across tokenizers."""
    curves = {}
    for r in rows:
        tokens, bpb = token_curve(read_metrics(os.path.join(r["run_dir"], "metrics.jsonl")))
        curves[r["tokenizer"]] = ([t * r["bytes_per_token"] for t in tokens], bpb)
    plot_curves(path, curves, xlabel="bytes of text trained on",
                title=f"tokenizers, {describe(cfg.model, cfg.gpt)} model, seq_len {cfg.seq_len}")


def setup(cfg: TokenizationConfig) -> str:
    model, shape = describe(cfg.model, cfg.gpt), gpt_shape(cfg)
    return (f"{f'{shape.n_layers}x{shape.d_model} model ({model})' if shape else f'{model} model'}"
            f", {cfg.run.steps:,} steps of {cfg.data.batch_size} x {cfg.seq_len} per row, "
            f"{cfg.data.batching} batching, {cfg.data.path}")


EXPERIMENT = Experiment(
    name="tokenization", doc=__doc__, config=TokenizationConfig, rows=rows, measure=measure,
    setup=setup, plot=plot,
    # Every row trains the same steps of the same batch shape: the same compute, whatever the
    # text.
    defaults={"data.batching": "pack", "data.seq_len": 256, "data.batch_size": 8,
              "run.steps": 300, "optimizer.warmup_steps": 30, "run.eval_every": 0,
              "run.checkpoint_every": 0},
    fixed=("data.tokenizer", "run.train_tokens"),
    row_flags={"data.tokenizer": "experiment.tokenizers"},
    columns=[("tokenizer", "tokenizer", ""), ("vocab_size", "vocab", ",d"),
             ("params", "params", ",d"), ("bytes_per_token", "bytes/token", ".2f"),
             ("tokens_per_s", "real tok/s", ",.0f"), ("text_bytes_per_s", "text bytes/s", ",.0f"),
             ("text_mb", "text MB trained", ".2f"), ("val_bpb", "val bits/byte", ".3f"),
             ("unigram_bpb", "unigram bits/byte", ".3f"), ("tokenize_s", "tokenize s", ".1f"),
             ("wall_s", "wall s", ".1f")])
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
