"""The settings sections that the model and the techniques declare, and the names and presets
their fields choose from (GPT presets, optimizers' defaults, strategies, schemes).

This module imports no jax, flax or orbax, so that building the command line is fast:
``jaxaccel.run.config`` makes ``TrainConfig`` from these sections and its own, and ``--help``
imports none of them (tests/test_startup.py). The module that does each one's work re-exports
what is its own (``lora.LoRASettings``, ``gpt.PRESETS``, ``optim.OPTIMIZERS``, ``init.SCHEMES``).
"""

import dataclasses
import os

from jaxaccel.core.errors import ConfigError
from jaxaccel.core.settings import setting
from jaxaccel.core.tokenizer import ByteTokenizer

# ---------------------------------------------------------------------------------------------
# The model: a preset of jaxaccel's GPT or a factory of one's own (jaxaccel.model.contract).


@dataclasses.dataclass
class ModelConfig:
    """The ``model`` section: which model, at which context and vocabulary."""

    name: str = setting("tiny", "the model: a preset of jaxaccel's GPT (tiny, small, medium, "
                                "gpt2; the gpt section changes its fields) or your own factory, "
                                "FILE.py:FUNCTION or package.module:FUNCTION, called as "
                                "FUNCTION(vocab_size, max_seq_len, rngs=nnx.Rngs(...), "
                                "**model_args) and returning an nnx.Module (README, 'Your own "
                                "model')", flag="model")
    args: str | None = setting(None, "keyword arguments for the model's factory, as a YAML "
                                     "mapping, e.g. 'width: 128, depth: 2'", flag="model_args")
    max_seq_len: int | None = setting(None, "the model's context length (default: the "
                                            "preset's; for a factory, seq_len or 256)",
                                      at_least=1)
    vocab_size: int | None = setting(None, "the model's vocabulary (set from the tokenizer)",
                                     flag="", at_least=1)


def is_preset(name: str) -> bool:
    return ":" not in name


def unknown_model(name: str) -> ConfigError:
    """The error for a ``--model`` that is neither a preset nor a factory; a file named without
    its function says so."""
    if name.endswith(".py") or os.path.isfile(name):
        return ConfigError(f"model {name} names a file but not its factory; give "
                           f"{name}:FUNCTION, the function that builds the model",
                           field="model.name")
    return ConfigError(f"unknown model {name!r}: give a preset ({', '.join(PRESETS)}) or a "
                       f"factory FILE.py:FUNCTION or package.module:FUNCTION", field="model.name")


def factory_file(name: str) -> str | None:
    """The file of a factory ``FILE.py:FUNCTION`` as given (None: a preset, or a factory
    ``package.module:FUNCTION``)."""
    where = name.rpartition(":")[0]
    return where if not is_preset(name) and where.endswith(".py") else None


def absolute_name(name: str) -> str:
    """``name`` as a run records it: a factory's ``FILE.py`` made absolute, so that the run's
    config finds the model from any directory (a preset or a module: unchanged)."""
    file = factory_file(name)
    return f"{os.path.abspath(file)}:{name.rpartition(':')[2]}" if file else name


def describe(cfg: ModelConfig, gpt_settings=None) -> str:
    """The preset's name (layers x width when the gpt section changes it), else the factory."""
    given = {} if gpt_settings is None else {
        k: v for k, v in dataclasses.asdict(gpt_settings).items() if v is not None}
    if not is_preset(cfg.name) or not given:
        return cfg.name
    shape = preset(cfg.name, **given)
    return f"{shape.n_layers}x{shape.d_model}"


# ---------------------------------------------------------------------------------------------
# jaxaccel's GPT (jaxaccel.model.gpt): its shape, presets and the ``gpt`` section.

MLP_KINDS = ("swiglu", "gelu")
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn", "pallas", "auto")     # jaxaccel.model.attention's
EMBEDDING_METHODS = ("auto", "one_hot", "sorted_sum", "gather")    # jaxaccel.model.embedding's
ONE_HOT_MAX_VOCAB = 2048        # embedding auto's largest one-hot vocabulary off the CPU


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The GPT's architecture. ``n_kv_heads`` and ``d_ff`` default from the others."""

    vocab_size: int = ByteTokenizer().padded_vocab_size
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    max_seq_len: int = 256
    mlp: str = "swiglu"
    tie_embeddings: bool = False
    rope_base: float = 10_000.0
    dropout: float = 0.0
    attention: str = "xla"
    embedding: str = "auto"

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", default_d_ff(self.d_model, self.mlp))
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self):
        """ConfigError on an inconsistent shape, naming the setting that fixes it."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                section = "model" if name in ("vocab_size", "max_seq_len") else "gpt"
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}",
                                  field=f"{section}.{name}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                              f"choose n_heads dividing d_model", field="gpt.n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} does not divide n_heads="
                              f"{self.n_heads}; choose n_kv_heads dividing n_heads",
                              field="gpt.n_kv_heads")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} (d_model/n_heads) is odd, rotary "
                              f"embedding needs it even; change d_model or n_heads",
                              field="gpt.n_heads")
        for name, value, choices in (("mlp", self.mlp, MLP_KINDS),
                                     ("attention", self.attention, ATTENTION_IMPLEMENTATIONS),
                                     ("embedding", self.embedding, EMBEDDING_METHODS)):
            if value not in choices:
                raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}",
                                  field=f"gpt.{name}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}", field="gpt.dropout")


def default_d_ff(d_model: int, mlp: str) -> int:
    """4*d for GELU; for SwiGLU 8/3*d rounded up to a multiple of 64 (about the same parameters)."""
    if mlp == "gelu":
        return 4 * d_model
    return -(-(8 * d_model // 3) // 64) * 64


PRESETS = {
    "tiny": GPTConfig(d_model=256, n_layers=4, n_heads=4, max_seq_len=256),
    "small": GPTConfig(d_model=768, n_layers=12, n_heads=12, max_seq_len=1024, mlp="gelu"),
    "medium": GPTConfig(d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024, mlp="gelu"),
    # GPT-2 124M: small's shape with GPT-2's vocabulary size, 50,257 padded to 50,304.
    "gpt2": GPTConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024,
                      mlp="gelu"),
}
# The tokenizer a preset trains with unless one is given (else bytes).
PRESET_TOKENIZERS = {"gpt2": "bpe:50257"}


@dataclasses.dataclass
class GPTSettings:
    """The ``gpt`` section: the preset's architecture fields a run changes (None: the preset's)."""

    d_model: int | None = setting(None, "model width", at_least=1)
    n_layers: int | None = setting(None, "number of transformer blocks", at_least=1)
    n_heads: int | None = setting(None, "attention heads; must divide d_model", at_least=1)
    n_kv_heads: int | None = setting(None, "key/value heads (grouped-query; default n_heads); "
                                           "must divide n_heads", at_least=1)
    d_ff: int | None = setting(None, "MLP inner width (default 4*d for gelu, ~8/3*d for swiglu)",
                               at_least=1)
    mlp: str | None = setting(None, "MLP kind", choices=MLP_KINDS)
    tie_embeddings: bool | None = setting(None, "share the input embedding with the output head")
    rope_base: float | None = setting(None, "rotary embedding base", above=1)
    dropout: float | None = setting(None, "residual dropout rate (0 = off)", at_least=0, below=1)
    attention: str | None = setting(
        None, "attention implementation: xla, cudnn (NVIDIA GPUs), pallas (our flash attention "
              "kernel; interpreted, slowly, off the GPU) or auto (on an NVIDIA GPU: pallas for "
              "packed rows and short sequences, cudnn above; else xla)",
        choices=ATTENTION_IMPLEMENTATIONS)
    embedding: str | None = setting(
        None, "token embedding lookup: auto (on GPUs one_hot up to "
              f"{ONE_HOT_MAX_VOCAB} ids, else sorted_sum; on a CPU gather for a float32 "
              "table, sorted_sum for a 16-bit one), one_hot, sorted_sum or gather; see "
              "experiments.embedding", choices=EMBEDDING_METHODS)


def preset(name: str, **overrides) -> GPTConfig:
    """A preset's config with the non-None ``overrides``; ``n_kv_heads`` and ``d_ff`` are
    re-derived unless given, so ``n_heads=8`` alone stays valid."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
                          f"or give a factory FILE.py:FUNCTION", field="model.name")
    fields = dataclasses.asdict(PRESETS[name])
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "n_heads" in overrides:
        fields["n_kv_heads"] = None
    if "d_model" in overrides or "mlp" in overrides:
        fields["d_ff"] = None
    fields.update(overrides)
    return GPTConfig(**fields)


# ---------------------------------------------------------------------------------------------
# The step's names: optimizers (jaxaccel.step.optim), loss scaling (precision), importance sampling
# (sampling), sharding strategies and mesh axis types (sharding), pipeline schedules (pipeline).

SCHEDULES = ("constant", "cosine", "linear", "rsqrt")
LR_SCALING = ("none", "linear", "sqrt")

# Lion takes AdamW's learning rate divided, and weight decay multiplied, by this factor.
LION_FACTOR = 10.0


@dataclasses.dataclass(frozen=True)
class OptimizerDefaults:
    """The settings an optimizer uses when the caller leaves them unset."""

    learning_rate: float
    weight_decay: float
    b1: float | None = None       # first-moment (momentum) decay; None: the optimizer has none
    b2: float | None = None       # second-moment decay
    summary: str = ""


_ADAMW_LR, _ADAMW_WD = 3e-3, 0.1
DEFAULTS = {
    "adamw": OptimizerDefaults(_ADAMW_LR, _ADAMW_WD, 0.9, 0.95, "Adam with decoupled weight decay"),
    "lion": OptimizerDefaults(_ADAMW_LR / LION_FACTOR, _ADAMW_WD * LION_FACTOR, 0.9, 0.99,
                              f"sign of interpolated momentum; lr {LION_FACTOR:g}x smaller and "
                              f"weight decay {LION_FACTOR:g}x larger than AdamW's"),
    "lamb": OptimizerDefaults(3e-2, 0.1, 0.9, 0.999,
                              "Adam update rescaled per layer by ||w|| / ||update||"),
    "lars": OptimizerDefaults(10.0, 1e-4, 0.9, None,
                              "momentum SGD rescaled per layer by 0.001 ||w|| / ||g||"),
    "sgd": OptimizerDefaults(0.1, 0.0, 0.9, None, "SGD with Nesterov momentum"),
    "adafactor": OptimizerDefaults(_ADAMW_LR, 0.0, None, 0.8,
                                   "factored second moments, no momentum, update clipping"),
}
OPTIMIZERS = tuple(DEFAULTS)


def describe_defaults() -> str:
    """One line per optimizer for ``--help``."""
    return "; ".join(f"{name}: lr {d.learning_rate:g}, wd {d.weight_decay:g} ({d.summary})"
                     for name, d in DEFAULTS.items())


LOSS_SCALE_KINDS = ("auto", "dynamic", "static", "none")
SAMPLING = ("uniform", "loss", "grad-norm")

# Which mesh axes each strategy spreads the work over.
SHARDING_STRATEGIES = {
    "dp": ("data",), "fsdp": ("fsdp",), "tp": ("tensor",), "fsdp+tp": ("fsdp", "tensor"),
    "dp+fsdp": ("data", "fsdp"), "pp": ("stage",), "dp+pp": ("data", "stage"),
    "fsdp+pp": ("fsdp", "stage"), "tp+pp": ("tensor", "stage"),
    "fsdp+tp+pp": ("fsdp", "tensor", "stage"),
}
MESH_AXIS_TYPES = ("auto", "explicit")          # the names of sharding.AXIS_TYPES
PIPELINE_SCHEDULES = ("gpipe", "1f1b")

# ---------------------------------------------------------------------------------------------
# The techniques' sections, each used by its module (jaxaccel.techniques.lora, fp8, sparsity, init,
# remat, stochastic_depth, token_drop, stacking).

TARGETS_HELP = ("comma-separated: blocks (every linear layer in the model's Stack), aliases the "
                "model defines (jaxaccel's GPT: q, k, v, o, in, gate, out) or regular "
                "expressions searched in a layer's path (blocks/layers/0/attn/wq)")


@dataclasses.dataclass
class LoRASettings:
    rank: int = setting(0, "LoRA rank on the lora_targets layers; with it only the LoRA "
                           "matrices (and adapters) train (0 = off)", flag="lora_rank",
                        at_least=0, note="0 = off")
    alpha: float = setting(16.0, "LoRA scale numerator: the update is (lora_alpha / lora_rank) "
                                 "A B", flag="lora_alpha", above=0)
    targets: str | None = setting(None, "layers that get LoRA (default: the model's, q,v for "
                                        "jaxaccel's GPT; else blocks): " + TARGETS_HELP,
                                  flag="lora_targets")


@dataclasses.dataclass
class AdapterSettings:
    dim: int = setting(0, "bottleneck adapter width on the output of each adapter_targets "
                          "layer; with it only the adapters (and LoRA) train (0 = off)",
                       flag="adapter_dim", at_least=0, note="0 = off")
    targets: str | None = setting(None, "layers whose outputs get an adapter (default: the "
                                        "model's, o,out for jaxaccel's GPT: the end of each "
                                        "residual branch): " + TARGETS_HELP,
                                  flag="adapter_targets")


@dataclasses.dataclass
class Fp8Settings:
    targets: str = setting("blocks", "with --precision fp8, the layers whose matmuls run in "
                                     "float8: " + TARGETS_HELP, flag="fp8_targets")


@dataclasses.dataclass
class SparsitySettings:
    pattern: str = setting("none", "N:M structured sparsity of the sparsity_targets layers, "
                                   "e.g. 2:4 (keep the 2 largest of every 4 input weights), "
                                   "masks from the weights' magnitudes, SR-STE gradients (none = "
                                   "off)", flag="sparsity")
    every: int = setting(100, "recompute the N:M masks from the weights every this many steps",
                         flag="sparsity_every", at_least=1)
    decay: float = setting(2e-4, "SR-STE decay of the pruned weights (lambda_W; 0 = plain "
                                 "straight-through)", flag="sparsity_decay", at_least=0)
    targets: str = setting("blocks", "layers under N:M masks: " + TARGETS_HELP,
                           flag="sparsity_targets")


INIT_SCHEMES = ("default", "rezero", "skipinit", "tfixup")


@dataclasses.dataclass
class InitSettings:
    scheme: str = setting("default", "initialisation scheme: default (the model's own), rezero "
                                     "(a learned gate per block starting at 0), skipinit (a "
                                     "learned multiplier per residual branch starting at 0) or "
                                     "tfixup (Xavier weights scaled by (9L)^-1/4, for training "
                                     "without warmup); the last three drop the blocks' norms",
                          flag="init", choices=INIT_SCHEMES)
    gates: str | None = setting(None, "rezero, skipinit: the layers that end each residual "
                                      "branch, whose outputs the gates multiply (default: the "
                                      "model's; o,out for jaxaccel's GPT): "
                                      + TARGETS_HELP, flag="gate_targets")
    scaled: str | None = setting(None, "tfixup: the layers whose weights are scaled by "
                                       "(9L)^-1/4 besides the embedding (default: the model's; "
                                       "v,o,in,gate,out for jaxaccel's GPT; else blocks): "
                                       + TARGETS_HELP, flag="tfixup_scaled")


REMAT_POLICIES = ("none", "full", "dots", "attention", "mlp", "offload")


@dataclasses.dataclass
class RematSettings:
    policy: str = setting("none", "activations each block keeps for the backward pass: none "
                                  "(all), full (only its input), dots (matmul outputs), attention "
                                  "(the tensors tagged query/key/value/attention_out), mlp "
                                  "(mlp_in/mlp_gate), offload (attention's, in pinned host "
                                  "memory), save:NAME,NAME (tensors the model tagged so)",
                          flag="remat")
    scan_layers: bool = setting(False, "stack the blocks' variables and run them with one "
                                       "lax.scan (one block to compile instead of n_layers)",
                                flag="scan_layers")


@dataclasses.dataclass
class StochasticDepthSettings:
    rate: float = setting(0.0, "stochastic depth: the last block's skip rate P, block l of L "
                               "skipped at l/L*P for a random set of rows, which it does not "
                               "compute (0 = off)", flag="stochastic_depth", at_least=0, below=1)


TOKEN_DROP_SCORES = ("random", "loss")


@dataclasses.dataclass
class TokenDropSettings:
    keep: float = setting(1.0, "token dropping: share of each row's tokens the token_drop_layers "
                               "compute in training, K = keep x seq_len rounded to a multiple of "
                               "8; the others skip those layers unchanged, evaluation runs every "
                               "token (1 = off)", flag="token_keep", above=0, at_most=1)
    layers: str | None = setting(None, "token dropping: layers START:END (0-based, END excluded) "
                                       "that see only the kept tokens (default: the middle half, "
                                       "e.g. 3:9 of 12; a model of fewer than 3 layers must name "
                                       "them)", flag="token_drop_layers")
    score: str = setting("random", "token dropping: how the middle layers' tokens are drawn each "
                                   "step: random (uniformly), or loss (weighted by the running "
                                   "loss of the token's target id); padding is dropped first",
                         flag="token_drop_score", choices=TOKEN_DROP_SCORES)


@dataclasses.dataclass
class StackingSettings:
    stages: int = setting(1, "progressive layer stacking: train in this many stages, the depth "
                             "doubling after each up to the model's (1 = off)",
                          flag="progressive_stack", at_least=1)
    at: str | None = setting(None, "comma-separated steps at which progressive stacking doubles "
                                   "the depth (default: equal shares of the steps)",
                             flag="stack_at")


# ---------------------------------------------------------------------------------------------
# The techniques: one record each, in the order they transform a model. ``jaxaccel.run.config``
# makes a config section of each record's settings, the run checks, builds, reports, resumes and
# strips each one through its record, and ``experiments.speedup`` takes its headline rows from
# them: adding a technique is its module (with ``transform``, ``check``, ``report`` and
# ``describe``; jaxaccel.techniques.registry) and its record in TECHNIQUES.


# Fields of configuration files written before the any-model change (config format 1), and
# where they live now (None: derived, dropped).
RENAMED = {"model.preset": "model.name", "model.fp8": None,
           **{f"model.{f}": f"gpt.{f}" for f in (
               "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "mlp", "tie_embeddings",
               "rope_base", "dropout", "attention", "embedding")},
           "model.remat": "remat.policy", "model.scan_layers": "remat.scan_layers",
           "model.init": "init.scheme", "model.stochastic_depth": "stochastic_depth.rate",
           "model.lora_rank": "lora.rank", "model.lora_alpha": "lora.alpha",
           "model.lora_targets": "lora.targets", "model.adapter_dim": "adapters.dim",
           "model.sparsity": "sparsity.pattern", "model.sparsity_every": "sparsity.every",
           "model.sparsity_decay": "sparsity.decay", "model.token_keep": "token_drop.keep",
           "model.token_drop_layers": "token_drop.layers",
           "model.token_drop_score": "token_drop.score",
           "run.progressive_stack": "stacking.stages", "run.stack_at": "stacking.at"}


@dataclasses.dataclass(frozen=True)
class HeadlineRow:
    """A row of ``experiments.speedup``: its name, the group whose soonest row the best
    combination takes (``combine`` False: never combined), what it does, the config values that
    make it from the baseline, and what it ``needs`` ("gpu", "fp8": FP8 tensor cores, "devices":
    more than one)."""

    name: str
    group: str
    description: str
    settings: dict
    needs: str | None = None
    combine: bool = True


@dataclasses.dataclass(frozen=True)
class Technique:
    """One technique, declared without jax. ``module`` (a dotted name, imported when a run
    needs it) holds its work; ``phase`` says when it transforms a model: ``init`` (before a
    base run's weights are loaded), ``layers`` (before the compute dtype), ``blocks`` (after).
    ``off``: its section's values at which it does nothing (the headline's baseline takes
    them); ``resume``: a resumed run must have the same section; ``strip``: a base model read
    for ``--init-from`` is built with it off."""

    name: str                   # its config section, and its flags' group in --help
    settings: type              # that section's dataclass of ``setting(...)`` fields
    module: str
    phase: str
    off: dict = dataclasses.field(default_factory=dict)
    resume: bool = True
    strip: bool = False
    rows: tuple = ()            # its HeadlineRows

    def off_values(self) -> dict:
        """``off`` by field path: ``{"token_drop.keep": 1.0}``."""
        return {f"{self.name}.{field}": value for field, value in self.off.items()}

    def is_on(self, cfg) -> bool:
        """Whether ``cfg``'s section asks for it (a technique with no ``off`` values decides in
        its own ``transform``: fp8's is the precision policy)."""
        section = getattr(cfg, self.name)
        return any(getattr(section, field) != value for field, value in self.off.items())


TECHNIQUES = [
    Technique("init", InitSettings, "jaxaccel.techniques.init", "init", {"scheme": "default"}),
    Technique("lora", LoRASettings, "jaxaccel.techniques.lora", "layers", {"rank": 0},
              strip=True),
    Technique("adapters", AdapterSettings, "jaxaccel.techniques.lora", "layers", {"dim": 0},
              strip=True),
    Technique("sparsity", SparsitySettings, "jaxaccel.techniques.sparsity", "layers",
              {"pattern": "none"}, strip=True, rows=(HeadlineRow(
                  "sparse-2:4", "sparsity", "2:4 structured sparse weights (SR-STE); masked "
                  "dense matmuls, no sparse kernel in jax", {"sparsity.pattern": "2:4"},
                  combine=False),)),
    Technique("fp8", Fp8Settings, "jaxaccel.techniques.fp8", "layers", rows=(HeadlineRow(
        "fp8", "precision", "FP8 matmuls in the blocks (delayed scaling), bf16 elsewhere",
        {"precision.policy": "fp8"}, needs="fp8"),)),
    Technique("remat", RematSettings, "jaxaccel.techniques.remat", "blocks",
              {"policy": "none", "scan_layers": False}, strip=True, rows=tuple(
                  HeadlineRow(f"remat-{policy}", "remat", f"remat policy {policy}",
                              {"remat.policy": policy})
                  for policy in ("full", "dots", "attention", "mlp", "offload"))),
    Technique("stochastic_depth", StochasticDepthSettings, "jaxaccel.techniques.stochastic_depth",
              "blocks", {"rate": 0.0}, strip=True, rows=(HeadlineRow(
                  "stochastic-depth", "stochastic depth", "stochastic depth: block l of L "
                  "skipped (not computed) for a random set of rows at rate 0.2 l/L in training",
                  {"stochastic_depth.rate": 0.2}),)),
    Technique("token_drop", TokenDropSettings, "jaxaccel.techniques.token_drop", "blocks",
              {"keep": 1.0}, strip=True, rows=(HeadlineRow(
                  "token-drop", "token dropping", "half of each row's tokens (random) in the "
                  "middle layers (the last of a model under 3 layers)",
                  {"token_drop.keep": 0.5}),)),
    Technique("stacking", StackingSettings, "jaxaccel.techniques.stacking", "blocks",
              {"stages": 1}, rows=(HeadlineRow(
                  "stack", "stacking", "progressive stacking: half the depth, doubled by "
                  "stacking a copy of the trained blocks after --stack-share of the baseline's "
                  "steps to the target", {"stacking.stages": 2}),)),
]
PHASES = ("init", "layers", "blocks")


def register(technique: Technique) -> None:
    """Add a technique of one's own after jaxaccel's (a record as above, in a module importable
    by name, which holds its functions). Register before ``jaxaccel.run.config`` is imported:
    the config's sections are made from TECHNIQUES when it is. The processes this one starts
    (an experiment's rows) register it too, through ``JAXACCEL_TECHNIQUES``."""
    import sys
    if "jaxaccel.run.config" in sys.modules:
        raise RuntimeError(f"register technique {technique.name!r} before importing "
                           f"jaxaccel.run.config (its TrainConfig has the sections of the "
                           f"techniques registered then)")
    if technique.phase not in PHASES or any(t.name == technique.name for t in TECHNIQUES):
        raise ValueError(f"technique {technique.name!r}: a new name, and a phase of {PHASES}")
    if technique.module == "__main__":
        raise ValueError(f"technique {technique.name!r}: declare it in a module the processes a "
                         f"run starts can import by name, not in the script run as __main__")
    module = sys.modules.get(technique.module)
    name = next((k for k, v in vars(module).items() if v is technique), None) if module else None
    if name is None:
        raise ValueError(f"technique {technique.name!r}: its record is not a name of its "
                         f"module {technique.module!r}")
    TECHNIQUES.append(technique)
    entries = [e for e in os.environ.get(ENVIRONMENT, "").split(",") if e]
    os.environ[ENVIRONMENT] = ",".join(dict.fromkeys([*entries, f"{technique.module}:{name}"]))


# Techniques of one's own, as MODULE:RECORD,...: registered when this module is imported (set by
# ``register`` for the processes a run starts, or by hand before a command).
ENVIRONMENT = "JAXACCEL_TECHNIQUES"
UNREGISTERED = []   # why an entry of it could not be registered: the config refuses to build


def _register_from_environment() -> None:
    import importlib
    for entry in filter(None, os.environ.get(ENVIRONMENT, "").split(",")):
        module, _, name = entry.partition(":")
        try:
            record = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            UNREGISTERED.append(f"{ENVIRONMENT}={entry}: cannot register it ({e}); put its "
                                f"module on PYTHONPATH or unset {ENVIRONMENT}")
            continue
        if all(t.name != record.name for t in TECHNIQUES):
            TECHNIQUES.append(record)


_register_from_environment()
