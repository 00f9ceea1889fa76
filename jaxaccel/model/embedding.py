"""The token embedding lookup, chosen so that its backward pass is fast on GPUs.

A gather's gradient is a scatter-add whose GPU atomics serialise on rows many tokens share (on
an H100 the byte model's scatter took 38 of a 66 ms step, issue 16). Off the CPU, vocabularies
of up to ``ONE_HOT_MAX_VOCAB`` ids are looked up as a matmul with the one-hot ids (backward:
its transpose), 2 * V * D FLOPs per token each way (0.5 MFLOP at V = 320, D = 768; ~0.5 GFLOP
per token for a whole GPT-2 small step), left out of the run's FLOPs like the gather. It equals
the gather exactly (``Precision.HIGHEST``), its gradient the scatter's up to the order of
additions; the vocabulary axis is never sharded. Larger vocabularies (one-hot: 77 MFLOP per
token at V = 50,304) keep the gather with a deterministic backward, ``sorted_segment_sum``.

On a CPU ``auto`` keeps the gather for a float32 table and the sorted sum for a 16-bit one,
whose scatter-add would sum in 16 bits (relative error 2.6e-2 against 1.7e-3).
``python -m experiments.embedding`` measures every method; on this project's 2-core CPU (jax
0.11.2, 2026-11-25; 8 x 1024 byte ids, D = 128, V = 320, forward+backward): float32 0.84 ms
gather, 1.8 sorted sum, 11 one-hot; bfloat16 0.59, 2.2, 109 ms; one-hot 91 to 377 ms at V =
2,048 and 8,192. ``--embedding`` (``model.embedding``) overrides the choice. The 2,048-id
crossover and the sorted sum are unmeasured on a GPU so far.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxaccel.core.sections import (EMBEDDING_METHODS as METHODS,     # declared without jax
                               ONE_HOT_MAX_VOCAB)
from jaxaccel.core.sharding import (COMPUTE_RULES, constrain, einsum, logical_spec, take_rows,
                                    target_device)

SKIP_SCOPE = "jaxaccel_embedding"   # jaxaccel.step.trace leaves it out of the FLOPs


def method(vocab_size: int, on: str | None = None, dtype=jnp.float32) -> str:
    """How ``auto`` embeds ids of this vocabulary from a ``dtype`` table on platform ``on``
    (default: ``sharding.target_device()``'s); see the module docstring."""
    if (on or target_device().platform) == "cpu":
        return "gather" if jnp.finfo(dtype).bits >= 32 else "sorted_sum"
    return "one_hot" if vocab_size <= ONE_HOT_MAX_VOCAB else "sorted_sum"


def lookup(table_VD, ids_BT, out_axes, how: str = "auto"):
    """Rows [B, T, D] of ``table_VD`` for ``ids_BT``, laid out as ``out_axes``. ``how``: one of
    ``METHODS``; ``auto`` is ``method``'s choice, ``gather`` the plain gather (XLA's scatter)."""
    if how not in METHODS:
        raise ValueError(f"unknown embedding method {how!r}; choose from {', '.join(METHODS)}")
    V, out_axes = table_VD.shape[0], tuple(out_axes)
    how = method(V, dtype=table_VD.dtype) if how == "auto" else how
    with jax.named_scope(SKIP_SCOPE):          # a lookup, not a matmul of the model's FLOPs
        if how == "gather":
            return take_rows(table_VD, ids_BT, out_axes)
        if how == "sorted_sum":
            return sorted_sum_lookup(table_VD, ids_BT, out_axes)
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
    if jax.sharding.get_abstract_mesh().empty:
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
    tokens sorted by id, each id's run summed by a segmented scan, each run's total written to
    its id's row (the other slots go to spare rows past V, dropped)."""
    D = g_BTD.shape[-1]
    ids_N = ids_BT.reshape(-1)
    g_ND = g_BTD.reshape(-1, D).astype(jnp.float32)
    order_N = jnp.argsort(ids_N, stable=True)
    ids_N, g_ND = ids_N[order_N], g_ND[order_N]
    starts_N = jnp.concatenate([jnp.ones((1,), bool), ids_N[1:] != ids_N[:-1]])
    ends_N = jnp.concatenate([ids_N[1:] != ids_N[:-1], jnp.ones((1,), bool)])

    def add_within_runs(a, b):
        (start_a, sum_a), (start_b, sum_b) = a, b
        return start_a | start_b, jnp.where(start_b[..., None], sum_b, sum_a + sum_b)

    _, run_ND = jax.lax.associative_scan(add_within_runs, (starts_N, g_ND))
    N = ids_N.shape[0]
    rows_N = jnp.where(ends_N, ids_N, V + jnp.arange(N))     # each slot its own row
    grad_MD = jnp.zeros((V + N, D), jnp.float32).at[rows_N].set(
        run_ND, unique_indices=True, indices_are_sorted=False)
    return grad_MD[:V]
