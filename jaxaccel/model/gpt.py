"""jaxaccel's GPT, a decoder-only transformer in Flax NNX: rotary position embeddings from the
batch's ``positions``, pre-norm RMSNorm blocks, grouped-query attention, a SwiGLU or GELU MLP, a
tied or untied head. It computes in its variables' dtype (norms, rotary angles, softmax and logits
in float32), follows the ``jaxaccel.model.nn`` contract with no technique in it, and carries logical
axes (``out_sharding``, ``sharding.LogicalDot``) so the mesh alone makes it data parallel, FSDP
or tensor parallel. ``make`` is its factory (``--model tiny|small|medium|gpt2``).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.model import embedding, nn
from jaxaccel.model.attention import dot_product_attention
# The shape, presets and gpt section, declared without jax (sections); re-exported as gpt's own.
from jaxaccel.core.sections import (MLP_KINDS, PRESET_TOKENIZERS, PRESETS, GPTConfig, GPTSettings,
                                    default_d_ff, preset)
from jaxaccel.core.sharding import LogicalDot, check_divides, constrain

ACTIVATION_AXES = ("batch", "seq", "embed")
Q_AXES = ("batch", "seq", "heads", "head_dim")
KV_AXES = ("batch", "seq", "kv_heads", "head_dim")
# Short names of the GPT's linear layers, for the layer techniques' --*-targets.
ALIASES = {"q": "attn/wq", "k": "attn/wk", "v": "attn/wv", "o": "attn/wo", "in": "mlp/w_in",
           "gate": "mlp/w_gate", "out": "mlp/w_out"}


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

    aliases = ALIASES          # short names of its linear layers (jaxaccel.techniques.surgery)
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

    # -- generation with a key/value cache (jaxaccel.outputs.generate)
    # -------------------------------

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
