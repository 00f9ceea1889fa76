"""jaxaccel's GPT, a decoder-only transformer in Flax NNX: rotary position embeddings from the
batch's ``positions``, pre-norm RMSNorm blocks, grouped-query attention, a SwiGLU or GELU MLP, a
tied or untied head. It computes in its variables' dtype (norms, rotary angles, softmax and logits
in float32), follows the ``jaxaccel.nn`` contract with no technique in it, and carries logical
axes (``out_sharding``, ``sharding.LogicalDot``) so the mesh alone makes it data parallel, FSDP
or tensor parallel. ``make`` is its factory (``--model tiny|small|medium|gpt2``).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel import embedding, nn
from jaxaccel.attention import IMPLEMENTATIONS, dot_product_attention
from jaxaccel.errors import ConfigError
from jaxaccel.settings import setting
from jaxaccel.sharding import LogicalDot, check_divides, constrain
from jaxaccel.tokenizer import ByteTokenizer

MLP_KINDS = ("swiglu", "gelu")
ACTIVATION_AXES = ("batch", "seq", "embed")
Q_AXES = ("batch", "seq", "heads", "head_dim")
KV_AXES = ("batch", "seq", "kv_heads", "head_dim")
# Short names of the GPT's linear layers, for the layer techniques' --*-targets.
ALIASES = {"q": "attn/wq", "k": "attn/wk", "v": "attn/wv", "o": "attn/wo", "in": "mlp/w_in",
           "gate": "mlp/w_gate", "out": "mlp/w_out"}


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
                                     ("attention", self.attention, IMPLEMENTATIONS),
                                     ("embedding", self.embedding, embedding.METHODS)):
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
        choices=IMPLEMENTATIONS)
    embedding: str | None = setting(
        None, "token embedding lookup: auto (on GPUs one_hot up to "
              f"{embedding.ONE_HOT_MAX_VOCAB} ids, else sorted_sum; on a CPU gather for a float32 "
              "table, sorted_sum for a 16-bit one), one_hot, sorted_sum or gather; see "
              "experiments.embedding", choices=embedding.METHODS)


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


def make(vocab_size: int, max_seq_len: int, *, rngs: nnx.Rngs, preset_name: str = "tiny",
         **overrides) -> "GPT":
    """``--model <preset>``'s factory: the preset's GPT with ``overrides`` (GPTConfig fields)."""
    return GPT(preset(preset_name, vocab_size=vocab_size, max_seq_len=max_seq_len, **overrides),
               rngs=rngs)


def linear(d_in: int, d_out: int, std: float, axes: tuple, rngs) -> nnx.Linear:
    """``x @ kernel``, no bias, the kernel N(0, std) and laid out by its logical ``axes``."""
    return nnx.Linear(d_in, d_out, use_bias=False, rngs=rngs, dot_general=LogicalDot(axes),
                      kernel_init=nnx.initializers.normal(stddev=std),
                      kernel_metadata={"out_sharding": axes, "eager_sharding": False})


def rms_norm(d_model: int, rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(d_model, rngs=rngs,
                       scale_metadata={"out_sharding": ("norm",), "eager_sharding": False})


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


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.head_dim
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.wq = linear(d, cfg.n_heads * hd, 0.02, ("embed", "heads"), rngs)
        self.wk = linear(d, cfg.n_kv_heads * hd, 0.02, ("embed", "kv_heads"), rngs)
        self.wv = linear(d, cfg.n_kv_heads * hd, 0.02, ("embed", "kv_heads"), rngs)
        self.wo = linear(cfg.n_heads * hd, d, out_std, ("heads", "embed"), rngs)

    def __call__(self, x_BTD, sin_BTR, cos_BTR, segment_ids_BT, cache=None, cache_index=None):
        """With ``cache`` = (k_BSKE, v_BSKE), also the cache with this call's keys and values
        written at ``cache_index`` (attending to that + T slots) or, the prefill, at 0."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        check_divides(cfg.n_heads, "heads", "n_heads", "gpt.n_heads")
        check_divides(cfg.n_kv_heads, "kv_heads", "n_kv_heads", "gpt.n_kv_heads")
        q_BTHE = constrain(self.wq(x_BTD).reshape(B, T, cfg.n_heads, cfg.head_dim), Q_AXES)
        k_BTKE = constrain(self.wk(x_BTD).reshape(B, T, cfg.n_kv_heads, cfg.head_dim), KV_AXES)
        v_BTKE = constrain(self.wv(x_BTD).reshape(B, T, cfg.n_kv_heads, cfg.head_dim), KV_AXES)
        q_BTHE = nn.tag(apply_rotary(q_BTHE, sin_BTR, cos_BTR), nn.QUERY)
        k_BTKE = nn.tag(apply_rotary(k_BTKE, sin_BTR, cos_BTR), nn.KEY)
        v_BTKE = nn.tag(v_BTKE, nn.VALUE)
        if cache is not None:
            start = 0 if cache_index is None else cache_index
            cache = tuple(jax.lax.dynamic_update_slice(c_BSKE, x_BTKE.astype(c_BSKE.dtype),
                                                       (0, start, 0, 0))
                          for c_BSKE, x_BTKE in zip(cache, (k_BTKE, v_BTKE)))
        if cache is not None and cache_index is not None:
            out_BTHE = cached_attention(q_BTHE, *cache, cache_index)
        else:
            out_BTHE = dot_product_attention(q_BTHE, k_BTKE, v_BTKE, segment_ids=segment_ids_BT,
                                             causal=True, implementation=cfg.attention)
        out_BTHE = nn.tag(out_BTHE, nn.ATTENTION_OUT)
        out_BTD = self.wo(out_BTHE.reshape(B, T, cfg.n_heads * cfg.head_dim))
        return out_BTD if cache is None else (out_BTD, cache)


def cached_attention(q_BTHE, k_BSKE, v_BSKE, index):
    """T queries at positions ``index`` .. ``index`` + T - 1 over the first ``index`` + T of a
    key/value cache's S slots, with ``xla_attention``'s arithmetic (float32 softmax)."""
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
    """SwiGLU (silu(x W_gate) * x W_in) W_out, or GELU(x W_in) W_out."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.kind = cfg.mlp
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.w_in = linear(cfg.d_model, cfg.d_ff, 0.02, ("embed", "mlp"), rngs)
        if cfg.mlp == "swiglu":
            self.w_gate = linear(cfg.d_model, cfg.d_ff, 0.02, ("embed", "mlp"), rngs)
        self.w_out = linear(cfg.d_ff, cfg.d_model, out_std, ("mlp", "embed"), rngs)

    def __call__(self, x_BTD):
        in_BTF = nn.tag(self.w_in(x_BTD), nn.MLP_IN)
        if self.kind == "swiglu":
            h_BTF = jax.nn.silu(nn.tag(self.w_gate(x_BTD), nn.MLP_GATE)) * in_BTF
        else:
            h_BTF = jax.nn.gelu(in_BTF)
        return self.w_out(h_BTF)


class Block(nnx.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); residual dropout keyed by ``nn.layer_key``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.dropout = cfg.dropout
        self.attn_norm = rms_norm(cfg.d_model, rngs)
        self.mlp_norm = rms_norm(cfg.d_model, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def _drop(self, x, key):
        if key is None or self.dropout == 0.0:
            return x
        keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
        return jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)

    def __call__(self, x_BTD, sin=None, cos=None, segment_ids=None, cache=None,
                 cache_index=None):
        """The block's output; with a key/value ``cache`` (``Attention``), also the new cache."""
        key = nn.layer_key()
        keys = (None, None) if key is None else jax.random.split(key)
        h_BTD = self.attn(self.attn_norm(x_BTD), sin, cos, segment_ids, cache, cache_index)
        if cache is not None:
            h_BTD, cache = h_BTD
        x_BTD = x_BTD + self._drop(h_BTD, keys[0])
        x_BTD = x_BTD + self._drop(self.mlp(self.mlp_norm(x_BTD)), keys[1])
        return x_BTD if cache is None else (x_BTD, cache)


class GPT(nnx.Module):
    """Decoder-only transformer: ids [B, T] -> float32 logits [B, T, vocab_size]."""

    aliases = ALIASES          # short names of its linear layers (jaxaccel.surgery)
    # The layers each layer technique targets unless told otherwise.
    defaults = {"lora": "q,v", "adapters": "o,out", "gates": "o,out", "tfixup": "v,o,in,gate,out"}

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs,
                               embedding_init=nnx.initializers.normal(stddev=0.02),
                               embedding_metadata={"out_sharding": ("vocab", "embed"),
                                                   "eager_sharding": False})
        self.blocks = nn.Stack([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = rms_norm(cfg.d_model, rngs)
        if not cfg.tie_embeddings:
            self.head = linear(cfg.d_model, cfg.vocab_size, 0.02, ("embed", "vocab"), rngs)

    def __call__(self, inputs_BT, positions=None, segment_ids=None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(inputs_BT.shape[1], dtype=jnp.int32),
                                         inputs_BT.shape)
        sin_BTR, cos_BTR = rotary_sin_cos(positions, self.cfg.head_dim, self.cfg.rope_base)
        x_BTD = self.embed_tokens(inputs_BT)
        x_BTD = self.blocks(x_BTD, sin=sin_BTR, cos=cos_BTR, segment_ids=segment_ids)
        return self.logits(x_BTD)

    def embed_tokens(self, inputs_BT):
        """The token embeddings [B, T, D] in the table's dtype (the policy's compute dtype)."""
        table_VD = constrain(self.embed.embedding[...], ("vocab", "embed"))
        return embedding.lookup(table_VD, inputs_BT, ACTIVATION_AXES, self.cfg.embedding)

    def logits(self, x_BTD):
        """The final norm and the output head: float32 logits [B, T, V]."""
        x_BTD = self.final_norm(x_BTD)
        if self.cfg.tie_embeddings:
            table_VD = constrain(self.embed.embedding[...], ("vocab", "embed"))
            logits_BTV = jnp.einsum("btd,vd->btv", x_BTD, table_VD)
        else:
            logits_BTV = self.head(x_BTD)
        return logits_BTV.astype(jnp.float32)

    # -- generation with a key/value cache (jaxaccel.generate) -------------------------------

    def init_cache(self, batch: int, length: int, dtype=jnp.float32):
        """An empty key/value cache of ``length`` slots: two [L, B, S, K, E] arrays (K kv heads)."""
        cfg = self.cfg
        zeros = jnp.zeros((len(self.blocks), batch, length, cfg.n_kv_heads, cfg.head_dim), dtype)
        return zeros, zeros

    def decode(self, inputs_BT, positions_BT, cache, cache_index=None):
        """Logits [B, T, V] of ``inputs_BT`` (a document per row) and the cache with their keys
        and values written in: at 0 (the prefill) or at ``cache_index`` (``Attention``)."""
        sin_BTR, cos_BTR = rotary_sin_cos(positions_BT, self.cfg.head_dim, self.cfg.rope_base)
        segment_ids_BT = jnp.ones_like(inputs_BT)
        x_BTD = self.embed_tokens(inputs_BT)

        def layer(block, x_BTD, kv):
            return block(x_BTD, sin_BTR, cos_BTR, segment_ids_BT, kv, cache_index)

        x_BTD, cache = self.blocks.map(layer, x_BTD, cache)
        return self.logits(x_BTD), cache
