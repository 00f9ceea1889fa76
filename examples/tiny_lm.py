"""A small transformer of one's own: what a model file needs to train with every technique of
jaxaccel (README, "Your own model").

    python -m experiments.train --model examples/tiny_lm.py:make --model-args 'width: 64'

It is plain Flax NNX: a token and a learned position embedding, pre-norm blocks with a fused
q/k/v projection, GELU MLP, a LayerNorm and a linear head. Three things make it jaxaccel's:
its blocks are an ``nn.Stack``, the tensors remat policies keep are tagged (``nn.tag``), and
attention takes the batch's ``segment_ids`` (packed documents stay apart).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.model import nn
from jaxaccel.model.attention import dot_product_attention


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.proj = nnx.Linear(width, width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.fc1 = nnx.Linear(width, 4 * width, rngs=rngs)
        self.fc2 = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x, segment_ids=None):
        B, T, D = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (nn.tag(t.reshape(B, T, self.heads, D // self.heads), name)
                   for t, name in ((q, nn.QUERY), (k, nn.KEY), (v, nn.VALUE)))
        out = dot_product_attention(q, k, v, segment_ids=segment_ids, causal=True)
        x = x + self.proj(nn.tag(out, nn.ATTENTION_OUT).reshape(B, T, D))
        return x + self.fc2(jax.nn.gelu(nn.tag(self.fc1(self.norm2(x)), nn.MLP_IN)))


class TinyLM(nnx.Module):
    def __init__(self, vocab_size: int, max_seq_len: int, *, rngs: nnx.Rngs, width: int = 64,
                 depth: int = 2, heads: int = 4):
        self.tok_emb = nnx.Embed(vocab_size, width, rngs=rngs)
        self.pos_emb = nnx.Embed(max_seq_len, width, rngs=rngs)
        self.blocks = nn.Stack([Block(width, heads, rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab_size, rngs=rngs)

    def __call__(self, inputs, positions=None, segment_ids=None):
        if positions is None:
            positions = jnp.arange(inputs.shape[1])[None]
        x = self.tok_emb(inputs) + self.pos_emb(positions)
        x = self.blocks(x, segment_ids=segment_ids)
        return self.head(self.norm(x))


def make(vocab_size: int, max_seq_len: int, *, rngs: nnx.Rngs, **options) -> TinyLM:
    return TinyLM(vocab_size, max_seq_len, rngs=rngs, **options)
