"""A small NNX language model that is not jaxaccel's GPT, written as a user would from the README:
token and learned position embeddings (``tok_emb``, ``pos_emb``), pre-norm blocks with a fused
q/k/v ``nnx.Linear``, ``nnx.LayerNorm``, a GELU MLP, ``nnx.Dropout`` on both residual branches,
and a linear head. The contract tests (``tests/test_any_model.py``) train it with every technique.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.model import nn
from jaxaccel.model.attention import dot_product_attention


class Block(nnx.Module):
    def __init__(self, width, heads, dropout, rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.out = nnx.Linear(width, width, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x, segment_ids=None):
        B, T, D = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (nn.tag(t.reshape(B, T, self.heads, D // self.heads), name)
                   for t, name in ((q, nn.QUERY), (k, nn.KEY), (v, nn.VALUE)))
        attn = dot_product_attention(q, k, v, segment_ids=segment_ids, causal=True)
        x = x + self.drop(self.out(nn.tag(attn, nn.ATTENTION_OUT).reshape(B, T, D)))
        return x + self.drop(self.down(jax.nn.gelu(nn.tag(self.up(self.ln2(x)), nn.MLP_IN))))


class ForeignLM(nnx.Module):
    def __init__(self, vocab_size, max_seq_len, *, rngs, width=32, depth=2, heads=2,
                 dropout=0.0):
        self.tok_emb = nnx.Embed(vocab_size, width, rngs=rngs)
        self.pos_emb = nnx.Embed(max_seq_len, width, rngs=rngs)
        self.layers = nn.Stack([Block(width, heads, dropout, rngs) for _ in range(depth)])
        self.ln_f = nnx.LayerNorm(width, rngs=rngs)
        self.lm_head = nnx.Linear(width, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, inputs, positions=None, segment_ids=None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        x = self.tok_emb(inputs) + self.pos_emb(positions)
        return self.lm_head(self.ln_f(self.layers(x, segment_ids=segment_ids)))


def make(vocab_size, max_seq_len, *, rngs, **options):
    return ForeignLM(vocab_size, max_seq_len, rngs=rngs, **options)


class NoStack(nnx.Module):
    """A model whose blocks are a plain list: block techniques cannot act on it."""

    def __init__(self, vocab_size, max_seq_len, *, rngs):
        self.emb = nnx.Embed(vocab_size, 16, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(16, vocab_size, rngs=rngs)

    def __call__(self, inputs, positions=None, segment_ids=None):
        x = self.emb(inputs)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make_no_stack(vocab_size, max_seq_len, *, rngs):
    return NoStack(vocab_size, max_seq_len, rngs=rngs)
