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
is trained on the corpus's training split the first time and cached (``jaxaccel.tokenizer``);
``tokenize s`` is the time to load, tokenize or read back the corpus for the row.
"""

import dataclasses
import os
import sys
import time

from experiments.common import (Interrupted, command, environment, exit_code, gpt_shape,
                                parse_list, train_row, write_json)
from jaxaccel.config import TrainConfig, override, parse, setting
from jaxaccel.corpus import corpus_of
from jaxaccel.errors import ConfigError
from jaxaccel.metrics import plot_curves, read_metrics, token_curve
from jaxaccel.model import describe
from jaxaccel.report import format_table
from jaxaccel.tokenizer import parse_spec


@dataclasses.dataclass
class TokenizationSettings:
    tokenizers: str = setting("bytes,bpe:1024,bpe:4096",
                              "comma-separated tokenizers to compare (each as --tokenizer takes)")


@dataclasses.dataclass
class TokenizationConfig(TrainConfig):
    """The training config (with this experiment's defaults) plus the tokenizers to compare."""

    experiment: TokenizationSettings = dataclasses.field(default_factory=TokenizationSettings)


# Every row trains the same steps of the same batch shape: the same compute, whatever the text.
DEFAULTS = {"data.batching": "pack", "data.seq_len": 256, "data.batch_size": 8,
            "run.steps": 300, "optimizer.warmup_steps": 30, "run.eval_every": 0,
            "run.checkpoint_every": 0}
FIXED = ("data.tokenizer", "run.train_tokens")

COLUMNS = [
    ("tokenizer", "tokenizer", ""),
    ("vocab_size", "vocab", ",d"),
    ("params", "params", ",d"),
    ("bytes_per_token", "bytes/token", ".2f"),
    ("tokens_per_s", "real tok/s", ",.0f"),
    ("text_bytes_per_s", "text bytes/s", ",.0f"),
    ("text_mb", "text MB trained", ".2f"),
    ("val_bpb", "val bits/byte", ".3f"),
    ("unigram_bpb", "unigram bits/byte", ".3f"),
    ("tokenize_s", "tokenize s", ".1f"),
    ("wall_s", "wall s", ".1f"),
]


def run_one(cfg: TokenizationConfig, run_root: str, spec: str) -> dict:
    """Train the model on ``spec``'s tokens and reduce its summary to a table row."""
    row_cfg = override(cfg, {"data.tokenizer": spec, "run.json": None,
                             "run.run_dir": os.path.join(run_root, spec.replace(":", "-"))})
    began = time.perf_counter()
    corpus = corpus_of(row_cfg.data)          # trains a bpe:N once; the run reads the cache
    tokenize_s = time.perf_counter() - began
    bytes_per_token = corpus.stats["train_text_bytes"] / corpus.stats["train_targets"]
    summary = train_row(row_cfg)
    return {
        "tokenizer": spec,
        "vocab_size": row_cfg.model.vocab_size,
        "params": summary.params,
        "bytes_per_token": bytes_per_token,
        "steps": summary.steps,
        "real_tokens": summary.real_tokens,
        "tokens_per_s": summary.real_tokens_per_s,
        "text_bytes_per_s": summary.real_tokens_per_s * bytes_per_token,
        "text_mb": summary.real_tokens * bytes_per_token / 1e6,
        "val_loss": summary.val_loss,
        "val_bpb": summary.val_bpb,
        "unigram_bpb": summary.unigram_bpb,
        "tokenize_s": tokenize_s,
        "wall_s": summary.wall_s,
        "run_dir": row_cfg.run.run_dir,
    }


@command(TokenizationConfig)
def main(argv=None) -> int:
    cfg = parse(argv, TokenizationConfig, defaults=DEFAULTS, fixed=FIXED,
                description=__doc__.split("\n\n")[0])
    cfg.validate()
    specs = parse_list(cfg.experiment.tokenizers, "experiment.tokenizers")
    for spec in specs:
        parse_spec(spec)            # one error line for a bad spec, before any row trains
    if not specs:
        raise ConfigError("no tokenizers to compare; pass e.g. --tokenizers bytes,bpe:1024",
                          field="experiment.tokenizers")
    run_root = cfg.run.run_dir or os.path.join("runs",
                                               time.strftime("tokenization-%Y%m%d-%H%M%S"))
    rows, partial = [], None
    try:
        for spec in specs:
            rows.append(run_one(cfg, run_root, spec))
    except Interrupted as stop:         # the cut row is not a result; later rows do not run
        partial = stop.signal

    model = describe(cfg.model, cfg.gpt)
    meta = {"model": model, "data": cfg.data.path, "batching": cfg.data.batching,
            "seq_len": cfg.seq_len, "batch_size": cfg.data.batch_size, "steps": cfg.run.steps,
            **environment(), "run_dir": run_root, "interrupted": partial}
    shape = gpt_shape(cfg)
    print(f"\n{f'{shape.n_layers}x{shape.d_model} model ({model})' if shape else f'{model} model'}"
          f", {cfg.run.steps:,} steps "
          f"of {cfg.data.batch_size} x {cfg.seq_len} per row, {cfg.data.batching} batching, "
          f"{cfg.data.path}, {meta['device']}, jax {meta['jax_version']}"
          + (f" (PARTIAL: stopped by {partial}; {len(rows)} of {len(specs)} rows ran)"
             if partial else ""))
    print(format_table(rows, COLUMNS))
    curves = {}
    for r in rows:        # bits per byte against the bytes of text trained on: comparable
        tokens, bpb = token_curve(read_metrics(os.path.join(r["run_dir"], "metrics.jsonl")))
        curves[r["tokenizer"]] = ([t * r["bytes_per_token"] for t in tokens], bpb)
    if curves:
        plot_curves(os.path.join(run_root, "tokenization.png"), curves,
                    xlabel="bytes of text trained on",
                    title=f"tokenizers, {model} model, seq_len {cfg.seq_len}")
    write_json(cfg.run.json, rows, meta)
    return exit_code(partial)


if __name__ == "__main__":
    sys.exit(main())
