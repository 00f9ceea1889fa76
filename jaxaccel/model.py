"""A decoder-only transformer (GPT) in Flax NNX.

Token embedding, rotary position embedding driven by the Batch's ``positions`` (so packed
documents restart at 0), pre-norm blocks with RMSNorm, grouped-query attention through
``jaxaccel.attention.dot_product_attention``, a SwiGLU or GELU MLP and an untied or tied output
head. Logits come out in float32. The model computes in the dtype of the parameters it is given:
the precision policy casts the float32 master parameters to its compute dtype before ``apply``,
and RMSNorm statistics, rotary angles, the attention softmax and the loss stay in float32.

The module is stateful NNX; training code works on a plain nested dict of parameters
(``init_params``) and a pure ``apply`` function (``make_apply``), so that every step function is a
pure function of pytrees.

Each block runs as a pure function of its parameters, checkpointed under the ``remat`` policy
(``jaxaccel.remat``); the tensors the policies name are tagged with ``checkpoint_name``. With
``scan_layers`` the blocks' parameters are stacked on a leading layer axis (``params["blocks"]``
is one dict of [n_layers, ...] arrays) and one ``lax.scan`` applies them: XLA compiles one block
instead of n_layers.

Every weight's dimensions have logical names (``PARAM_AXES``, ``param_axes``) and the main
activations are constrained to theirs, so the same model runs data parallel, FSDP or tensor
parallel depending only on the mesh in context (``jaxaccel.sharding``); without a mesh the
constraints do nothing.
"""

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxaccel import buffers as buffers_lib
from jaxaccel import embedding
from jaxaccel import fp8 as fp8_lib
from jaxaccel import remat as remat_lib
from jaxaccel import stochastic_depth as sd_lib
from jaxaccel import token_drop as td_lib
from jaxaccel.init import INIT_SCHEMES, initialize
from jaxaccel.attention import IMPLEMENTATIONS, dot_product_attention
from jaxaccel.errors import ConfigError
from jaxaccel.sharding import constrain, matmul
from jaxaccel.sparsity import init_masks, sparse_weight
from jaxaccel.tokenizer import ByteTokenizer

MLP_KINDS = ("swiglu", "gelu")
# LoRA targets by their short name, and the layer each names.
LORA_TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "in": "w_in", "gate": "w_gate",
                "out": "w_out"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and options of the GPT. ``n_kv_heads`` and ``d_ff`` default from the others."""

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
    remat: str = "none"
    scan_layers: bool = False
    init: str = "default"
    stochastic_depth: float = 0.0
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "q,v"
    adapter_dim: int = 0
    fp8: bool = False
    sparsity: str = "none"
    sparsity_every: int = 100
    sparsity_decay: float = 2e-4
    token_keep: float = 1.0
    token_drop_layers: str | None = None
    token_drop_score: str = "random"

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
        """Raise ConfigError on an inconsistent shape, naming the field that fixes it."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}",
                                  field=f"model.{name}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; choose n_heads "
                f"dividing d_model", field="model.n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; choose "
                f"n_kv_heads dividing n_heads", field="model.n_kv_heads")
        if self.head_dim % 2:
            raise ConfigError(
                f"head_dim={self.head_dim} (d_model/n_heads) is odd, rotary embedding needs it "
                f"even; change d_model or n_heads", field="model.n_heads")
        if self.mlp not in MLP_KINDS:
            raise ConfigError(f"unknown mlp {self.mlp!r}; choose one of {', '.join(MLP_KINDS)}",
                              field="model.mlp")
        if self.attention not in IMPLEMENTATIONS:
            raise ConfigError(
                f"unknown attention {self.attention!r}; choose one of "
                f"{', '.join(IMPLEMENTATIONS)}", field="model.attention")
        if self.embedding not in embedding.METHODS:
            raise ConfigError(
                f"unknown embedding {self.embedding!r}; choose one of "
                f"{', '.join(embedding.METHODS)}", field="model.embedding")
        remat_lib.check_policy(self.remat)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}",
                              field="model.dropout")
        if self.init not in INIT_SCHEMES:
            raise ConfigError(f"unknown init {self.init!r}; choose one of "
                              f"{', '.join(INIT_SCHEMES)}", field="model.init")
        if not 0.0 <= self.stochastic_depth < 1.0:
            raise ConfigError(f"stochastic_depth must be in [0, 1), got "
                              f"{self.stochastic_depth}", field="model.stochastic_depth")
        if self.lora_rank < 0 or self.adapter_dim < 0:
            field = "model.lora_rank" if self.lora_rank < 0 else "model.adapter_dim"
            raise ConfigError(f"{field.split('.')[1]} must be >= 0 (0 = off), got "
                              f"{getattr(self, field.split('.')[1])}", field=field)
        if self.lora_rank:
            widths = {"wq": (self.d_model, self.n_heads * self.head_dim),
                      "wk": (self.d_model, self.n_kv_heads * self.head_dim),
                      "wv": (self.d_model, self.n_kv_heads * self.head_dim),
                      "wo": (self.n_heads * self.head_dim, self.d_model),
                      "w_in": (self.d_model, self.d_ff), "w_gate": (self.d_model, self.d_ff),
                      "w_out": (self.d_ff, self.d_model)}
            for layer in self.lora_layers:
                if self.lora_rank > min(widths[layer]):
                    raise ConfigError(
                        f"lora_rank={self.lora_rank} exceeds the width {min(widths[layer])} of "
                        f"{layer}; choose a rank of at most the layer's smaller dimension",
                        field="model.lora_rank")
            if not self.lora_alpha > 0 or self.lora_alpha == float("inf"):
                raise ConfigError(f"lora_alpha must be a positive finite number, got "
                                  f"{self.lora_alpha}", field="model.lora_alpha")

        if self.sparsity != "none":
            from jaxaccel.sparsity import parse_pattern
            n, m = parse_pattern(self.sparsity)
            for name, d_in in (("d_model", self.d_model), ("d_ff", self.d_ff)):
                if d_in % m:
                    raise ConfigError(
                        f"sparsity {self.sparsity} groups {m} input features, but {name}="
                        f"{d_in} is not a multiple of {m}; choose a width divisible by {m}",
                        field="model.sparsity")
            if self.sparsity_every < 1:
                raise ConfigError(f"sparsity_every must be >= 1, got {self.sparsity_every}",
                                  field="model.sparsity_every")
            if not 0.0 <= self.sparsity_decay < float("inf"):
                raise ConfigError(f"sparsity_decay must be a finite number >= 0, got "
                                  f"{self.sparsity_decay}", field="model.sparsity_decay")
        from jaxaccel.token_drop import validate as validate_token_drop
        validate_token_drop(self)

    @property
    def lora_layers(self) -> tuple[str, ...]:
        """The layers (``wq``, ...) that carry LoRA updates: ``lora_targets`` resolved."""
        names = [t.strip() for t in self.lora_targets.split(",") if t.strip()]
        unknown = [t for t in names if t not in LORA_TARGETS]
        if unknown or not names:
            raise ConfigError(f"unknown lora_targets {unknown or self.lora_targets!r}; choose "
                              f"comma-separated from {', '.join(LORA_TARGETS)}",
                              field="model.lora_targets")
        layers = tuple(LORA_TARGETS[t] for t in names)
        if "w_gate" in layers and self.mlp != "swiglu":
            raise ConfigError("lora target gate needs mlp=swiglu (a GELU MLP has no gate); "
                              "leave it out", field="model.lora_targets")
        return layers

    @property
    def block_norms(self) -> bool:
        """Whether the blocks normalise their branches' inputs: the Fixup family removes it."""
        return self.init == "default"


def default_d_ff(d_model: int, mlp: str) -> int:
    """4*d for GELU; for SwiGLU 8/3*d rounded up to a multiple of 64 (about the same parameters)."""
    if mlp == "gelu":
        return 4 * d_model
    return -(-(8 * d_model // 3) // 64) * 64


PRESETS = {
    "tiny": ModelConfig(d_model=256, n_layers=4, n_heads=4, max_seq_len=256),
    "small": ModelConfig(d_model=768, n_layers=12, n_heads=12, max_seq_len=1024, mlp="gelu"),
    "medium": ModelConfig(d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024, mlp="gelu"),
    # GPT-2 124M: small's shape with GPT-2's vocabulary size, 50,257 padded to 50,304.
    "gpt2": ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024,
                        mlp="gelu"),
}
# The tokenizer a preset trains with unless one is given (else bytes).
PRESET_TOKENIZERS = {"gpt2": "bpe:50257"}


def describe_model(cfg: ModelConfig) -> str:
    """The preset's name if ``cfg`` is one, else its layers x width, e.g. ``2x128``."""
    for name, known in PRESETS.items():
        if known == cfg:
            return name
    return f"{cfg.n_layers}x{cfg.d_model}"


def preset(name: str, **overrides) -> ModelConfig:
    """A preset's config with some fields replaced; ``None`` overrides are ignored.

    ``n_kv_heads`` and ``d_ff`` are re-derived unless given, so ``n_heads=8`` alone stays valid.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}",
                          field="model.preset")
    fields = dataclasses.asdict(PRESETS[name])
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "n_heads" in overrides:
        fields["n_kv_heads"] = None
    if "d_model" in overrides or "mlp" in overrides:
        fields["d_ff"] = None
    fields.update(overrides)
    return ModelConfig(**fields)


def rotary_sin_cos(positions_BT, head_dim: int, base: float):
    """Sines and cosines [B, T, R] of the rotary angles, in float32."""
    inv_freq_R = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles_BTR = positions_BT.astype(jnp.float32)[..., None] * inv_freq_R
    return jnp.sin(angles_BTR), jnp.cos(angles_BTR)


def apply_rotary(x_BTHE, sin_BTR, cos_BTR):
    """Rotate the two halves of each head's features by the position's angles."""
    x1, x2 = jnp.split(x_BTHE.astype(jnp.float32), 2, axis=-1)
    sin, cos = sin_BTR[:, :, None], cos_BTR[:, :, None]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTHE.dtype)


# Logical names of each weight's dimensions, by the name of the layer that holds it; the
# sharding rules map them to mesh axes (``jaxaccel.sharding``).
PARAM_AXES = {
    "embed": ("vocab", "embed"), "head": ("embed", "vocab"),
    "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"), "w_in": ("embed", "mlp"), "w_gate": ("embed", "mlp"),
    "w_out": ("mlp", "embed"), "attn_norm": ("norm",), "mlp_norm": ("norm",),
    "final_norm": ("norm",), "alpha": (), "attn_alpha": (), "mlp_alpha": (),
    "adapter_down": ("embed", "adapter"), "adapter_up": ("adapter", "embed"),
    "token_drop": ("vocab",),
}
# Logical names of the main activations.
ACTIVATION_AXES = ("batch", "seq", "embed")
Q_AXES = ("batch", "seq", "heads", "head_dim")
KV_AXES = ("batch", "seq", "kv_heads", "head_dim")


class Dense(nnx.Module):
    """``x @ kernel`` without bias. Under a mesh the kernel is gathered to its compute layout
    where it is used (FSDP's all-gather, one layer at a time) and the output's features take the
    kernel's output axis (split over ``tensor`` for heads and the MLP's inner dimension).

    With ``lora`` = (rank, alpha) the layer adds a low-rank update, ``x kernel + (alpha / rank)
    (x lora_a) lora_b`` (``jaxaccel.lora``): ``lora_a`` [d_in, r] starts Gaussian, ``lora_b``
    [r, d_out] at zero, so the layer starts as its kernel alone.

    With ``sparsity`` = (n, m, decay) the kernel is used through its N:M mask ``nm_mask``
    (``jaxaccel.sparsity``); with ``fp8`` the product runs in float8, scaled by the amax history
    ``fp8_amax`` (``jaxaccel.fp8``). Both are buffers: state in the parameter dict, not weights."""

    def __init__(self, d_in, d_out, std, rngs, name, lora=None, *, fp8=False, sparsity=None):
        self.kernel = nnx.Param(nnx.initializers.normal(stddev=std)(rngs.params(), (d_in, d_out)))
        self.axes = PARAM_AXES[name]
        self.lora_scale = None
        if lora:
            rank, alpha = lora
            self.lora_scale = alpha / rank
            self.lora_a = nnx.Param(nnx.initializers.normal(stddev=d_in ** -0.5)(
                rngs.params(), (d_in, rank)))
            self.lora_b = nnx.Param(jnp.zeros((rank, d_out)))
        self.sparsity_decay = None
        if sparsity:
            self.sparsity_decay = sparsity
            self.nm_mask = nnx.Param(jnp.ones((d_in, d_out), jnp.bool_))
        self.fp8 = fp8
        if fp8:
            self.fp8_amax = nnx.Param(fp8_lib.new_history())

    def __call__(self, x):
        kernel = self.kernel[...]
        if self.sparsity_decay is not None:
            kernel = sparse_weight(kernel, self.nm_mask[...], self.sparsity_decay)
        kernel = constrain(kernel, self.axes)
        out_axes = ("batch", "seq", self.axes[1])
        if self.fp8:
            y = fp8_lib.matmul(x, kernel, self.fp8_amax[...], self.axes)
        else:
            y = matmul(x, kernel, out_axes)
        if self.lora_scale is None:
            return y
        low_BTR = x @ self.lora_a[...].astype(x.dtype)
        update = matmul(low_BTR, self.lora_b[...].astype(x.dtype), out_axes)
        return y + (self.lora_scale * update).astype(y.dtype)


def _projection(cfg, name, d_in, d_out, std, rngs):
    """A block's projection ``name`` (wq, ..., w_out) with the options ``cfg`` gives it: LoRA,
    N:M sparsity, FP8."""
    return Dense(d_in, d_out, std, rngs, name, _lora(cfg, name), fp8=cfg.fp8,
                 sparsity=cfg.sparsity_decay if cfg.sparsity != "none" else None)


def _lora(cfg, name):
    """The ``lora`` argument of ``Dense`` for layer ``name`` under ``cfg``."""
    return (cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank and name in cfg.lora_layers else None


class Scalar(nnx.Module):
    """One learned scalar (a residual branch's gate), starting at ``value``."""

    def __init__(self, value: float):
        self.value = nnx.Param(jnp.full((), value, jnp.float32))

    def __call__(self):
        return self.value[...]


class Adapter(nnx.Module):
    """A bottleneck adapter (Houlsby et al. 2019): ``h + up(gelu(down(h)))`` on a branch's output,
    ``up`` starting at zero so the adapter starts as the identity."""

    def __init__(self, d_model: int, dim: int, rngs):
        self.adapter_down = Dense(d_model, dim, 0.02, rngs, "adapter_down")
        self.adapter_up = Dense(dim, d_model, 0.02, rngs, "adapter_up")
        self.adapter_up.kernel[...] = jnp.zeros_like(self.adapter_up.kernel[...])

    def __call__(self, h_BTD):
        return h_BTD + self.adapter_up(jax.nn.gelu(self.adapter_down(h_BTD)))


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.head_dim
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.wq = _projection(cfg, "wq", d, cfg.n_heads * hd, 0.02, rngs)
        self.wk = _projection(cfg, "wk", d, cfg.n_kv_heads * hd, 0.02, rngs)
        self.wv = _projection(cfg, "wv", d, cfg.n_kv_heads * hd, 0.02, rngs)
        self.wo = _projection(cfg, "wo", cfg.n_heads * hd, d, out_std, rngs)

    def __call__(self, x_BTD, sin_BTR, cos_BTR, segment_ids_BT, cache=None, cache_index=None):
        """The attention branch. With ``cache`` = (k_BSKE, v_BSKE), this layer's key/value cache
        (``jaxaccel.generate``), it also returns the cache with this call's keys and values
        written in: at 0 when ``cache_index`` is None (the prefill, which attends exactly as the
        forward pass does), else at ``cache_index``, attending to the cache's first
        ``cache_index`` + T entries (causally within the T new tokens)."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        q_BTHE = constrain(self.wq(x_BTD).reshape(B, T, cfg.n_heads, cfg.head_dim), Q_AXES)
        k_BTKE = constrain(self.wk(x_BTD).reshape(B, T, cfg.n_kv_heads, cfg.head_dim), KV_AXES)
        v_BTKE = constrain(self.wv(x_BTD).reshape(B, T, cfg.n_kv_heads, cfg.head_dim), KV_AXES)
        q_BTHE = checkpoint_name(apply_rotary(q_BTHE, sin_BTR, cos_BTR), remat_lib.QUERY)
        k_BTKE = checkpoint_name(apply_rotary(k_BTKE, sin_BTR, cos_BTR), remat_lib.KEY)
        v_BTKE = checkpoint_name(v_BTKE, remat_lib.VALUE)
        if cache is not None:
            start = 0 if cache_index is None else cache_index
            cache = tuple(jax.lax.dynamic_update_slice(c_BSKE, x_BTKE.astype(c_BSKE.dtype),
                                                       (0, start, 0, 0))
                          for c_BSKE, x_BTKE in zip(cache, (k_BTKE, v_BTKE)))
        if cache is not None and cache_index is not None:
            out_BTHE = cached_attention(q_BTHE, *cache, cache_index)
        else:
            out_BTHE = dot_product_attention(
                q_BTHE, k_BTKE, v_BTKE, segment_ids=segment_ids_BT, causal=True,
                implementation=cfg.attention)
        out_BTHE = checkpoint_name(out_BTHE, remat_lib.ATTENTION_OUT)
        out_BTD = self.wo(out_BTHE.reshape(B, T, cfg.n_heads * cfg.head_dim))
        return out_BTD if cache is None else (out_BTD, cache)


def cached_attention(q_BTHE, k_BSKE, v_BSKE, index):
    """Attention of T new queries at positions ``index`` .. ``index`` + T - 1 over a key/value
    cache of S slots whose first ``index`` + T hold keys (a traced ``index``: slots after them
    are masked, so their contents do not matter). The arithmetic of ``xla_attention``: scores
    and softmax in float32, 1/sqrt(E) scale, grouped-query heads."""
    B, T, H, E = q_BTHE.shape
    S, K = k_BSKE.shape[1], k_BSKE.shape[2]
    q_BTKGE = q_BTHE.reshape(B, T, K, H // K, E)
    scores_BKGTS = jnp.einsum("btkge,bske->bkgts", q_BTKGE, k_BSKE.astype(q_BTHE.dtype),
                              preferred_element_type=jnp.float32) * E ** -0.5
    visible_TS = jnp.arange(S)[None, :] <= index + jnp.arange(T)[:, None]
    scores_BKGTS = jnp.where(visible_TS, scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    out_BTKGE = jnp.einsum("bkgts,bske->btkge", probs_BKGTS.astype(q_BTHE.dtype),
                           v_BSKE.astype(q_BTHE.dtype), preferred_element_type=jnp.float32)
    return out_BTKGE.reshape(B, T, H, E).astype(q_BTHE.dtype)


class MLP(nnx.Module):
    """SwiGLU (silu(x W_gate) * x W_up) W_down, or GELU(x W_in) W_out."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.kind = cfg.mlp
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.w_in = _projection(cfg, "w_in", cfg.d_model, cfg.d_ff, 0.02, rngs)
        if cfg.mlp == "swiglu":
            self.w_gate = _projection(cfg, "w_gate", cfg.d_model, cfg.d_ff, 0.02, rngs)
        self.w_out = _projection(cfg, "w_out", cfg.d_ff, cfg.d_model, out_std, rngs)

    def __call__(self, x_BTD):
        in_BTF = checkpoint_name(self.w_in(x_BTD), remat_lib.MLP_IN)
        if self.kind == "swiglu":
            gate_BTF = checkpoint_name(self.w_gate(x_BTD), remat_lib.MLP_GATE)
            h_BTF = jax.nn.silu(gate_BTF) * in_BTF
        else:
            h_BTF = jax.nn.gelu(in_BTF)
        return self.w_out(h_BTF)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    The Fixup family (``jaxaccel.init``) drops the norms; ReZero multiplies both branches by one
    learned scalar ``alpha`` per block, SkipInit each branch by its own (``attn_alpha``,
    ``mlp_alpha``), all starting at 0. Adapters (``adapter_dim``) sit on each branch's output.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.dropout = cfg.dropout
        self.init = cfg.init
        if cfg.block_norms:
            self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
            self.mlp_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        if cfg.init == "rezero":
            self.alpha = Scalar(0.0)
        elif cfg.init == "skipinit":
            self.attn_alpha, self.mlp_alpha = Scalar(0.0), Scalar(0.0)
        if cfg.adapter_dim:
            self.attn_adapter = Adapter(cfg.d_model, cfg.adapter_dim, rngs)
            self.mlp_adapter = Adapter(cfg.d_model, cfg.adapter_dim, rngs)

    def _norm(self, which, x_BTD):
        return getattr(self, which)(x_BTD) if hasattr(self, which) else x_BTD

    def _branch(self, which, h_BTD):
        """A branch's output: through its adapter, times its gate."""
        if hasattr(self, f"{which}_adapter"):
            h_BTD = getattr(self, f"{which}_adapter")(h_BTD)
        gate = {"rezero": "alpha", "skipinit": f"{which}_alpha"}.get(self.init)
        if gate is not None:
            h_BTD = h_BTD * getattr(self, gate)().astype(h_BTD.dtype)
        return h_BTD

    def _drop(self, x, key):
        if key is None or self.dropout == 0.0:
            return x
        keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
        return jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)

    def __call__(self, x_BTD, sin_BTR, cos_BTR, segment_ids_BT, dropout_key=None, cache=None,
                 cache_index=None):
        """The block's output; with a key/value ``cache`` (``Attention``), also the updated
        cache."""
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        h_BTD = self.attn(self._norm("attn_norm", x_BTD), sin_BTR, cos_BTR, segment_ids_BT,
                          cache, cache_index)
        if cache is not None:
            h_BTD, cache = h_BTD
        x_BTD = x_BTD + self._drop(self._branch("attn", h_BTD), keys[0])
        h_BTD = self.mlp(self._norm("mlp_norm", x_BTD))
        x_BTD = x_BTD + self._drop(self._branch("mlp", h_BTD), keys[1])
        return x_BTD if cache is None else (x_BTD, cache)


class TokenLoss(nnx.Module):
    """Token dropping's running loss per vocabulary id (a buffer, ``jaxaccel.token_drop``)."""

    def __init__(self, vocab_size: int):
        self.token_loss = nnx.Param(td_lib.initial_loss(vocab_size))


class GPT(nnx.Module):
    """Decoder-only transformer: ids [B, T] -> float32 logits [B, T, vocab_size]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model,
                               embedding_init=nnx.initializers.normal(stddev=0.02), rngs=rngs)
        blocks = [Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)]
        # Stacked blocks are made as unrolled ones and stacked, so that both layouts start from
        # the same weights for the same key.
        self.blocks = _stack_modules(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.final_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = Dense(cfg.d_model, cfg.vocab_size, 0.02, rngs, "head")
        if td_lib.has_buffer(cfg):         # a buffer, no random draw: the weights stay the same
            self.token_drop = TokenLoss(cfg.vocab_size)

    def __call__(self, inputs_BT, positions_BT, segment_ids_BT, *, dropout_key=None,
                 targets_BT=None):
        x_BTD = self.embed_tokens(inputs_BT)
        x_BTD = self.run_blocks(x_BTD, positions_BT, segment_ids_BT, dropout_key,
                                targets_BT=targets_BT)
        return self.logits(x_BTD)

    def decode(self, inputs_BT, positions_BT, cache, cache_index=None):
        """Logits [B, T, V] of ``inputs_BT`` (one segment per row, at ``positions_BT``) and the
        key/value cache with their keys and values written in (``jaxaccel.generate``).
        ``cache`` is a pair (k, v): [L, B, S, K, E] arrays with ``scan_layers`` (one
        ``lax.scan`` over layers and cache), else tuples of L [B, S, K, E] arrays. Without
        ``cache_index`` this is the prefill: the forward pass of ``__call__`` (no dropout, no
        dropped tokens or layers) that also fills the cache from slot 0; with it, the T tokens
        attend to the cache's first ``cache_index`` + T slots."""
        cfg = self.cfg
        sin_BTR, cos_BTR = rotary_sin_cos(positions_BT, cfg.head_dim, cfg.rope_base)
        segment_ids_BT = jnp.ones_like(inputs_BT)
        x_BTD = self.embed_tokens(inputs_BT)
        k_cache, v_cache = cache
        if cfg.scan_layers:
            graphdef, stacked = nnx.split(self.blocks)

            def body(x_BTD, layer):
                state, k_BSKE, v_BSKE = layer
                return nnx.merge(graphdef, state)(x_BTD, sin_BTR, cos_BTR, segment_ids_BT,
                                                  None, (k_BSKE, v_BSKE), cache_index)

            x_BTD, (k_cache, v_cache) = jax.lax.scan(body, x_BTD, (stacked, k_cache, v_cache))
        else:
            new = []
            for block, k_BSKE, v_BSKE in zip(self.blocks, k_cache, v_cache):
                x_BTD, kv = block(x_BTD, sin_BTR, cos_BTR, segment_ids_BT, None,
                                  (k_BSKE, v_BSKE), cache_index)
                new.append(kv)
            k_cache, v_cache = tuple(kv[0] for kv in new), tuple(kv[1] for kv in new)
        return self.logits(x_BTD), (k_cache, v_cache)

    def embed_tokens(self, inputs_BT):
        """The token embeddings [B, T, D]."""
        # The table's own dtype (the policy's compute dtype when the caller cast the parameters):
        # nnx.Embed would promote it to its float32 default and take the whole model with it.
        table_VD = constrain(self.embed.embedding[...], PARAM_AXES["embed"])
        return embedding.lookup(table_VD, inputs_BT, ACTIVATION_AXES, self.cfg.embedding)

    def logits(self, x_BTD):
        """The final norm and the output head: float32 logits [B, T, V]."""
        x_BTD = self.final_norm(x_BTD)
        if self.cfg.tie_embeddings:
            table_VD = constrain(self.embed.embedding[...], PARAM_AXES["embed"])
            logits_BTV = jnp.einsum("btd,vd->btv", x_BTD, table_VD)
        else:
            logits_BTV = self.head(x_BTD)
        return logits_BTV.astype(jnp.float32)

    def run_blocks(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None,
                   first_layer=0, targets_BT=None, segment_attention=True):
        """The stack of blocks this module holds, each a pure function of (its parameters, x,
        layer index) under the remat policy. Layer i's dropout key is ``fold_in(dropout_key,
        first_layer + i)`` in both layouts; a pipeline stage holding layers ``first_layer ..``
        of a stacked model passes its first index, so every layer gets the key it has unsplit.

        With ``stochastic_depth`` and a key (training), layer i computes only the rows
        ``jaxaccel.stochastic_depth`` keeps for it; stacked layers are scanned in runs of equal
        kept rows, one scan per run.

        With token dropping (``token_keep`` < 1) and a key, the layers ``token_drop_layers`` run
        on each row's kept tokens only (``jaxaccel.token_drop``: gathered before the first of
        them, scattered back after the last, scanned apart from the others); the ``loss`` score
        reads the batch's ``targets_BT``.

        ``segment_attention=False`` is for rows that each hold one segment from column 0
        (every batching but pack): attention is then causal only, with no segment mask. A real
        token's keys are the same (the padding comes after it) and the padding's outputs, which
        no loss or real token reads, stay finite; token dropping keeps the mask (it moves
        tokens)."""
        cfg = self.cfg
        sin_BTR, cos_BTR = rotary_sin_cos(positions_BT, cfg.head_dim, cfg.rope_base)
        graphdef, _ = nnx.split(self.blocks if cfg.scan_layers else self.blocks[0])

        def block(state, x_BTD, sin_BTR, cos_BTR, segment_ids_BT, index):
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
            return nnx.merge(graphdef, state)(x_BTD, sin_BTR, cos_BTR, segment_ids_BT, key)

        block = remat_lib.remat(block, cfg.remat, prevent_cse=not cfg.scan_layers)
        rows = x_BTD.shape[0]
        layers = (jax.tree.leaves(nnx.state(self.blocks))[0].shape[0] if cfg.scan_layers
                  else len(self.blocks))           # a stage may hold a slice
        kept = [rows] * layers
        if cfg.stochastic_depth and dropout_key is not None:
            groups = sd_lib.row_groups()
            rates = sd_lib.drop_rates(cfg.stochastic_depth, cfg.n_layers)
            kept = [sd_lib.kept_rows(rows, rates[first_layer + i], groups)
                    for i in range(layers)]

        def layer(state, x_BTD, index, kept_rows, row_args):
            if kept_rows >= rows:
                return block(state, x_BTD, *row_args, index)
            key = jax.random.fold_in(jax.random.fold_in(dropout_key, index), SKIP_KEY)
            return sd_lib.skip_rows(
                lambda x, sin, cos, seg: block(state, x, sin, cos, seg, index), x_BTD,
                row_args, key, kept_rows, sd_lib.row_groups())

        def run(x_BTD, row_args, lo, hi):
            """Layers lo .. hi - 1 (of this stack) on x_BTD, with its tokens' row_args."""
            if not cfg.scan_layers:
                for i in range(lo, hi):
                    x_BTD = layer(nnx.state(self.blocks[i]), x_BTD, first_layer + i, kept[i],
                                  row_args)
                return x_BTD
            stacked = nnx.state(self.blocks)
            start = lo
            while start < hi:                        # one scan per run of equal kept rows
                end = start
                while end < hi and kept[end] == kept[start]:
                    end += 1
                part = jax.tree.map(lambda a: a[start:end], stacked) \
                    if (start, end) != (0, layers) else stacked

                def body(x_BTD, layer_slice, kept_rows=kept[start]):
                    state, index = layer_slice
                    return layer(state, x_BTD, index, kept_rows, row_args), None

                x_BTD, _ = jax.lax.scan(body, x_BTD,
                                        (part, first_layer + jnp.arange(start, end)))
                start = end
            return x_BTD

        span = None if dropout_key is None else td_lib.dropped_span(
            cfg, first_layer, layers, x_BTD.shape[1])
        if span is None:
            masked_BT = segment_ids_BT if segment_attention else None
            return run(x_BTD, (sin_BTR, cos_BTR, masked_BT), 0, layers)
        row_args = (sin_BTR, cos_BTR, segment_ids_BT)
        lo, hi = span
        x_BTD = run(x_BTD, row_args, 0, lo)
        token_loss_V = self.token_drop.token_loss[...] if td_lib.has_buffer(cfg) else None
        x_BTD = td_lib.run_dropped(lambda x, args: run(x, args, lo, hi), x_BTD, row_args,
                                   dropout_key, cfg, targets_BT, token_loss_V)
        return run(x_BTD, row_args, hi, layers)


# Folded into a layer's key for its stochastic-depth rows (its dropout uses the key itself).
SKIP_KEY = 0x5D


def _stack_modules(modules):
    """One module of the same kind whose parameters stack the modules' on a leading axis."""
    graphdef, _ = nnx.split(modules[0])
    states = [nnx.state(m) for m in modules]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def param_axes(params: dict) -> dict:
    """The logical axis names of every parameter (a tree of tuples shaped like ``params``);
    stacked blocks have a leading ``layers`` axis."""

    def axes(path, leaf):
        layer = str(getattr(path[-2], "key", path[-2]))
        names = PARAM_AXES.get(layer)
        if names is None:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no logical axes; add "
                             f"its layer to model.PARAM_AXES")
        leaf_name = str(getattr(path[-1], "key", path[-1]))
        if leaf_name == "fp8_amax":         # [3, HISTORY] amaxes of an fp8 layer, replicated
            names = ("fp8", "fp8_history")
        elif leaf_name == "lora_a":         # [d_in, rank] and [rank, d_out] of a LoRA update
            names = (names[0], "lora")
        elif leaf_name == "lora_b":
            names = ("lora", names[1])
        return ("layers", *names) if leaf.ndim == len(names) + 1 else names

    return jax.tree_util.tree_map_with_path(axes, params)


def init_params(cfg: ModelConfig, key) -> dict:
    """Fresh parameters as a plain nested dict of arrays (blocks stacked with ``scan_layers``),
    initialised by ``cfg.init``'s scheme (``jaxaccel.init``); the same values in both layouts
    for the same key."""
    model = GPT(cfg, rngs=nnx.Rngs(params=key))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = initialize(params, cfg, jax.random.fold_in(key, INIT_KEY))
    return init_masks(params, cfg) if cfg.sparsity != "none" else params


INIT_KEY = 0x1417     # folded into the key for the init scheme's own draws


def make_apply(cfg: ModelConfig, segment_attention: bool = True):
    """``apply(params, batch, dropout_key=None) -> logits [B, T, V]``, a pure function; the key
    is used only when ``cfg.dropout``, ``stochastic_depth`` or token dropping is on (callers may
    always pass one). ``segment_attention=False`` for batches whose rows each hold one segment
    from column 0 (every batching but pack): causal attention without a segment mask, the same
    logits on every real token (``GPT.run_blocks``)."""
    parts = model_parts(cfg, segment_attention)

    def apply(params, batch, dropout_key=None):
        x_BTD = parts.embed(params, batch["inputs"])
        x_BTD = parts.blocks(params, x_BTD, batch, dropout_key)
        return parts.head(params, x_BTD)

    return apply


def sequence_batch(ids_BT):
    """The Batch of whole sequences ``ids_BT`` for ``apply``: one segment per row, positions
    from 0 (what generation and export compare their logits with)."""
    B, T = ids_BT.shape
    return {"inputs": ids_BT, "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
            "segment_ids": jnp.ones((B, T), jnp.int32)}


def make_decode(cfg: ModelConfig):
    """``decode(params, inputs_BT, positions_BT, cache, cache_index=None) -> (logits_BTV,
    cache)``, the pure form of ``GPT.decode`` (prefill without ``cache_index``, a cached step
    with it) for ``jaxaccel.generate``."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))

    def decode(params, inputs_BT, positions_BT, cache, cache_index=None):
        return nnx.merge(graphdef, params).decode(inputs_BT, positions_BT, cache, cache_index)

    return decode


class ModelParts(NamedTuple):
    """The model as three pure functions of the parameter dict, for callers that run its pieces
    apart (``make_apply`` in a row; ``jaxaccel.pipeline`` over stages):

    - ``embed(params, inputs_BT) -> x_BTD``;
    - ``blocks(params, x_BTD, batch, dropout_key=None, first_layer=0) -> x_BTD``: the blocks in
      ``params["blocks"]`` (all of them, or a pipeline stage's slice of the stacked layers whose
      first is layer ``first_layer``), with the batch's positions and segment ids;
    - ``head(params, x_BTD) -> logits_BTV`` in float32.

    Each reads only its own entries of ``params``; the others may be any placeholder arrays.
    """

    embed: Callable
    blocks: Callable
    head: Callable


def model_parts(cfg: ModelConfig, segment_attention: bool = True) -> ModelParts:
    """``segment_attention=False``: the batches' rows each hold one segment from column 0, so
    attention needs no segment mask (``GPT.run_blocks``)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))

    def embed(params, inputs_BT):
        return nnx.merge(graphdef, params).embed_tokens(inputs_BT)

    def blocks(params, x_BTD, batch, dropout_key=None, first_layer=0):
        key = dropout_key if (cfg.dropout > 0 or cfg.stochastic_depth > 0
                              or cfg.token_keep < 1) else None
        targets_BT = batch.get("targets") if td_lib.has_buffer(cfg) else None
        return nnx.merge(graphdef, params).run_blocks(x_BTD, batch["positions"],
                                                      batch["segment_ids"], key, first_layer,
                                                      targets_BT, segment_attention)

    def head(params, x_BTD):
        return nnx.merge(graphdef, params).logits(x_BTD)

    return ModelParts(embed, blocks, head)


def count_params(params) -> int:
    """Weights in ``params``, not counting buffers (``jaxaccel.buffers``)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return sum(x.size for path, x in leaves
               if str(getattr(path[-1], "key", "")) not in buffers_lib.NAMES)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all but the embedding lookup.

    A tied head multiplies by the embedding matrix, so it counts once here.
    """
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    mlp = d * cfg.d_ff * (3 if cfg.mlp == "swiglu" else 2)
    return cfg.n_layers * (attn + mlp) + d * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int, blocks_kept: float = 1.0) -> float:
    """Training FLOPs per token: 6 N for the matmuls plus 12 L d T for attention scores and values.

    N is ``matmul_params``; the attention term is the PaLM accounting (forward 4 L d T, backward
    twice that), counting the full T x T score matrix as implementations without tile skipping do.
    ``blocks_kept`` is the share of the blocks' work done (stochastic depth skips the rest,
    ``jaxaccel.stochastic_depth.kept_fraction``); the output head's is always done. Token
    dropping's layers (``jaxaccel.token_drop``) count the share s = K / T of the tokens they
    compute: s of their matmuls, s^2 of their attention scores and values. With both, the
    product of the two shares (stochastic depth's is an average over the layers).
    """
    head = 6.0 * cfg.d_model * cfg.vocab_size
    blocks = 6.0 * (matmul_params(cfg) - cfg.d_model * cfg.vocab_size) \
        + 12.0 * cfg.n_layers * cfg.d_model * seq_len
    dropped = td_lib.dropped_layers(cfg)
    if dropped:
        share = td_lib.flops_share(cfg, seq_len)
        layer_matmuls = 6.0 * (matmul_params(cfg) - cfg.d_model * cfg.vocab_size) / cfg.n_layers
        blocks -= dropped * (layer_matmuls * (1.0 - share)
                             + 12.0 * cfg.d_model * seq_len * (1.0 - share * share))
    return head + blocks_kept * blocks
