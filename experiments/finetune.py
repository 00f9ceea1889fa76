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
import sys
import sysconfig

import jax
import optax
from flax import nnx

from experiments.common import (Experiment, Row, config_of, first, main_of, parse_list,
                                plot_loss_curves, relative, summary_fields, train_row)
from jaxaccel.model import contract as model_lib
from jaxaccel.techniques import surgery
from jaxaccel.run.config import (TrainConfig, build, check_ranges, override, read_config_file,
                                 setting)
from jaxaccel.data.corpus import corpus_of
from jaxaccel.core.errors import ConfigError
from jaxaccel.run.loop import evaluate, read_trained_run
from jaxaccel.run.loop.compile import eval_step_of
from jaxaccel.outputs.export import export_merged
from jaxaccel.model.contract import describe
from jaxaccel.core.sections import absolute_name
from jaxaccel.step.state import init_state

ROWS = ("full", "lora", "adapters")
STDLIB_TEXT = "stdlib-text"

# What a fine-tune takes from its base run: the model (the factory or preset and its shape),
# the initialisation scheme (its gates and removed norms are part of the weights) and how the
# base's blocks ran; the run-time choices (dropout, attention) are this config's.
BASE_SECTIONS = ("model", "gpt", "init", "sparsity", "token_drop")
BASE_FIELDS = ("remat.scan_layers",)
RUN_TIME = ("gpt.dropout", "gpt.attention")
# The fine-tuning runs' defaults; the base run (without --from) trains on the stdlib with the
# same batches for --base-steps.
DEFAULTS = {"data.path": STDLIB_TEXT, "data.batching": "pack", "data.seq_len": 256,
            "data.batch_size": 8, "run.steps": 150, "optimizer.learning_rate": 1e-3,
            "optimizer.warmup_steps": 10, "run.eval_every": 0, "run.checkpoint_every": 0,
            "lora.rank": 8, "adapters.dim": 16, "run.final_eval_batches": 40}


@dataclasses.dataclass
class FinetuneSettings:
    from_run: str | None = setting(None, "run directory of the trained model to tune (default: "
                                         "train a base model on the stdlib first)", flag="from")
    rows: str = setting(",".join(ROWS), "comma-separated rows: full, lora, adapters")
    lora_learning_rate: float = setting(1e-2, "peak learning rate of the lora and adapters rows "
                                              "(the full row uses --learning-rate)", above=0)
    base_steps: int = setting(400, "steps of the base model trained when --from is not given",
                              at_least=1)


class FinetuneConfig(config_of(FinetuneSettings)):
    """The fine-tuning config (the model's shape comes from the base run) plus what to compare."""

    def validate(self):
        """Before the base exists (no --from), LoRA and adapters are checked as far as they can
        be without the weights they start from: every field in range, the rest without them."""
        if self.run.init_from is not None:
            return TrainConfig.validate(self)
        check_ranges(self)
        TrainConfig.validate(override(self, {"lora.rank": 0, "adapters.dim": 0}))


def stdlib_text(path: str):
    """A JSONL corpus of the standard library's ``.txt`` files at ``path``: one document
    per paragraph (blank-line separated, so the validation split, by line, samples every file),
    from the files that are at least 99 % ASCII (a few test files hold CJK text, bytes a model
    trained on code has never seen, which would make the comparison about byte frequencies)."""
    root = sysconfig.get_paths()["stdlib"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
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


def stdlib_text_path(run_root: str) -> str:
    return os.path.join(run_root, STDLIB_TEXT, "stdlib-text.jsonl")


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


def prepare(cfg: FinetuneConfig) -> FinetuneConfig:
    """The stdlib-text corpus's path in the run root (``shared`` writes it), and with --from
    the base's model and weights."""
    exp, more = cfg.experiment, {}
    if cfg.data.path == STDLIB_TEXT:
        more["data.path"] = stdlib_text_path(cfg.run.run_dir)
    if exp.from_run is not None:
        if not os.path.isfile(os.path.join(exp.from_run, "config.yaml")):
            raise ConfigError(f"--from {exp.from_run!r} is not a run directory (no config.yaml "
                              f"in it); pass the run_dir of a trained run",
                              field="experiment.from_run")
        base = base_model_fields(exp.from_run)
        check_model_left_to_base(cfg, base, exp.from_run)
        more.update({**base, "run.init_from": exp.from_run})
    return override(cfg, more)


def check_model_left_to_base(cfg: FinetuneConfig, base: dict, run_dir: str) -> None:
    """A ConfigError for a model setting given with --from that the base's would replace (a
    fine-tune takes its base's model): one that differs from this experiment's default and from
    the base run's."""
    default = build(FinetuneConfig, DEFAULTS)
    for path, theirs in base.items():
        section, _, name = path.partition(".")
        mine, unset = (getattr(getattr(c, section), name) for c in (cfg, default))
        if path == "model.name":
            mine, theirs = absolute_name(mine), absolute_name(theirs)
        if mine != theirs and mine != unset:
            raise ConfigError(f"--from {run_dir} trained with {path}={theirs!r}, and this run "
                              f"gives {mine!r}: a fine-tune takes its base's model and settings "
                              f"of the model; leave {path} out, or fine-tune a run of that model",
                              field=path)


def lora_targets(cfg) -> str:
    """The layers LoRA wraps: ``--lora-targets``, else the model's default (q,v for jaxaccel's
    GPT)."""
    if cfg.lora.targets:
        return cfg.lora.targets
    model = model_lib.abstract(lambda: model_lib.build(cfg.model, cfg.gpt,
                                                       jax.random.PRNGKey(0)))
    return surgery.default_targets(model, "lora", "blocks", "lora.targets")


def rows(cfg: FinetuneConfig) -> list[Row]:
    """The base, not tuned, then the chosen rows from it."""
    chosen = sorted(parse_list(cfg.experiment.rows, "experiment.rows", valid=ROWS),
                    key=ROWS.index)
    if "lora" in chosen and cfg.lora.rank < 1:
        raise ConfigError(f"lora_rank must be at least 1 for the lora row, got "
                          f"{cfg.lora.rank}", field="lora.rank")
    if "adapters" in chosen and cfg.adapters.dim < 1:
        raise ConfigError(f"adapter_dim must be at least 1 for the adapters row, got "
                          f"{cfg.adapters.dim}", field="adapters.dim")
    return [row(cfg, name) for name in ["base", *chosen]]


def row(cfg: FinetuneConfig, name: str) -> Row:
    """The base (not tuned) and full fine-tuning without LoRA and adapters; LoRA or adapters,
    the other off, at --lora-learning-rate."""
    tuned = {"optimizer.learning_rate": cfg.experiment.lora_learning_rate}
    if name == "lora":
        label = f"LoRA r{cfg.lora.rank} {lora_targets(cfg)}"
        settings = {"adapters.dim": 0, **tuned}
    elif name == "adapters":
        label, settings = f"adapters {cfg.adapters.dim}", {"lora.rank": 0, **tuned}
    else:
        label = "base, not tuned" if name == "base" else "full fine-tuning"
        settings = {"lora.rank": 0, "adapters.dim": 0}
    return Row(label, settings, {"row": name}, directory=name)


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


def base(run) -> dict:
    """The base, not tuned: trained on the stdlib first without --from, then evaluated on the
    tuning corpus."""
    base_dir = run.cfg.experiment.from_run
    if base_dir is None:
        train_row(run.config(data__path="stdlib", run__steps=run.cfg.experiment.base_steps,
                             optimizer__learning_rate=None, optimizer__warmup_steps=50))
        base_dir = run.run_dir
    return {"run_dir": base_dir,
            "val_loss": evaluate_model(run.config(), read_trained_run(base_dir)[1])}


def tune(run) -> dict:
    """A row fine-tuned from the base; LoRA's then merged into the base weights, exported, read
    back and evaluated again."""
    cfg = run.config(run__init_from=run.previous[0]["run_dir"])
    summary = train_row(cfg)
    result = {**summary_fields(summary), "trainable_params": summary.trainable_params,
              "trainable_share": summary.trainable_params / summary.params,
              "state_bytes": summary.optimizer_state_bytes,
              "step_bytes": (summary.step_memory_bytes or {}).get("total"),
              "peak_bytes": summary.peak_memory_bytes, "learning_rate": summary.learning_rate,
              "merged_val_loss": None, "merged_dir": None}
    if run.row.fields["row"] == "lora":
        result["merged_dir"] = export_merged(run.run_dir, os.path.join(run.run_dir, "merged"))
        result["merged_val_loss"] = evaluate_model(cfg, read_trained_run(result["merged_dir"])[1])
    return result


def setup(cfg: FinetuneConfig) -> str:
    base = cfg.experiment.from_run or os.path.join(cfg.run.run_dir, "base")
    return (f"{describe(cfg.model, cfg.gpt)} model from {base}, fine-tuned {cfg.run.steps} "
            f"steps on {cfg.data.path}, seq_len {cfg.seq_len}")


EXPERIMENT = Experiment(
    name="finetune", doc=__doc__, config=FinetuneConfig, rows=rows, setup=setup,
    prepare=prepare,
    measure=lambda run: base(run) if run.row.fields["row"] == "base" else tune(run),
    shared=lambda cfg: (stdlib_text(cfg.data.path)
                        if cfg.data.path == stdlib_text_path(cfg.run.run_dir) else None),
    defaults=DEFAULTS,
    fixed=("run.init_from", "stacking.stages"),
    columns=[("label", "row", ""), ("trainable_params", "trainable", ",d"),
             ("trainable_share", "of model", ".2%"), ("state_bytes", "opt state B", ",d"),
             ("state_share", "of full's", ".2%"), ("step_ms", "step ms", ".1f"),
             ("step_bytes", "step device B", ",d"), ("peak_bytes", "peak B", ",d"),
             ("val_loss", "val loss", ".4f"), ("merged_val_loss", "merged val", ".4f"),
             ("vs_full", "vs full", "+.2%")],
    compare=lambda cfg, rows, partial: relative(
        rows[1:], first(rows, row="full"), state_share=("state_bytes", "ratio"),
        vs_full=("val_loss", "change")),
    meta=lambda cfg, rows: {"base": rows[0]["run_dir"] if rows else cfg.experiment.from_run},
    plot=lambda path, cfg, rows: plot_loss_curves(
        path, {r["label"]: r["run_dir"] for r in rows[1:]},
        title=f"fine-tuning {describe(cfg.model, cfg.gpt)} on "
              f"{os.path.basename(cfg.data.path)}"))
main = main_of(EXPERIMENT)


if __name__ == "__main__":
    sys.exit(main())
