"""Stochastic depth (Huang et al. 2016, "Deep Networks with Stochastic Depth"): during training
each residual block is skipped, for a random subset of the batch's rows, with a rate that grows
linearly over depth (the paper's linear decay rule): block l of L (counting from 1) is skipped
with rate ``p_l = (l / L) * P``, where ``P = model.stochastic_depth`` is the last block's rate.

Skipping saves compute only if the skipped rows are not computed. With per-row coin flips the
number of kept rows would change every step and so would every shape; here block l keeps exactly
``kept_rows(B, p_l)`` rows, drawn uniformly without replacement (each row is kept with
probability k/B, so every example is still skipped independently of its content). The kept rows
are gathered, run through the block, and their change ``block(x) - x`` is scattered back scaled
by B/k, so that the expected output in training equals the block's output (what timm's DropPath
does with 1/(1-p)), and evaluation simply runs every block: the identity of stochastic depth at
test time. The shapes are static, so nothing recompiles.

Under a mesh the batch's rows are split over ``data`` x ``fsdp``; the rows are chosen within
each shard (the same count in each), so the gather and scatter stay on their devices.
"""

import jax
import jax.numpy as jnp

from jaxaccel.sharding import constrain

ACTIVATION_AXES = ("batch", "seq", "embed")


def drop_rates(rate: float, n_layers: int) -> list[float]:
    """The skip rate of each block under the linear rule, the last block's being ``rate``."""
    return [rate * (layer + 1) / n_layers for layer in range(n_layers)]


def row_groups() -> int:
    """How many shards the batch's rows are split into on the mesh in context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    shape = dict(mesh.shape)
    return shape.get("data", 1) * shape.get("fsdp", 1)


def kept_rows(rows: int, rate: float, groups: int = 1) -> int:
    """Rows a block skipped at ``rate`` computes: in each of ``groups`` equal shards of the rows,
    the shard's rows minus ``round(rate * shard)``, at least one."""
    shard = rows // groups
    return groups * max(1, shard - round(rate * shard))


def kept_fraction(rate: float, n_layers: int, rows: int, groups: int = 1) -> float:
    """The share of block computation stochastic depth keeps, over all blocks, at ``rows``."""
    if rate == 0:
        return 1.0
    kept = [kept_rows(rows, p, groups) for p in drop_rates(rate, n_layers)]
    return sum(kept) / (rows * n_layers)


def skip_rows(block, x_BTD, row_args, key, kept: int, groups: int):
    """``block(x_KTD, *row_args_K)`` on ``kept`` randomly chosen rows of ``x_BTD`` (chosen in each
    of ``groups`` shards of the rows), the others passed through; the kept rows' change is scaled
    by rows / kept. ``row_args`` are per-row arrays [B, ...] (positions' sines, segment ids)."""
    B = x_BTD.shape[0]
    if kept >= B:
        return block(x_BTD, *row_args)
    shard, per_group = B // groups, kept // groups
    scores_GS = jax.random.uniform(key, (groups, shard))
    rows_GK = jnp.sort(jnp.argsort(scores_GS, axis=1)[:, :per_group], axis=1)
    group_G1 = jnp.arange(groups)[:, None]

    def take(a):
        a_GS = a.reshape(groups, shard, *a.shape[1:])
        return a_GS[group_G1, rows_GK].reshape(kept, *a.shape[1:])

    x_KTD = constrain(take(x_BTD), ACTIVATION_AXES)
    y_KTD = block(x_KTD, *(None if a is None else take(a) for a in row_args))
    delta_KTD = ((y_KTD - x_KTD) * (B / kept)).astype(x_BTD.dtype)
    x_GSTD = x_BTD.reshape(groups, shard, *x_BTD.shape[1:])
    x_GSTD = x_GSTD.at[group_G1, rows_GK].add(delta_KTD.reshape(groups, per_group,
                                                                 *x_BTD.shape[1:]))
    return constrain(x_GSTD.reshape(x_BTD.shape), ACTIVATION_AXES)
