"""The token embedding lookup, chosen so that its backward pass is fast on GPUs.

The gradient of a gather (``table[ids]``) is a scatter-add of every token's gradient row into
the table. On a GPU its atomic adds serialise on the rows that many tokens share, and real text
is skewed (spaces, 'e', newlines): on an H100 the byte model's scatter took 38 of a 66 ms step
(issue 16). For a vocabulary of up to ``ONE_HOT_MAX_VOCAB`` ids the lookup is therefore a
matmul of the one-hot ids with the table, and its backward the matmul of the one-hot's transpose
with the gradient: tensor-core work whatever the id distribution, at 2 * V * D FLOPs per token
each way (0.5 MFLOP at V = 320, D = 768, against ~0.5 GFLOP per token for GPT-2 small's whole
training step). Like the gather, it is left out of ``model.flops_per_token`` (MFU counts the
blocks' and the head's matmuls).

The forward values equal the gather's exactly: each output is one table row times 1 plus zeros,
computed at ``Precision.HIGHEST`` so that no TF32 or bf16 pass rounds a float32 table. The
table's gradient equals the scatter's up to the order of the float additions. The vocabulary
axis is never sharded (``sharding.PARAM_RULES``), so under every strategy the matmul contracts
a whole axis on each device, as a Dense layer's input does.

Larger vocabularies keep the gather (``sharding.take_rows``); a sorted segment-sum backward for
them is not built yet (the byte vocabulary is the only one before subword tokenizers).
"""

import jax
import jax.numpy as jnp

from jaxaccel.sharding import einsum, take_rows

ONE_HOT_MAX_VOCAB = 2048


def method(vocab_size: int) -> str:
    """``one_hot`` or ``gather``: how ``lookup`` embeds ids of a vocabulary this size."""
    return "one_hot" if vocab_size <= ONE_HOT_MAX_VOCAB else "gather"


def lookup(table_VD, ids_BT, out_axes):
    """Rows [B, T, D] of ``table_VD`` for ``ids_BT``, laid out as ``out_axes`` (module
    docstring)."""
    V = table_VD.shape[0]
    if method(V) == "gather":
        return take_rows(table_VD, ids_BT, out_axes)
    one_hot_BTV = jax.nn.one_hot(ids_BT, V, dtype=table_VD.dtype)
    return einsum("btv,vd->btd", one_hot_BTV, table_VD, out_axes,
                  precision=jax.lax.Precision.HIGHEST).astype(table_VD.dtype)


def gather_lookup(table_VD, ids_BT):
    """The plain gather, the reference ``lookup`` is tested against."""
    return jnp.take(table_VD, ids_BT, axis=0)
