"""Run configuration: a dataclass whose fields are also the command-line flags.

``TrainConfig`` holds every setting of a training run; ``parse_config`` builds an argparse parser
from its fields (help text from each field's metadata), so ``--help`` always lists them all and
a new field is a new flag.
"""

import argparse
import dataclasses
import types
import typing

from jaxaccel.attention import IMPLEMENTATIONS
from jaxaccel.data import STRATEGIES
from jaxaccel.errors import ConfigError
from jaxaccel.model import MLP_KINDS, PRESETS, ModelConfig, preset
from jaxaccel.optim import (LR_SCALING, NO_DECAY_PATTERNS, OPTIMIZERS, SCHEDULES,
                            describe_defaults)
from jaxaccel.precision import LOSS_SCALE_KINDS, get_policy, make_loss_scale
from jaxaccel.remat import REMAT_POLICIES
from jaxaccel.sharding import AXIS_TYPES, STRATEGIES as SHARDING_STRATEGIES

MATMUL_PRECISIONS = ("default", "high", "highest")


def flag(default, help_text, **extra):
    """A dataclass field that is also a command-line flag with this help text."""
    return dataclasses.field(default=default, metadata={"help": help_text, **extra})


@dataclasses.dataclass
class TrainConfig:
    """Every setting of ``experiments.train``; the model fields default to the preset's values."""

    model: str = flag("tiny", "model preset", choices=tuple(PRESETS))
    d_model: int | None = flag(None, "model width (overrides the preset)")
    n_layers: int | None = flag(None, "number of transformer blocks")
    n_heads: int | None = flag(None, "attention heads; must divide --d-model")
    n_kv_heads: int | None = flag(None, "key/value heads (grouped-query); must divide --n-heads")
    d_ff: int | None = flag(None, "MLP inner width (default 4*d for gelu, ~8/3*d for swiglu)")
    max_seq_len: int | None = flag(None, "model context length")
    mlp: str | None = flag(None, "MLP kind", choices=MLP_KINDS)
    tie_embeddings: bool | None = flag(None, "share the input embedding with the output head")
    dropout: float | None = flag(None, "residual dropout rate (0 = off)")
    attention: str = flag("xla", "attention implementation: xla, cudnn (NVIDIA GPUs), pallas "
                                 "(our flash attention kernel; interpreted, slowly, off the GPU) "
                                 "or auto (pallas on a GPU, else xla)", choices=IMPLEMENTATIONS)
    remat: str = flag("none", "activations each block keeps for the backward pass: none (all), "
                              "full (only its input), dots (matmul outputs), attention (q/k/v and "
                              "attention output), mlp (MLP inner matmuls), offload (attention's, "
                              "in pinned host memory)", choices=REMAT_POLICIES)
    scan_layers: bool = flag(False, "stack the blocks' parameters and apply them with one "
                                    "lax.scan (one block to compile instead of n_layers)")
    memory_budget: int | None = flag(None, "device bytes the train step may use: compile every "
                                           "--remat policy and take the fastest (fewest FLOPs) "
                                           "that fits the batch; overrides --remat")

    sharding: str = flag("dp", "how the step is split over the mesh: dp (parameters replicated, "
                               "batch split), fsdp (parameters, gradients and optimizer state "
                               "split too: ZeRO-3), tp (attention heads and MLP split, "
                               "Megatron-style), fsdp+tp, dp+fsdp",
                         choices=tuple(SHARDING_STRATEGIES))
    mesh: str | None = flag(None, "mesh axis sizes as axis=size pairs, e.g. fsdp=4,tensor=2 (-1: "
                                  "the remaining devices); default: the strategy's axes share all "
                                  "devices (fsdp+tp: tensor=2; dp+fsdp: data = hosts, or 2)")
    num_devices: int | None = flag(None, "train on the first N devices of this process "
                                         "(default: all devices of all processes)")
    mesh_axis_types: str = flag("auto", "mesh axis types: auto (XLA completes the shardings) or "
                                        "explicit (shardings are part of every array's type)",
                                choices=tuple(AXIS_TYPES))
    coordinator: str | None = flag(None, "HOST:PORT of process 0: train over several processes "
                                         "(hosts) with jax.distributed")
    num_processes: int | None = flag(None, "number of processes (with --coordinator)")
    process_id: int | None = flag(None, "this process's index, 0 .. N-1 (with --coordinator)")
    distributed: bool = flag(False, "start jax.distributed from the cluster's environment "
                                    "(SLURM, Open MPI, ...) instead of --coordinator")
    distributed_timeout: int = flag(300, "seconds to wait for all processes to reach the "
                                         "coordinator")

    precision: str = flag("fp32", "dtype policy: fp32, bf16, fp16 (float32 master weights, "
                                  "compute in the named dtype), or params=<dtype>,compute=<dtype>,"
                                  "output=<dtype>")
    loss_scale: str = flag("auto", "loss scaling: auto (dynamic for float16 compute, else none), "
                                   "dynamic, static or none", choices=LOSS_SCALE_KINDS)
    loss_scale_init: float = flag(2.0**16, "initial dynamic loss scale (the static scale with "
                                           "--loss-scale static)")
    loss_scale_growth_interval: int = flag(2000, "finite steps in a row before the dynamic scale "
                                                 "grows")
    loss_scale_growth_factor: float = flag(2.0, "dynamic scale growth factor")
    loss_scale_backoff: float = flag(0.5, "dynamic scale factor on a non-finite step")
    loss_scale_min: float = flag(1.0, "the dynamic scale never backs off below this")
    matmul_precision: str = flag("default", "float32 matmul precision (jax_default_matmul_"
                                            "precision): default lets GPUs use TF32, highest "
                                            "forces full float32", choices=MATMUL_PRECISIONS)

    data: str = flag("stdlib", "corpus: 'stdlib', a directory of text files or a .jsonl file")
    seq_len: int | None = flag(None, "training sequence length (default: the model context)")
    batching: str = flag("fixed", "batching strategy: fixed padding, dynamic padding, length "
                                    "buckets or sequence packing", choices=tuple(STRATEGIES))
    batch_size: int | None = flag(None, "sequences per batch (default 16 unless "
                                          "--tokens-per-batch is given)")
    tokens_per_batch: int | None = flag(None, "token budget per batch instead of --batch-size "
                                                "(bucket: a batch size per bucket)")
    buckets: int = flag(8, "number of length buckets (--batching bucket)")
    pad_multiple: int = flag(64, "row lengths are padded to a multiple of this "
                                   "(dynamic, bucket)")
    pack_window: int | None = flag(None, "documents packed together per window "
                                           "(--batching pack; default: the data module's)")
    prefetch: int = flag(2, "batches the loader thread keeps ready on the devices")
    steps: int = flag(300, "optimizer steps in the whole run")
    train_tokens: int | None = flag(None, "train on about this many real tokens instead of "
                                            "--steps (steps = tokens / mean real tokens per batch)")
    optimizer: str = flag("adamw", "optimizer; its defaults: " + describe_defaults(),
                          choices=OPTIMIZERS)
    learning_rate: float | None = flag(None, "peak learning rate at --base-batch-size (default: "
                                              "the optimizer's)")
    schedule: str = flag("cosine", "learning-rate shape after the linear warmup: constant, "
                                   "cosine or linear decay to 10%%, inverse square root",
                         choices=SCHEDULES)
    warmup_steps: int = flag(50, "linear warmup steps")
    lr_scaling: str = flag("none", "scale the learning rate from --base-batch-size to the batch "
                                   "size: linear (SGD-style) or sqrt (Adam/LAMB-style)",
                           choices=LR_SCALING)
    base_batch_size: int = flag(16, "batch size (rows) at which --learning-rate is given")
    weight_decay: float | None = flag(None, "weight decay (default: the optimizer's)")
    no_decay: str = flag(",".join(NO_DECAY_PATTERNS),
                         "comma-separated regexes of parameter paths exempt from weight decay "
                         "and trust ratios (tensors under 2-D per layer are always exempt)")
    clip_norm: float = flag(1.0, "global gradient-norm clip (0 = off)")
    accumulate: int = flag(1, "split each batch into this many microbatches and sum their "
                              "gradients in one step (same update, less activation memory)")
    optimizer_state_dtype: str = flag("float32", "dtype of the optimizer's moments",
                                      choices=("float32", "bfloat16"))
    seed: int = flag(0, "seed of parameters, data order and dropout")

    run_dir: str | None = flag(
        None, "run directory (default: a new runs/train-<time>; with --resume, the latest one)")
    checkpoint_every: int = flag(100, "save an orbax checkpoint every N steps (and at the end)")
    eval_every: int = flag(100, "evaluate on --eval-batches validation batches every N steps")
    eval_batches: int = flag(20, "validation batches in periodic evaluations, spread over the "
                                   "split (the final one: --final-eval-batches)")
    eval_batch_size: int | None = flag(None, "rows per validation batch (default: the training "
                                             "batch's rows)")
    final_eval_batches: int | None = flag(None, "validation batches of the final evaluation "
                                                "(default: the whole split)")
    log_every: int = flag(10, "write metrics every N steps")
    resume: bool = flag(False, "continue the run in --run-dir from its latest checkpoint")
    progress: bool = flag(True, "show a progress bar")
    cache_dir: str | None = flag(None, "tokenized corpus cache (default $JAXACCEL_CACHE_DIR "
                                         "or ~/.cache/jaxaccel)")
    json: str | None = flag(None, "also write the summary as JSON to this path")

    def model_config(self) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        return preset(self.model, **{k: v for k, v in vars(self).items() if k in names})

    def resolved_seq_len(self, model_cfg: ModelConfig) -> int:
        return model_cfg.max_seq_len if self.seq_len is None else self.seq_len

    def batching_options(self) -> dict:
        """Keyword arguments of ``jaxaccel.data.DataStream`` for the batch size and strategy."""
        batch_size = self.batch_size
        if batch_size is None and self.tokens_per_batch is None:
            batch_size = 16
        options = {"batch_size": batch_size, "tokens_per_batch": self.tokens_per_batch,
                   "pad_multiple": self.pad_multiple, "num_buckets": self.buckets}
        if self.pack_window is not None:
            options["pack_window"] = self.pack_window
        return options

    def policy(self):
        return get_policy(self.precision)

    def make_loss_scale(self):
        """The run's initial loss-scale state from the --loss-scale flags and the policy."""
        return make_loss_scale(
            self.loss_scale, self.policy(), initial_scale=self.loss_scale_init,
            growth_factor=self.loss_scale_growth_factor, backoff_factor=self.loss_scale_backoff,
            growth_interval=self.loss_scale_growth_interval, min_scale=self.loss_scale_min,
            static_scale=self.loss_scale_init)

    def batch_rows(self, seq_len: int) -> int:
        """Rows per batch: --batch-size, or the rows of seq_len that --tokens-per-batch holds."""
        options = self.batching_options()
        return options["batch_size"] or max(1, options["tokens_per_batch"] // seq_len)

    def no_decay_patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.no_decay.split(",") if p.strip())

    def validate(self) -> ModelConfig:
        """Check the settings together; return the model config they describe."""
        model_cfg = self.model_config()
        seq_len = self.resolved_seq_len(model_cfg)
        for name in ("steps", "seq_len", "batch_size", "tokens_per_batch", "train_tokens",
                     "prefetch", "accumulate", "base_batch_size", "memory_budget",
                     "distributed_timeout", "final_eval_batches", "num_devices",
                     "eval_batch_size"):
            value = seq_len if name == "seq_len" else getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}; fix --{name.replace('_', '-')}")
        if self.batch_size is not None and self.batch_size % self.accumulate:
            raise ConfigError(
                f"batch_size={self.batch_size} does not split into --accumulate "
                f"{self.accumulate} microbatches; pass a batch size that is a multiple of it")
        if seq_len > model_cfg.max_seq_len:
            raise ConfigError(
                f"seq_len={seq_len} exceeds the model context max_seq_len={model_cfg.max_seq_len}; "
                f"lower --seq-len or raise --max-seq-len")
        for name in ("checkpoint_every", "eval_every", "eval_batches", "log_every", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}; fix "
                                  f"--{name.replace('_', '-')}")
        self.make_loss_scale()
        return model_cfg


def _scalar_type(annotation):
    """int for ``int | None``, and so on."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def build_parser(config_cls=TrainConfig, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one flag per dataclass field, defaults shown in --help."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        kind = _scalar_type(f.type)
        kwargs = {"default": f.default, "help": f.metadata.get("help", "")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, dest=f.name, **kwargs)
    return parser


def parse_config(argv=None, config_cls=TrainConfig, description: str = ""):
    """Parse command-line flags into ``config_cls``."""
    args = build_parser(config_cls, description).parse_args(argv)
    return config_cls(**vars(args))
