"""The token embedding lookup, chosen so that its backward pass is fast on GPUs.

The gradient of a gather (``table[ids]``) is a scatter-add of every token's gradient row into
the table. On a GPU its atomic adds serialise on the rows that many tokens share, and real text
is skewed (spaces, 'e', newlines): on an H100 the byte model's scatter took 38 of a 66 ms step
(issue 16). On a GPU (and any accelerator) a vocabulary of up to ``ONE_HOT_MAX_VOCAB`` ids is
therefore looked up as a
matmul of the one-hot ids with the table, and its backward the matmul of the one-hot's transpose
with the gradient: tensor-core work whatever the id distribution, at 2 * V * D FLOPs per token
each way (0.5 MFLOP at V = 320, D = 768, against ~0.5 GFLOP per token for GPT-2 small's whole
training step). Like the gather, it is left out of the run's FLOPs (``jaxaccel.trace``: MFU
counts the blocks' and the head's matmuls).

The forward values equal the gather's exactly: each output is one table row times 1 plus zeros,
computed at ``Precision.HIGHEST`` so that no TF32 or bf16 pass rounds a float32 table. The
table's gradient equals the scatter's up to the order of the float additions. The vocabulary
axis is never sharded (``sharding.PARAM_RULES``), so under every strategy the matmul contracts
a whole axis on each device, as a Dense layer's input does.

Larger vocabularies keep the gather forward (``sharding.take_rows``; a one-hot would cost 2 * V
* D FLOPs per token, 77 MFLOP at V = 50,304) with a backward that never adds two tokens' rows
into one table row at once (``sorted_segment_sum``): each device sorts its tokens by id, sums
each id's run of gradient rows with a segmented scan (a tree of additions in float32, no atomics)
and writes every id's sum once, into distinct rows; a psum over the batch's mesh axes then adds
the devices' tables, as the gather's own gradient would. It is deterministic.

On a CPU ``auto`` keeps the plain gather for a float32 table: there the scatter-add runs on one
core with no collisions to serialise, and the alternatives only add work. A bfloat16 or float16
table gets the sorted sum instead, whose float32 sums round once: the scatter-add sums in the
table's dtype (a relative error of 2.6e-2 against 1.7e-3 below). Measured with
``python -m experiments.embedding`` on this project's 2-core CPU (jax 0.11.2, 2026-11-25), 8 x
1024 byte ids of the stdlib, D = 128, V = 320, forward+backward: float32 0.84 ms for the gather,
1.8 ms for the sorted sum, 11 ms for the one-hot; bfloat16 0.59, 2.2 and 109 ms (the CPU
multiplies bfloat16 slowly). At V = 2,048 and 8,192 the one-hot took 91 to 377 ms.

Which method is fastest where is measured by ``python -m experiments.embedding`` (each method's
forward+backward per vocabulary size and id distribution, with its error against a float64
scatter); ``--embedding`` (``model.embedding``) overrides the choice in a training run, for
example ``gather`` to see the scatter in ``--profile``. The 2,048-id crossover and the sorted sum
are unmeasured on a GPU so far.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxaccel.sharding import (COMPUTE_RULES, constrain, einsum, logical_spec, take_rows,
                               target_device)

ONE_HOT_MAX_VOCAB = 2048
SKIP_SCOPE = "jaxaccel_embedding"   # jaxaccel.trace leaves it out of the FLOPs
METHODS = ("auto", "one_hot", "sorted_sum", "gather")


def method(vocab_size: int, on: str | None = None, dtype=jnp.float32) -> str:
    """How ``auto`` embeds ids of a vocabulary this size from a table of ``dtype`` on platform
    ``on`` (default: ``sharding.target_device()``'s). On a CPU, where the scatter's adds run one
    after another and the gather was the fastest at every shape measured (module docstring):
    ``gather`` for a float32 table, ``sorted_sum`` for a 16-bit one (the scatter-add would sum
    in 16 bits). Elsewhere ``one_hot`` up to ``ONE_HOT_MAX_VOCAB`` ids, else ``sorted_sum``."""
    if (on or target_device().platform) == "cpu":
        return "gather" if jnp.finfo(dtype).bits >= 32 else "sorted_sum"
    return "one_hot" if vocab_size <= ONE_HOT_MAX_VOCAB else "sorted_sum"


def lookup(table_VD, ids_BT, out_axes, how: str = "auto"):
    """Rows [B, T, D] of ``table_VD`` for ``ids_BT``, laid out as ``out_axes`` (module
    docstring). ``how``: one of ``METHODS``; ``auto`` is ``method`` of the table's size and
    dtype, ``gather`` the plain gather whose backward is XLA's scatter (to measure the others
    against)."""
    if how not in METHODS:
        raise ValueError(f"unknown embedding method {how!r}; choose from {', '.join(METHODS)}")
    V = table_VD.shape[0]
    how = method(V, dtype=table_VD.dtype) if how == "auto" else how
    with jax.named_scope(SKIP_SCOPE):          # a lookup, not a matmul of the model's FLOPs
        return _lookup(table_VD, ids_BT, tuple(out_axes), how, V)


def _lookup(table_VD, ids_BT, out_axes, how, V):
    if how == "gather":
        return take_rows(table_VD, ids_BT, tuple(out_axes))
    if how == "sorted_sum":
        return sorted_sum_lookup(table_VD, ids_BT, tuple(out_axes))
    one_hot_BTV = jax.nn.one_hot(ids_BT, V, dtype=table_VD.dtype)
    return einsum("btv,vd->btd", one_hot_BTV, table_VD, out_axes,
                  precision=jax.lax.Precision.HIGHEST).astype(table_VD.dtype)


def gather_lookup(table_VD, ids_BT):
    """The plain gather, the reference ``lookup`` is tested against."""
    return jnp.take(table_VD, ids_BT, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def sorted_sum_lookup(table_VD, ids_BT, out_axes):
    """The gather ``table_VD[ids_BT]`` (laid out as ``out_axes``) whose table gradient is
    ``sorted_segment_sum``'s, per device and summed over the batch's mesh axes."""
    return take_rows(table_VD, ids_BT, out_axes)


def _lookup_forward(table_VD, ids_BT, out_axes):
    # the table (a parameter, alive for the update anyway) gives the gradient's shape and dtype
    return take_rows(table_VD, ids_BT, out_axes), (ids_BT, table_VD)


def _lookup_backward(out_axes, residuals, g_BTD):
    ids_BT, table_VD = residuals
    V = table_VD.shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        grad_VD = sorted_segment_sum(ids_BT, g_BTD, V)
    else:
        g_spec = logical_spec(out_axes, COMPUTE_RULES)
        summed = tuple(axis for part in g_spec[:2] if part is not None
                       for axis in ((part,) if isinstance(part, str) else part))

        def local(ids_BT, g_BTD):
            grad_VD = sorted_segment_sum(ids_BT, g_BTD, V)
            return jax.lax.psum(grad_VD, summed) if summed else grad_VD

        # The ids may come replicated (under Explicit axes shard_map takes them only as its
        # in_specs say), so both are laid out as the forward's output first.
        grad_VD = jax.shard_map(local, in_specs=(PartitionSpec(*g_spec[:2]), g_spec),
                                out_specs=PartitionSpec(None, g_spec[2]), check_vma=False)(
            constrain(ids_BT, out_axes[:2]), constrain(g_BTD, out_axes))
    return grad_VD.astype(table_VD.dtype), None


sorted_sum_lookup.defvjp(_lookup_forward, _lookup_backward)


def sorted_segment_sum(ids_BT, g_BTD, V: int):
    """``zeros([V, D]).at[ids].add(g)`` in float32 without two additions into one row at once:
    the tokens sorted by id, each id's run of rows summed by a segmented inclusive scan, each
    run's total written to its id's row (distinct rows; the slots of absent ids are spare rows
    past V, dropped)."""
    D = g_BTD.shape[-1]
    ids_N = ids_BT.reshape(-1)
    g_ND = g_BTD.reshape(-1, D).astype(jnp.float32)
    order_N = jnp.argsort(ids_N, stable=True)
    ids_N, g_ND = ids_N[order_N], g_ND[order_N]
    starts_N = jnp.concatenate([jnp.ones((1,), bool), ids_N[1:] != ids_N[:-1]])
    ends_N = jnp.concatenate([ids_N[1:] != ids_N[:-1], jnp.ones((1,), bool)])

    def add_within_runs(a, b):
        start_a, sum_a = a
        start_b, sum_b = b
        return start_a | start_b, jnp.where(start_b[..., None], sum_b, sum_a + sum_b)

    _, run_ND = jax.lax.associative_scan(add_within_runs, (starts_N, g_ND))
    N = ids_N.shape[0]
    rows_N = jnp.where(ends_N, ids_N, V + jnp.arange(N))     # each slot its own row
    grad_MD = jnp.zeros((V + N, D), jnp.float32).at[rows_N].set(
        run_ND, unique_indices=True, indices_are_sorted=False)
    return grad_MD[:V]
