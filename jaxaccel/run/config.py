"""Run configuration: nested dataclass sections, a YAML file, overrides and flags.

A ``TrainConfig`` has a section per concern (``model``: a GPT preset or one's own factory; ``gpt``:
the preset's fields; ``data``, ``optimizer``, ``precision``, ``mesh``, ``run``) and one per
technique, declared in ``jaxaccel.core.sections``; an experiment's config adds ``experiment``. In
``parse`` every field is a flag (``--seq-len`` sets ``data.seq_len``), values coming from, lowest
first: the field's default, the experiment's ``defaults``, ``--config FILE.yaml`` (sections of
fields), then ``section.field=value`` overrides and flags. ``ConfigError`` names the field,
``describe_error`` adds its flag. Flat flags, not tyro's or draccus's nested ones
(``--data.seq-len``): every recorded command uses them.

This module imports no jax (nor flax, orbax), so that ``--help`` is fast; what checks a config
against the devices and techniques imports them where it runs.
"""

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import typing

import yaml

from jaxaccel.data.batching import STRATEGIES
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import (LOSS_SCALE_KINDS, LR_SCALING, MESH_AXIS_TYPES, OPTIMIZERS,
                                    PIPELINE_SCHEDULES, PRESET_TOKENIZERS, PRESETS, SAMPLING,
                                    RENAMED, SCHEDULES, SHARDING_STRATEGIES, TECHNIQUES,
                                    UNREGISTERED, GPTSettings, ModelConfig, absolute_name,
                                    describe_defaults, is_preset, preset, unknown_model)
from jaxaccel.core.settings import FLOAT_RANGE, INT_LIMIT, INT_RANGE, Range, setting
from jaxaccel.core.tokenizer import TOKENIZER_HELP, vocab_of as tokenizer_vocab

MATMUL_PRECISIONS = ("default", "high", "highest")


# Size caps: more length buckets than this plans for minutes (O(buckets x lengths^2)); more
# batches ready than this only holds device memory (two or three hide the loader).
MAX_BUCKETS = 1024
MAX_PREFETCH = 64
# A float32 loss scale above this overflows any gradient: every step would be skipped.
MAX_LOSS_SCALE = 2.0**64


@dataclasses.dataclass
class DataConfig:
    path: str = setting("stdlib", "corpus: 'stdlib', a directory of text files, a .jsonl file, "
                                  "Parquet files or a Hugging Face dataset saved to disk",
                        flag="data")
    tokenizer: str | None = setting(None, f"tokenizer: {TOKENIZER_HELP}; sets the model's "
                                          f"vocabulary (default: bytes; bpe:50257 with --model "
                                          f"gpt2)")
    text_column: str = setting("text", "the field holding the text (JSONL, Parquet, datasets)")
    split: str | None = setting(None, "the split of a Hugging Face DatasetDict saved to disk "
                                      "(default: train, or its only split)", flag="data_split")
    tokenize_batch_mb: float = setting(16.0, "megabytes of text tokenized at once when a corpus "
                                             "is first read: the memory tokenizing takes", above=0)
    seq_len: int | None = setting(None, "training sequence length (default: the model context)",
                                  at_least=1)
    batching: str = setting("fixed", "batching strategy: fixed padding, dynamic padding, length "
                                     "buckets or sequence packing", choices=tuple(STRATEGIES))
    batch_size: int | None = setting(None, "sequences per batch (default 16 unless "
                                           "tokens_per_batch is given)", at_least=1)
    tokens_per_batch: int | None = setting(None, "token budget per batch instead of batch_size "
                                                 "(bucket: a batch size per bucket)", at_least=1)
    buckets: int = setting(8, "number of length buckets (bucket batching; at most seq_len)",
                           at_least=1, at_most=MAX_BUCKETS)
    pad_multiple: int = setting(64, "row lengths are padded to a multiple of this (dynamic, "
                                    "bucket)", at_least=1)
    pack_window: int | None = setting(None, "documents packed together per window (pack batching; "
                                            "default: the data module's)", at_least=1)
    prefetch: int | None = setting(
        None, "batches the loader thread keeps ready on the devices; 0: no thread, each batch "
        "made when the step asks for it (default: 0 for one process on a CPU, whose device is "
        "the host, else 2; 2 with importance sampling)", at_least=0, at_most=MAX_PREFETCH)
    sampling: str = setting(
        "uniform", "importance sampling of documents (fixed batching): uniform (off), loss "
        "(documents drawn by their last seen loss) or grad-norm (by a bound of their gradient "
        "norm), the loss reweighted by 1/(N p) to stay unbiased", choices=SAMPLING)
    sampling_power: float = setting(1.0, "importance sampling: probabilities proportional to "
                                         "the documents' relative scores to this power (0 = "
                                         "uniform)", at_least=0)
    sampling_floor: float = setting(0.1, "importance sampling: share of the probability spread "
                                         "uniformly over all rows, so every document stays "
                                         "reachable (0 < floor <= 1)", above=0, at_most=1)
    cache_dir: str | None = setting(None, "tokenized corpus cache (default $JAXACCEL_CACHE_DIR "
                                          "or ~/.cache/jaxaccel)")


@dataclasses.dataclass
class OptimizerConfig:
    name: str = setting("adamw", "optimizer; its defaults: " + describe_defaults(),
                        flag="optimizer", choices=OPTIMIZERS)
    learning_rate: float | None = setting(None, "peak learning rate at base_batch_size "
                                                "(default: the optimizer's)", above=0)
    schedule: str = setting("cosine", "learning-rate shape after the linear warmup: constant, "
                                      "cosine or linear decay to 10%, inverse square root",
                            choices=SCHEDULES)
    warmup_steps: int = setting(50, "linear warmup steps (more than steps: the run ends "
                                    "within the warmup)", at_least=0)
    lr_scaling: str = setting("none", "scale the learning rate from base_batch_size to the batch "
                                      "size: linear (SGD-style) or sqrt (Adam/LAMB-style)",
                              choices=LR_SCALING)
    base_batch_size: int = setting(16, "batch size (rows) at which learning_rate is given",
                                   at_least=1)
    weight_decay: float | None = setting(None, "weight decay (default: the optimizer's)",
                                         at_least=0)
    no_decay: str | None = setting(None, "comma-separated regexes of variable paths exempt from "
                                         "weight decay and trust ratios besides those exempt "
                                         "always: tensors under 2-D per layer and embedding "
                                         "tables")
    clip_norm: float = setting(1.0, "global gradient-norm clip (0 = off)", at_least=0,
                               note="0 = off")
    accumulate: int = setting(1, "split each batch into this many microbatches and average "
                                 "their gradients in one step (same update, less activation "
                                 "memory)", at_least=1)
    state_dtype: str = setting("float32", "dtype of the optimizer's moments",
                               flag="optimizer_state_dtype", choices=("float32", "bfloat16"))


@dataclasses.dataclass
class PrecisionConfig:
    policy: str = setting("fp32", "dtype policy: fp32, bf16, fp16 (float32 master weights, "
                                  "compute in the named dtype), fp8 (bf16, with the blocks' "
                                  "matmuls in float8, delayed scaling), or params=<dtype>,compute="
                                  "<dtype>,output=<dtype>", flag="precision")
    loss_scale: str = setting("auto", "loss scaling: auto (dynamic for float16 compute, else "
                                      "none), dynamic, static or none", choices=LOSS_SCALE_KINDS)
    init_scale: float = setting(2.0**16, "initial dynamic loss scale (the static scale with "
                                         "loss_scale static)", flag="loss_scale_init",
                                above=0, at_most=MAX_LOSS_SCALE)
    growth_interval: int = setting(2000, "finite steps in a row before the dynamic scale grows",
                                   flag="loss_scale_growth_interval", at_least=1)
    growth_factor: float = setting(2.0, "dynamic scale growth factor",
                                   flag="loss_scale_growth_factor", above=1,
                                   at_most=MAX_LOSS_SCALE)
    backoff: float = setting(0.5, "dynamic scale factor on a non-finite step",
                             flag="loss_scale_backoff", above=0, below=1)
    min_scale: float = setting(1.0, "the dynamic scale never backs off below this",
                               flag="loss_scale_min", above=0, at_most=MAX_LOSS_SCALE)
    matmul: str = setting("default", "float32 matmul precision (jax_default_matmul_precision): "
                                     "default lets GPUs use TF32, highest forces full float32",
                          flag="matmul_precision", choices=MATMUL_PRECISIONS)


@dataclasses.dataclass
class MeshConfig:
    strategy: str = setting(
        "dp", "how the step is split over the mesh: dp (parameters replicated, batch split), fsdp "
        "(parameters, gradients and optimizer state split too: ZeRO-3), tp (attention heads and "
        "MLP split, Megatron-style), pp (the layers split into pipeline stages; needs "
        "scan_layers, microbatches = accumulate), and the combinations fsdp+tp, dp+fsdp, dp+pp, "
        "fsdp+pp, tp+pp, fsdp+tp+pp", flag="sharding", choices=tuple(SHARDING_STRATEGIES))
    shape: str | None = setting(
        None, "mesh axis sizes as axis=size pairs over the axes stage, data, fsdp, tensor, e.g. "
        "stage=4,fsdp=2 (-1: the remaining devices); default: the strategy's axes share all "
        "devices (fsdp+tp: tensor=2; dp+fsdp: data = hosts, or 2; a +pp combination: 2 devices on "
        "each other axis, the rest as stages)", flag="mesh")
    pipeline_schedule: str = setting(
        "gpipe", "with a pp strategy: gpipe (all microbatches forward, then backward) or 1f1b "
        "(one forward, one backward: stage inputs kept bounded by the stage count, not the "
        "microbatches)", choices=tuple(PIPELINE_SCHEDULES))
    num_devices: int | None = setting(None, "train on the first N devices of this process "
                                            "(default: all devices of all processes)", at_least=1)
    axis_types: str = setting("auto", "mesh axis types: auto (XLA completes the shardings) or "
                                      "explicit (shardings are part of every array's type)",
                              flag="mesh_axis_types", choices=MESH_AXIS_TYPES)
    coordinator: str | None = setting(None, "HOST:PORT of process 0: train over several "
                                            "processes (hosts) with jax.distributed")
    num_processes: int | None = setting(None, "number of processes (with coordinator)", at_least=1)
    process_id: int | None = setting(None, "this process's index, 0 .. N-1 (with coordinator)",
                                       at_least=0)
    distributed: bool = setting(False, "start jax.distributed from the cluster's environment "
                                       "(SLURM, Open MPI, ...) instead of coordinator")
    distributed_timeout: int = setting(300, "seconds to wait for all processes to reach the "
                                            "coordinator", at_least=1)
    axis_rules: str | None = setting(
        None, "logical axes for variables the model does not annotate, as "
        "PATH_REGEX=axis,axis;... with axes embed, heads, kv_heads, mlp, vocab, layers (or - for "
        "a dimension kept whole), e.g. 'qkv/kernel=embed,heads'; tensor parallelism needs them on "
        "a model without nnx.with_partitioning")


@dataclasses.dataclass
class RunConfig:
    steps: int = setting(300, "optimizer steps in the whole run", at_least=1)
    train_tokens: int | None = setting(None, "train on about this many real tokens instead of "
                                             "steps (steps = tokens / mean real tokens per batch)",
                                       at_least=1, at_most=2**62)
    seed: int = setting(0, "seed of parameters, data order and dropout", at_least=0)
    memory_budget: int | str | None = setting(
        None, "device bytes the train step may use, or auto (this device's memory): compile every "
        "remat policy and take the fastest (fewest FLOPs) that fits the batch; overrides "
        "remat.policy", choices=("auto",), at_least=1, at_most=2**62)
    run_dir: str | None = setting(None, "run directory (default: a new runs/train-<time>; with "
                                        "resume, the latest one)")
    resume: bool = setting(False, "continue the run in run_dir from its latest checkpoint")
    checkpoint_every: int = setting(0, "also save an orbax checkpoint every N steps (0: by "
                                       "checkpoint_minutes only)", at_least=0)
    checkpoint_minutes: float = setting(
        10.0, "save an orbax checkpoint once N minutes have passed since the last one (or the "
        "start), and at the end and at a signal (0: by checkpoint_every only). By time, a save "
        "costs the same share of a run whatever its step takes", at_least=0)
    save_checkpoints: bool = setting(True, "write orbax checkpoints (off: none at all, not at "
                                           "the end nor at a signal, so the run cannot be "
                                           "resumed: a measurement whose weights are not kept)")
    keep_checkpoints: int = setting(2, "the latest N checkpoints are kept, older ones deleted",
                                    at_least=1)
    keep_every_steps: int = setting(0, "also keep every checkpoint whose step is a multiple of "
                                       "K (0: none)", at_least=0)
    async_checkpoint: bool = setting(True, "write checkpoints in the background (orbax's async "
                                           "saving: training goes on once the state is copied "
                                           "to the host)")
    eval_every: int = setting(100, "evaluate on eval_batches validation batches every N steps "
                                    "(0 = off)", at_least=0)
    eval_batches: int = setting(20, "validation batches in periodic evaluations, spread over the "
                                    "split (the final one: final_eval_batches); a number at least "
                                    "the split's batches evaluates all of it", at_least=1)
    eval_batch_size: int | None = setting(None, "rows per validation batch (default: the "
                                                "training batch's rows)", at_least=1)
    final_eval_batches: int | None = setting(
        100, "validation batches of the final evaluation, spread over the split (a number at "
        "least the split's batches, or null in a config file, evaluates all of it)", at_least=1)
    target_bpb: float | None = setting(
        None, "time to quality: end the run at the first evaluation (every eval_every steps, "
        "and the final one) whose validation bits per byte are at most this; the summary's "
        "target says at which step, after how many real tokens and training seconds",
        above=0)
    target_seconds: float | None = setting(
        None, "with target_bpb: give up at the first evaluation after this many seconds of "
        "training without reaching it (the summary's target says so)", above=0)
    log_every: int = setting(10, "write metrics every N steps (0: every step)", at_least=0)
    progress: bool = setting(True, "show a progress bar")
    loss_plot: bool = setting(True, "draw loss.png in the run directory at the end (about 1 s "
                                    "on a CPU, most of it importing matplotlib)")
    stop_at: str | None = setting(None, "pause at this step: save a checkpoint and exit 0, "
                                        "so that --resume continues the run later (a step "
                                        "number, or a share of the run's steps such as 1/3)")
    json: str | None = setting(None, "also write the summary as JSON to this path")
    trackers: str = setting("none", "mirror the metrics to trackers: none, tensorboard, wandb or "
                                    "tensorboard,wandb (optional extras: pip install "
                                    "'jaxaccel[tensorboard]', 'jaxaccel[wandb]')")
    compilation_cache: str | None = setting(
        None, "persistent XLA compilation cache folder, or off (default: "
              "$JAX_COMPILATION_CACHE_DIR, else xla/ under the corpus cache folder)")
    time_step: int = setting(0, "after training, time the compiled train step alone on the "
                                "run's last N batches and report its real tokens/s beside "
                                "the loop's (0: off)", at_least=0, at_most=100_000)
    profile: str | None = setting(None, "START:STOP: a jax.profiler trace of steps START to "
                                        "STOP-1 in <run_dir>/profile, and the ten device "
                                        "operations that took the most time in it")
    wandb_project: str = setting("jaxaccel", "W&B project of the run (with --trackers wandb)")
    wandb_mode: str = setting("offline", "W&B mode: offline (kept in <run_dir>/wandb, upload "
                                         "later with wandb sync), online or disabled",
                              choices=("offline", "online", "disabled"))
    init_from: str | None = setting(None, "start from the weights of this trained run directory "
                                          "(its latest checkpoint), e.g. to fine-tune it with "
                                          "LoRA or adapters; the model's shape must match its")


def parse_stop_at(text) -> int | tuple[int, int]:
    """``run.stop_at``: a step N >= 1, or a share ``A/B`` (0 < A <= B) as ``(A, B)``."""
    number, slash, whole = str(text).strip().partition("/")
    if number.isdigit() and (whole.isdigit() if slash else True):
        if not slash and int(number) >= 1:
            return int(number)
        if slash and 0 < int(number) <= int(whole):
            return int(number), int(whole)
    raise ConfigError(f"stop_at {text!r} is neither a step number nor a share of the run's "
                      f"steps; write e.g. --stop-at 100 or --stop-at 1/3", field="run.stop_at")


def stop_step(text, total_steps: int, first_step: int) -> int:
    """The step ``run.stop_at`` pauses at (a share rounds to the nearest step, at least 1),
    checked against the run's steps and the step it resumes from."""
    value = parse_stop_at(text)
    step = value if isinstance(value, int) else max(1, round(total_steps * value[0] / value[1]))
    if step > total_steps:
        raise ConfigError(f"stop_at {text} is beyond the run's {total_steps} steps; choose a "
                          f"step up to {total_steps}, or leave --stop-at out", field="run.stop_at")
    if step <= first_step:
        raise ConfigError(f"stop_at {text} is step {step}, but the run resumes from step "
                          f"{first_step}; choose a later step, or leave --stop-at out",
                          field="run.stop_at")
    return step


def _section(cls):
    return dataclasses.field(default_factory=cls)


@dataclasses.dataclass
class RunSections:
    """The sections every run has; ``TrainConfig`` adds one per technique (module docstring)."""

    model: ModelConfig = _section(ModelConfig)
    gpt: GPTSettings = _section(GPTSettings)
    data: DataConfig = _section(DataConfig)
    optimizer: OptimizerConfig = _section(OptimizerConfig)
    precision: PrecisionConfig = _section(PrecisionConfig)
    mesh: MeshConfig = _section(MeshConfig)
    run: RunConfig = _section(RunConfig)

    @property
    def seq_len(self) -> int:
        return self.model.max_seq_len if self.data.seq_len is None else self.data.seq_len

    def batching_options(self) -> dict:
        """Keyword arguments of ``jaxaccel.data.batching.DataStream`` for the batch size and
        strategy."""
        data = self.data
        unsized = data.batch_size is None and data.tokens_per_batch is None
        options = {"batch_size": 16 if unsized else data.batch_size,
                   "tokens_per_batch": data.tokens_per_batch,
                   "pad_multiple": data.pad_multiple, "num_buckets": data.buckets}
        if data.pack_window is not None:
            options["pack_window"] = data.pack_window
        return options

    def batch_rows(self) -> int:
        """Rows per batch: batch_size, or the rows of seq_len that tokens_per_batch holds."""
        options = self.batching_options()
        return options["batch_size"] or max(1, options["tokens_per_batch"] // self.seq_len)

    def policy(self):
        from jaxaccel.step.precision import get_policy
        return get_policy(self.precision.policy)

    def make_loss_scale(self):
        """The run's initial loss-scale state from the precision section."""
        from jaxaccel.step.precision import make_loss_scale
        p = self.precision
        return make_loss_scale(
            p.loss_scale, self.policy(), initial_scale=p.init_scale,
            growth_factor=p.growth_factor, backoff_factor=p.backoff,
            growth_interval=p.growth_interval, min_scale=p.min_scale, static_scale=p.init_scale)

    def validate(self):
        """ConfigError naming the field unless every field is in range (``check_ranges``) and
        the settings fit together (each technique's own: ``jaxaccel.techniques.registry.check``)."""
        from jaxaccel.run import profiling, trackers
        from jaxaccel.techniques import registry as techniques
        from jaxaccel.core.sharding import parse_axis_rules
        check_ranges(self)
        if self.run.profile is not None:
            profiling.parse_window(self.run.profile)
        if self.run.stop_at is not None:
            parse_stop_at(self.run.stop_at)
            if not self.run.save_checkpoints:
                raise ConfigError("stop_at pauses the run with a checkpoint to resume from, and "
                                  "save_checkpoints is off; drop --no-save-checkpoints or "
                                  "--stop-at", field="run.stop_at")
        if self.run.target_seconds is not None and self.run.target_bpb is None:
            raise ConfigError("target_seconds is a limit on reaching target_bpb, which is not "
                              "set; pass --target-bpb X", field="run.target_bpb")
        if self.run.target_bpb is not None and not self.run.eval_every:
            raise ConfigError("target_bpb is judged by the periodic evaluations, and eval_every "
                              "is 0; pass --eval-every N", field="run.eval_every")
        accumulate = self.optimizer.accumulate
        if self.data.batch_size is not None and self.data.batch_size % accumulate:
            raise ConfigError(f"batch_size={self.data.batch_size} does not split into "
                              f"accumulate={accumulate} microbatches; pass a batch size that is "
                              f"a multiple of it", field="data.batch_size")
        if self.seq_len > self.model.max_seq_len:
            raise ConfigError(f"seq_len={self.seq_len} exceeds the model context max_seq_len="
                              f"{self.model.max_seq_len}; lower seq_len or raise max_seq_len",
                              field="data.seq_len")
        if self.data.batching == "bucket" and self.data.buckets > self.seq_len:
            raise ConfigError(f"buckets={self.data.buckets} exceeds seq_len={self.seq_len}: "
                              f"a bucket is a row length; pass at most seq_len buckets",
                              field="data.buckets")
        if (self.mesh.process_id is not None and self.mesh.num_processes is not None
                and self.mesh.process_id >= self.mesh.num_processes):
            raise ConfigError(f"process_id={self.mesh.process_id} is not below num_processes="
                              f"{self.mesh.num_processes}; pass 0 .. {self.mesh.num_processes - 1}",
                              field="mesh.process_id")
        self.make_loss_scale()
        trackers.check(self.run.trackers, self.run.wandb_mode)
        parse_axis_rules(self.mesh.axis_rules)
        techniques.check(self)
        if self.run.init_from is not None and not os.path.isfile(
                os.path.join(self.run.init_from, "config.yaml")):
            raise ConfigError(f"init_from={self.run.init_from!r} is not a run directory (no "
                              f"config.yaml in it); pass the run_dir of a trained run",
                              field="run.init_from")
        check_batch_memory(self)



# Every setting of a training run: the run's sections, then one per registered technique (its
# record's ``name`` and ``settings``, jaxaccel.core.sections.TECHNIQUES), in the records' order.
TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", [(t.name, t.settings, _section(t.settings)) for t in TECHNIQUES],
    bases=(RunSections,), module=__name__)

def check_batch_memory(cfg):
    """ConfigError, before any work, when one training or validation batch (its arrays, this
    process's rows of it) is larger than the host memory available: the loader builds it there.
    The rest of a step (model, activations) is bounded from its compiled sizes later."""
    import jax
    import numpy as np
    from jaxaccel.core import hardware
    from jaxaccel.data.batching import BATCH_DTYPES
    token_bytes = sum(np.dtype(d).itemsize for d in BATCH_DTYPES.values())
    processes = jax.process_count() if jax.distributed.is_initialized() else 1
    seq_len, rows = cfg.seq_len, cfg.batch_rows()
    length = "data.seq_len" if cfg.data.seq_len is not None else "model.max_seq_len"
    size = "data.batch_size" if cfg.data.batch_size or not cfg.data.tokens_per_batch \
        else "data.tokens_per_batch"
    for name, count, field, fix in (
            ("training", rows, length if seq_len >= rows else size,
             "lower --seq-len (or --max-seq-len, its default) or --batch-size (or "
             "--tokens-per-batch)"),
            ("validation", cfg.run.eval_batch_size or rows, "run.eval_batch_size",
             "lower --eval-batch-size")):
        need, have = -(-count // processes) * seq_len * token_bytes, hardware.host_memory_bytes()
        if need > have:
            raise ConfigError(f"one {name} batch of {count:,} rows x {seq_len:,} tokens takes "
                              f"{need:,} bytes of host memory ({token_bytes} per token), more "
                              f"than the {have:,} available; {fix}", field=field)


# Ranges: every numeric field of every section, checked the same way.

def field_ranges(cls) -> dict[str, "Range | None"]:
    """Every field of ``cls``'s sections by path: its declared ``Range`` (or None)."""
    return {f"{section}.{f.name}": f.metadata.get("range")
            for section, section_cls in _sections(cls).items()
            for f in dataclasses.fields(section_cls)}


# Fields that name a file or directory: an empty string is refused, never read as ".".
PATH_FIELDS = ("path", "run_dir", "json", "cache_dir", "init_from", "coordinator", "from_run",
               "compilation_cache")


def check_ranges(cfg):
    """ConfigError for the first numeric field of ``cfg`` (any config class) that is not finite
    or out of its range (an int without one: ``INT_RANGE``, a float: ``FLOAT_RANGE``), or path
    field (``PATH_FIELDS``) that is empty."""
    for path, declared in field_ranges(type(cfg)).items():
        value, name = field_value(cfg, path), path.rpartition(".")[2]
        if isinstance(value, str) and not value.strip() and name in PATH_FIELDS:
            raise ConfigError(f"{name} is empty (an empty path would mean "
                              f"the current directory); pass a path, or leave it out for the "
                              f"default", field=path)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if declared is None or declared == Range():
            declared = INT_RANGE if isinstance(value, int) else FLOAT_RANGE
        declared.check(path, value)


def check_json_outputs(cfg):
    """ConfigError, before any work, for a ``json`` field whose folder is missing or unwritable."""
    for path in field_ranges(type(cfg)):
        value = field_value(cfg, path)
        if path.rpartition(".")[2] == "json" and value:
            if os.path.isdir(value):
                raise ConfigError(f"json: {value} is a directory; pass the path of a file to "
                                  f"write, e.g. {os.path.join(value, 'summary.json')}",
                                  field=path)
            check_writable(path, os.path.dirname(os.path.abspath(value)), may_create=False)


def check_writable(field: str, path: str, *, may_create: bool):
    """ConfigError naming ``field`` unless a file can be written in the folder ``path`` (with
    ``may_create``: in the nearest existing folder it would be created in)."""
    name = field.rpartition(".")[2]
    folder = os.path.abspath(path)
    while may_create and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f"{name}: {folder} is not a directory"
                          + ("" if may_create else "; create it first or choose another path"),
                          field=field)
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ConfigError(f"{name}: cannot write in {folder} ({e.strerror}); choose another "
                          f"path", field=field) from None


# Field paths, overrides and files.

def field_value(cfg, path: str):
    """The value of the field ``"section.field"`` of ``cfg``."""
    section, _, name = path.partition(".")
    return getattr(getattr(cfg, section), name)


def _sections(cls) -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


def _alternatives(annotation) -> list:
    """A union's types other than None (``[int, str]`` for ``int | str | None``); [] if plain."""
    return [a for a in typing.get_args(annotation) if a is not type(None)]


def _scalar_type(annotation):
    """int for ``int | None``, and so on."""
    return (_alternatives(annotation) or [annotation])[0]


def _coerce(path: str, value, annotation, choices):
    """``value`` (from YAML, a flag or an override's text) as the field's type; ConfigError if
    it is not one. Text is read as YAML (``512``, ``true``, ``null``); a float may be an int."""
    alternatives = _alternatives(annotation)
    if str in alternatives and len(alternatives) > 1:   # a number, or one of the words
        if value in (choices or ()) or value is None:
            return value
        number = next(a for a in alternatives if a is not str)
        try:
            return _coerce(path, value, number, None)
        except ConfigError:
            raise ConfigError(f"{path}={value!r} is neither a number ({number.__name__}) nor "
                              f"one of {', '.join(choices or ())}", field=path) from None
    kind = _scalar_type(annotation)
    if (isinstance(value, str) and kind is str and value.strip() in ("null", "Null", "NULL", "~")
            and type(None) in typing.get_args(annotation)):
        value = None            # an override's YAML null unsets an optional text field
    if isinstance(value, str) and kind is not str:
        with contextlib.suppress(yaml.YAMLError):
            value = yaml.safe_load(value)
        if kind is float and isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)                 # YAML reads 1e-3 as text
    if value is None and type(None) in typing.get_args(annotation):
        return None
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise ConfigError(f"{path}={value!r} is not of type {kind.__name__}", field=path)
    if choices and value not in choices:
        raise ConfigError(f"{path}={value!r} is not one of {', '.join(map(str, choices))}",
                          field=path)
    return value


def _field_table(cls) -> dict[str, tuple]:
    """Every settable field of ``cls`` by path: (type, help, flag, choices)."""
    table = {}
    for section, section_cls in _sections(cls).items():
        for f in dataclasses.fields(section_cls):
            flag = f.metadata["flag"]       # "" for a field no flag sets (model.vocab_size)
            table[f"{section}.{f.name}"] = (f.type, f.metadata["help"],
                                            None if flag == "" else flag or f.name,
                                            f.metadata["choices"])
    return table


def build(cls=None, values: dict | None = None):
    """A ``cls`` (default TrainConfig) from ``{"section.field": value}``, the model's context
    (the preset's, else ``data.seq_len``, else 256), tokenizer (the preset's) and vocabulary (the
    tokenizer's padded size, or a larger vocab_size given) resolved, a preset's fields checked."""
    if UNREGISTERED:        # a technique of one's own that JAXACCEL_TECHNIQUES names
        raise ConfigError(UNREGISTERED[0])
    cls = cls or TrainConfig
    table = _field_table(cls)
    by_section = {section: {} for section in _sections(cls)}
    for path, value in (values or {}).items():
        path = RENAMED.get(path, path)
        if path is None:
            continue
        if path not in table:
            sections = sorted({p.partition(".")[0] for p in table})
            raise ConfigError(f"unknown config field {path!r}; write section.field with a section "
                              f"of {', '.join(sections)} and a field --help lists")
        kind, _, _, choices = table[path]
        section, _, name = path.partition(".")
        by_section[section][name] = _coerce(path, value, kind, choices)
    sections = {section: section_cls(**by_section[section])
                for section, section_cls in _sections(cls).items()}
    if "model" in sections and "data" in sections:
        sections["model"], sections["data"] = _resolve_model(sections["model"], sections["data"],
                                                             sections.get("gpt"))
    return cls(**sections)


def _resolve_model(model: ModelConfig, data: "DataConfig", gpt_settings):
    """The model section with context and vocabulary resolved, the data section's tokenizer."""
    is_gpt = is_preset(model.name)
    if is_gpt and model.name not in PRESETS:
        raise unknown_model(model.name)
    context = model.max_seq_len or (PRESETS[model.name].max_seq_len if is_gpt
                                    else data.seq_len or 256)
    spec = data.tokenizer or (PRESET_TOKENIZERS.get(model.name, "bytes") if is_gpt
                              else "bytes")
    vocab = max(tokenizer_vocab(spec), model.vocab_size or 0)
    model = dataclasses.replace(model, max_seq_len=context, vocab_size=vocab)
    if is_gpt and gpt_settings is not None:
        given = {k: v for k, v in dataclasses.asdict(gpt_settings).items() if v is not None}
        preset(model.name, vocab_size=vocab, max_seq_len=context, **given)
    return model, dataclasses.replace(data, tokenizer=spec)


def override(cfg, values: dict):
    """``cfg`` with some fields replaced: ``override(cfg, {"data.seq_len": 64})``. Model fields
    replace the resolved model's (n_kv_heads and d_ff re-derived from what changed)."""
    return build(type(cfg), {**flatten(to_dict(cfg)), **values})


def to_dict(cfg) -> dict:
    """The config as a nested mapping of sections to fields (what ``--config`` reads)."""
    return {f.name: dataclasses.asdict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def flatten(nested: dict) -> dict:
    """``{"data": {"seq_len": 64}}`` -> ``{"data.seq_len": 64}``."""
    flat = {}
    for section, fields in nested.items():
        if not isinstance(fields, dict):
            raise ConfigError(f"config section {section!r} must be a mapping of fields, got "
                              f"{fields!r}")
        flat.update({f"{section}.{name}": value for name, value in fields.items()})
    return flat


def read_config_file(path: str) -> dict:
    """The flat ``{"section.field": value}`` of a YAML config file."""
    try:
        with open(path) as f:
            nested = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}; check the path",
                          field="config") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}",
                          field="config") from None
    if not isinstance(nested, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections", field="config")
    return flatten(nested)


def write_config(cfg, run_dir: str, command: str | None = None):
    """``config.yaml`` (the TrainConfig sections, not an experiment's) and ``command.txt`` into
    ``run_dir``: ``python -m experiments.train --config run_dir/config.yaml`` repeats the run.
    A factory's file is recorded by its absolute path: the run's model is found from any
    directory (``experiments.sample``, ``export``, ``--init-from``)."""
    sections = {f.name for f in dataclasses.fields(TrainConfig)}
    written = {k: v for k, v in to_dict(cfg).items() if k in sections}
    written["model"] = {**written["model"], "name": absolute_name(cfg.model.name)}
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(written, f, sort_keys=False)
    if command is not None:
        with open(os.path.join(run_dir, "command.txt"), "w") as f:
            f.write(command + "\n")


# The command line.

CONFIG_HELP = "read settings from this YAML file (sections of fields; flags and overrides win)"
OVERRIDES_HELP = "set any field, e.g. data.seq_len=512 optimizer.name=lion"


@dataclasses.dataclass(frozen=True)
class Flag:
    """A field's command-line flag as ``--help`` shows it (and docs/FLAGS.md, which
    tools/flag_reference.py writes from these)."""

    path: str               # the field, "data.seq_len"
    flag: str               # "--seq-len"
    kind: object            # the field's annotation, ``int | None``
    help: str               # the setting's own help text
    default: object         # the value a run gets without the flag (``defaults`` applied)
    accepts: str            # a numeric field's range, "at least 1" ("" otherwise)
    choices: tuple | None

    @property
    def section(self) -> str:
        return self.path.partition(".")[0]

    @property
    def name(self) -> str:
        return self.path.partition(".")[2]

    @property
    def kinds(self) -> list:
        """The field's types other than None: ``[int, str]`` for ``int | str | None``."""
        return _alternatives(self.kind) or [self.kind]


def flags(cls=None, *, defaults: dict | None = None, fixed: tuple = ()) -> list[Flag]:
    """Every flag of ``cls`` (default TrainConfig), in the order of its sections and their
    fields (``--help``'s); ``fixed`` fields and those no flag sets have none."""
    cls = cls or TrainConfig
    shown = to_dict(build(cls, defaults))
    out, seen, ranges = [], {}, field_ranges(cls)
    for path, (kind, help_text, flag, choices) in _field_table(cls).items():
        section, _, name = path.partition(".")
        if path in fixed or flag is None:
            continue
        if flag in seen:
            raise ValueError(f"flag --{flag} of {path} is also {seen[flag]}'s")
        seen[flag] = path
        out.append(Flag(path, "--" + flag.replace("_", "-"), kind, help_text,
                        shown[section].get(name), _accepts(ranges.get(path), kind), choices))
    return out


def build_parser(cls=None, *, defaults: dict | None = None, fixed: tuple = (),
                 description: str = "") -> argparse.ArgumentParser:
    """One flag per field of ``cls``, grouped by section; ``fixed`` fields get no flag (the
    experiment sets them). Defaults shown are ``defaults`` over the fields' own."""
    parser = _Parser(description=description, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE.yaml", help=CONFIG_HELP)
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help=OVERRIDES_HELP)
    groups = {}
    for f in flags(cls, defaults=defaults, fixed=fixed):
        if f.section not in groups:
            groups[f.section] = parser.add_argument_group(f.section)
        accepts = f"; {f.accepts}" if f.accepts else ""
        kwargs = {"dest": f.path, "default": argparse.SUPPRESS,
                  "help": f"{f.help} ({f.path}, default: {f.default}{accepts})".replace("%", "%%")}
        if f.kinds[0] is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif str in f.kinds and len(f.kinds) > 1:       # a number or a word
            kwargs["metavar"] = "|".join([f.name.upper(), *f.choices])
        else:
            kwargs["type"] = f.kinds[0]
            if f.choices:
                kwargs["choices"] = f.choices
            else:
                kwargs["metavar"] = f.name.upper()
        groups[f.section].add_argument(f.flag, **kwargs)
    return parser


def _accepts(declared, annotation) -> str:
    """``an integer in [1, 64]``: a numeric field's range for its help ("" otherwise)."""
    kinds = set(_alternatives(annotation)) or {annotation}
    kind = float if float in kinds else int if int in kinds and bool not in kinds else None
    if kind is None:
        return ""
    if declared is None or declared == Range():
        declared = INT_RANGE if kind is int else FLOAT_RANGE
    return declared.describe(kind)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, a bad value) are one line, like ConfigError's."""

    def error(self, message):
        print(f"error: {message}; see --help", file=sys.stderr)
        raise SystemExit(2)


def flag_of(path: str, cls=None) -> str | None:
    """The command-line flag that sets a field, e.g. ``--n-heads`` for ``model.n_heads``."""
    entry = _field_table(cls or TrainConfig).get(path)
    return "--" + entry[2].replace("_", "-") if entry else None


def describe_error(error: ConfigError, cls=None) -> str:
    """The error's line for the command line: its message and the flag of its field."""
    if error.field == "config":
        return f"error: {error} [--config]"
    flag = flag_of(error.field, cls) if error.field else None
    where = f" [{flag} / {error.field}]" if flag else ""
    return f"error: {error}{where}"


def parse(argv=None, cls=None, *, defaults: dict | None = None, fixed: tuple = (),
          unused: dict | None = None, description: str = ""):
    """A ``cls`` (default TrainConfig) from the command line (module docstring), its ranges
    checked. A field in ``fixed`` is set by the experiment and may not be given; one in
    ``unused`` (path: why) keeps its flag but is refused if given, never silently ignored."""
    cls = cls or TrainConfig
    parser = build_parser(cls, defaults=defaults, fixed=fixed, description=description)
    args = vars(parser.parse_intermixed_args(argv))
    config_file = args.pop("config", None)
    given = read_config_file(config_file) if config_file else {}
    explicit = set(args) - {"overrides"}      # flags and overrides, not a file's fields
    for item in args.pop("overrides"):
        path, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not section.field=value; write e.g. "
                              f"data.seq_len=512")
        given[path.strip()] = value
        explicit.add(path.strip())
    given.update(args)
    for path in given:
        if path in fixed:
            raise ConfigError(f"{path} is set by this experiment for each row; leave it out")
        if path in (unused or {}) and path in explicit:
            raise ConfigError(f"{path} is not used by this experiment "
                              f"({unused[path]}); leave it out", field=path)
    cfg = build(cls, {**(defaults or {}), **given})
    check_ranges(cfg)
    check_json_outputs(cfg)
    return cfg
