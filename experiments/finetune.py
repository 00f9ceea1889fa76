"""Fine-tuning a trained model: all weights, LoRA, or bottleneck adapters, side by side on the
same tokens of a corpus the model has not seen.

    python -m experiments.finetune                          # trains a base first; ~8 CPU minutes
    python -m experiments.finetune --from runs/train-...    # tune that run's model
    python -m experiments.finetune --from R --lora-rank 8 --lora-targets q,v --data DIR
    python -m experiments.finetune --rows lora --json finetune.json

Without ``--from`` the experiment first trains a base model on the stdlib corpus
(``--base-steps``). Each row then starts from the base's weights (``run.init_from``) and trains
the same steps on the same batches of ``--data``: by default ``stdlib-text``, the standard
library's ``.txt`` files (prose, data and notes that the base, trained on its Python files, never
saw), written as a JSONL corpus of paragraphs in the run root. Rows (``--rows``):

- ``full``: every weight trains (``--learning-rate``);
- ``lora``: LoRA of ``--lora-rank`` on ``--lora-targets``, the base frozen
  (``--lora-learning-rate``); after training its LoRA is merged into the base weights, the
  merged model exported as a run directory (``merged/`` in the row's directory) and evaluated
  again: the ``merged val`` column, which must equal the row's own;
- ``adapters``: bottleneck adapters of ``--adapter-dim`` on every branch, the base frozen
  (``--lora-learning-rate``).

The table reports trainable parameters (and their share of the model), the optimizer state's
bytes (and its share of full fine-tuning's), the step time, the compiled step's device bytes
(parameters, optimizer state, gradients and activations: what the device must hold), the
device's measured peak where the backend reports one (GPUs), and the validation loss against
full fine-tuning's; the base model's loss on the same validation split, before tuning, heads the
table.
"""

import dataclasses
import json
import os
import signal
import sys
import sysconfig
import time

import jax
import optax
from flax import nnx

from experiments.common import (command, environment, parse_list, plot_loss_curves,
                                train_until_stopped, write_json)
from jaxaccel import model as model_lib, surgery, techniques
from jaxaccel.config import TrainConfig, build, override, parse, read_config_file, setting
from jaxaccel.corpus import corpus_of
from jaxaccel.errors import ConfigError
from jaxaccel.loop import evaluate, read_trained_run
from jaxaccel.loop.compile import eval_step_of
from jaxaccel.loop.record import export_merged
from jaxaccel.model import describe
from jaxaccel.report import format_table
from jaxaccel.state import init_state

ROWS = ("full", "lora", "adapters")
STDLIB_TEXT = "stdlib-text"


@dataclasses.dataclass
class FinetuneSettings:
    from_run: str | None = setting(None, "run directory of the trained model to tune (default: "
                                         "train a base model on the stdlib first)", flag="from")
    rows: str = setting(",".join(ROWS), "comma-separated rows: full, lora, adapters")
    lora_learning_rate: float = setting(1e-2, "peak learning rate of the lora and adapters rows "
                                              "(the full row uses --learning-rate)")
    base_steps: int = setting(400, "steps of the base model trained when --from is not given")


@dataclasses.dataclass
class FinetuneConfig(TrainConfig):
    """The fine-tuning config (the model's shape comes from the base run) plus what to compare."""

    experiment: FinetuneSettings = dataclasses.field(default_factory=FinetuneSettings)


# The fine-tuning runs' defaults; the base run (without --from) trains on the stdlib with the
# same batches for --base-steps.
DEFAULTS = {"data.path": STDLIB_TEXT, "data.batching": "pack", "data.seq_len": 256,
            "data.batch_size": 8, "run.steps": 150, "optimizer.learning_rate": 1e-3,
            "optimizer.warmup_steps": 10, "run.eval_every": 0, "run.checkpoint_every": 0,
            "lora.rank": 8, "adapters.dim": 16, "run.final_eval_batches": 40}
FIXED = ("run.init_from", "stacking.stages")
# What a fine-tune takes from its base run: the model (the factory or preset and its shape),
# the initialisation scheme (its gates and removed norms are part of the weights) and how the
# base's blocks ran; the run-time choices (dropout, attention) are this config's.
BASE_SECTIONS = ("model", "gpt", "init", "sparsity", "token_drop")
BASE_FIELDS = ("remat.scan_layers",)
RUN_TIME = ("gpt.dropout", "gpt.attention")

COLUMNS = [
    ("label", "row", ""),
    ("trainable_params", "trainable", ",d"),
    ("trainable_share", "of model", ".2%"),
    ("state_bytes", "opt state B", ",d"),
    ("state_share", "of full's", ".2%"),
    ("step_ms", "step ms", ".1f"),
    ("step_bytes", "step device B", ",d"),
    ("peak_bytes", "peak B", ",d"),
    ("val_loss", "val loss", ".4f"),
    ("merged_val_loss", "merged val", ".4f"),
    ("vs_full", "vs full", "+.2%"),
]


class Interrupted(Exception):
    """A row (or the base) was stopped by a signal; the experiment stops as a whole."""


def stdlib_text(directory: str) -> str:
    """A JSONL corpus of the standard library's ``.txt`` files in ``directory``: one document
    per paragraph (blank-line separated, so the validation split, by line, samples every file),
    from the files that are at least 99 % ASCII (a few test files hold CJK text, bytes a model
    trained on code has never seen, which would make the comparison about byte frequencies)."""
    root = sysconfig.get_paths()["stdlib"]
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "stdlib-text.jsonl")
    with open(path, "w") as out:
        for dirpath, dirnames, filenames in sorted(os.walk(root)):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
            for name in sorted(filenames):
                if not name.endswith(".txt"):
                    continue
                data = open(os.path.join(dirpath, name), "rb").read()
                if sum(byte < 128 for byte in data) < 0.99 * len(data):
                    continue
                text = data.decode("utf-8", errors="replace")
                for paragraph in text.split("\n\n"):
                    if paragraph.strip():
                        out.write(json.dumps({"text": paragraph + "\n"}) + "\n")
    return path


def base_model_fields(run_dir: str) -> dict:
    """The model settings of the run in ``run_dir`` as overrides (``BASE_SECTIONS``,
    ``BASE_FIELDS``); LoRA, adapters and the run-time choices (dropout, remat, attention,
    stochastic depth) left to this config."""
    trained = build(TrainConfig, read_config_file(os.path.join(run_dir, "config.yaml")))
    fields = {f"{section}.{k}": v for section in BASE_SECTIONS
              for k, v in dataclasses.asdict(getattr(trained, section)).items()}
    fields.update({path: getattr(getattr(trained, path.partition(".")[0]),
                                 path.partition(".")[2]) for path in BASE_FIELDS})
    return {k: v for k, v in fields.items() if k not in RUN_TIME}


def row_config(cfg: FinetuneConfig, row: str, base_fields: dict, base_dir: str | None):
    """The training config of one row: the base's model with the row's LoRA or adapters."""
    exp = cfg.experiment
    settings = {"full": {"lora.rank": 0, "adapters.dim": 0},
                "lora": {"adapters.dim": 0,
                         "optimizer.learning_rate": exp.lora_learning_rate},
                "adapters": {"lora.rank": 0,
                             "optimizer.learning_rate": exp.lora_learning_rate}}[row]
    return override(cfg, {**base_fields, **settings, "run.init_from": base_dir,
                          "run.run_dir": None, "run.json": None})


def lora_targets(cfg) -> str:
    """The layers LoRA wraps: ``--lora-targets``, else the model's default (q,v for jaxaccel's
    GPT)."""
    if cfg.lora.targets:
        return cfg.lora.targets
    model = model_lib.abstract(lambda: model_lib.build(cfg.model, cfg.gpt,
                                                       jax.random.PRNGKey(0)))
    return surgery.default_targets(model, "lora", "blocks", "lora.targets")


def train_base(cfg: FinetuneConfig, run_root: str) -> str:
    """Train the base model on the stdlib corpus; its run directory."""
    run_dir = os.path.join(run_root, "base")
    summary = train_until_stopped(override(cfg, {
        "data.path": "stdlib", "run.steps": cfg.experiment.base_steps,
        "optimizer.learning_rate": None, "optimizer.warmup_steps": 50, "lora.rank": 0,
        "adapters.dim": 0, "run.run_dir": run_dir, "run.json": None}))
    if summary.interrupted:
        raise Interrupted(summary.interrupted)
    return run_dir


def run_row(row_cfg, row: str, label: str, run_dir: str, full: dict | None) -> dict:
    """Fine-tune one row from the base and reduce its summary to a table row."""
    summary = train_until_stopped(override(row_cfg, {"run.run_dir": run_dir}))
    if summary.interrupted:
        raise Interrupted(summary.interrupted)
    result = {
        "row": row, "label": label, "params": summary.params,
        "trainable_params": summary.trainable_params,
        "trainable_share": summary.trainable_params / summary.params,
        "state_bytes": summary.optimizer_state_bytes,
        "state_share": summary.optimizer_state_bytes / (full or {}).get(
            "state_bytes", summary.optimizer_state_bytes),
        "step_ms": 1e3 * summary.train_s / max(summary.steps_this_run, 1),
        "step_bytes": (summary.step_memory_bytes or {}).get("total"),
        "peak_bytes": summary.peak_memory_bytes, "val_loss": summary.val_loss,
        "val_bpb": summary.val_bpb, "val_tokens": summary.val_tokens,
        "diverged_at_step": summary.diverged_at_step,
        "real_tokens": summary.real_tokens, "steps": summary.steps,
        "learning_rate": summary.learning_rate, "run_dir": run_dir,
        "merged_val_loss": None, "merged_dir": None,
        "vs_full": summary.val_loss / full["val_loss"] - 1 if full else None,
    }
    if row == "lora":        # merge, export, read the export back and evaluate it
        merged_dir = export_merged(run_dir, os.path.join(run_dir, "merged"))
        result["merged_dir"] = merged_dir
        result["merged_val_loss"] = evaluate_model(row_cfg, read_trained_run(merged_dir)[1])
    return result


def evaluate_model(cfg, model) -> float:
    """Validation loss of ``model`` (a trained run's, ``read_trained_run``) on ``cfg``'s corpus,
    over the batches a run's final evaluation takes."""
    corpus = corpus_of(cfg.data)
    eval_step = jax.jit(eval_step_of(cfg, model))
    state = init_state(nnx.state(model), optax.identity(), cfg.run.seed)
    loss, _ = evaluate(eval_step, state, corpus.val,
                       seq_len=cfg.seq_len, batch_size=cfg.run.eval_batch_size or cfg.batch_rows(),
                       max_batches=cfg.run.final_eval_batches)
    return loss


def check_settings(cfg: FinetuneConfig, rows: list[str]):
    """Every setting the rows use, before any work (one ConfigError line otherwise)."""
    exp = cfg.experiment
    if "lora" in rows and cfg.lora.rank < 1:
        raise ConfigError(f"lora_rank must be at least 1 for the lora row, got "
                          f"{cfg.lora.rank}", field="lora.rank")
    if "adapters" in rows and cfg.adapters.dim < 1:
        raise ConfigError(f"adapter_dim must be at least 1 for the adapters row, got "
                          f"{cfg.adapters.dim}", field="adapters.dim")
    if not 0 < exp.lora_learning_rate < float("inf"):
        raise ConfigError(f"lora_learning_rate must be a positive finite number, got "
                          f"{exp.lora_learning_rate}", field="experiment.lora_learning_rate")
    if exp.base_steps < 1:
        raise ConfigError(f"base_steps must be at least 1, got {exp.base_steps}",
                          field="experiment.base_steps")
    if exp.from_run is not None and not os.path.isfile(os.path.join(exp.from_run,
                                                                    "config.yaml")):
        raise ConfigError(f"--from {exp.from_run!r} is not a run directory (no config.yaml in "
                          f"it); pass the run_dir of a trained run", field="experiment.from_run")
    base_fields = base_model_fields(exp.from_run) if exp.from_run else {}
    for row in rows:
        row_cfg = row_config(cfg, row, base_fields, exp.from_run)
        if exp.from_run is not None:
            row_cfg.validate()
        else:
            override(row_cfg, {"lora.rank": 0, "adapters.dim": 0}).validate()
        techniques.abstract(row_cfg)    # the row's model: LoRA's rank and targets, adapters


@command(FinetuneConfig)
def main(argv=None) -> int:
    cfg = parse(argv, FinetuneConfig, defaults=DEFAULTS, fixed=FIXED,
                description=__doc__.split("\n\n")[0])
    exp = cfg.experiment
    rows = sorted(parse_list(exp.rows, "experiment.rows", valid=ROWS), key=ROWS.index)
    check_settings(cfg, rows)
    run_root = cfg.run.run_dir or os.path.join("runs", time.strftime("finetune-%Y%m%d-%H%M%S"))
    if cfg.data.path == STDLIB_TEXT:
        cfg = override(cfg, {"data.path": stdlib_text(os.path.join(run_root, "stdlib-text"))})

    results, partial, base_dir = [], None, exp.from_run
    try:
        base_dir = base_dir or train_base(cfg, run_root)
        base_fields = base_model_fields(base_dir)
        base_cfg = override(cfg, {**base_fields, "lora.rank": 0, "adapters.dim": 0})
        results.append({"row": "base", "label": "base, not tuned", "run_dir": base_dir,
                        "val_loss": evaluate_model(base_cfg, read_trained_run(base_dir)[1])})
        full = None
        for row in rows:
            label = {"full": "full fine-tuning",
                     "lora": f"LoRA r{cfg.lora.rank} {lora_targets(base_cfg)}",
                     "adapters": f"adapters {cfg.adapters.dim}"}[row]
            result = run_row(row_config(cfg, row, base_fields, base_dir), row, label,
                             os.path.join(run_root, row), full)
            full = result if row == "full" else full
            results.append(result)
    except Interrupted as stop:
        partial = str(stop)

    model = describe(base_cfg.model, base_cfg.gpt) if results else describe(cfg.model, cfg.gpt)
    meta = {"model": model, "base": base_dir, "data": cfg.data.path, "steps": cfg.run.steps,
            "seq_len": cfg.seq_len, "batch_size": cfg.data.batch_size, **environment(),
            "run_dir": run_root, "interrupted": partial}
    print(f"\n{model} model from {base_dir}, fine-tuned {cfg.run.steps} steps on "
          f"{cfg.data.path}, seq_len {cfg.seq_len}, {meta['device']}, jax {meta['jax_version']}"
          + (f" (PARTIAL: stopped by {partial})" if partial else ""))
    if results:
        print(format_table(results, COLUMNS))
    tuned = [r for r in results if r["row"] != "base"]
    if tuned:
        plot_loss_curves(os.path.join(run_root, "finetune.png"),
                         {r["label"]: r["run_dir"] for r in tuned},
                         title=f"fine-tuning {model} on {os.path.basename(cfg.data.path)}")
    write_json(cfg.run.json, results, meta)
    if partial:
        return 128 + getattr(signal.Signals, partial, signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
