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

It acts on any model whose blocks are an ``nn.Stack``: ``apply`` installs ``StochasticDepth``,
a block transform whose static choice per layer is its kept rows (a scanned stack runs one
``lax.scan`` per run of layers with equal counts). Layer l's rows are drawn from the step's key
folded with l and ``SKIP_KEY``. It needs static layer indices, so pipeline strategies refuse it.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxaccel import nn
from jaxaccel.settings import setting
from jaxaccel.sharding import constrain, refuse_pipeline

ACTIVATION_AXES = ("batch", "seq", "embed")
SKIP_KEY = 0x5D       # folded into a layer's key for its rows (its dropout uses the key itself)


@dataclasses.dataclass
class StochasticDepthSettings:
    rate: float = setting(0.0, "stochastic depth: the last block's skip rate P, block l of L "
                               "skipped at l/L*P for a random set of rows, which it does not "
                               "compute (0 = off)", flag="stochastic_depth", at_least=0, below=1)


class StochasticDepth(nn.BlockTransform):
    """Block l computes ``kept_rows(B, l/L x rate)`` of the batch's rows in training."""

    order = 10

    def __init__(self, rate: float):
        self.rate = rate

    def variant(self, layer: int, total: int, rows: int, training: bool):
        if not training:
            return rows
        return kept_rows(rows, drop_rates(self.rate, total)[layer], row_groups())

    def wrap(self, fn, kept, scanned: bool):
        def skipping(state, x, token_args, index):
            if kept >= x.shape[0]:
                return fn(state, x, token_args, index)
            key = jax.random.fold_in(jax.random.fold_in(nn.current().key, index), SKIP_KEY)
            return skip_rows(lambda x, args: fn(state, x, args, index), x, token_args, key,
                             kept, row_groups())
        return skipping


def check(cfg) -> None:
    """What stochastic depth cannot combine with: pipeline stages (static layer indices)."""
    if cfg.stochastic_depth.rate > 0:
        refuse_pipeline(cfg.mesh.strategy, "stochastic depth", "stochastic_depth.rate")


def apply(model, settings: StochasticDepthSettings) -> None:
    if settings.rate > 0:
        nn.the_stack(model, "stochastic depth", "stochastic_depth.rate")[1].add(StochasticDepth(settings.rate))


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


def skip_rows(block, x_BTD, row_args: dict, key, kept: int, groups: int):
    """``block(x_KTD, row_args_K)`` on ``kept`` randomly chosen rows of ``x_BTD`` (chosen in each
    of ``groups`` shards of the rows), the others passed through; the kept rows' change is scaled
    by rows / kept. ``row_args`` are per-row arrays [B, ...] or None, by name."""
    B = x_BTD.shape[0]
    if kept >= B:
        return block(x_BTD, row_args)
    shard, per_group = B // groups, kept // groups
    scores_GS = jax.random.uniform(key, (groups, shard))
    rows_GK = jnp.sort(jnp.argsort(scores_GS, axis=1)[:, :per_group], axis=1)
    group_G1 = jnp.arange(groups)[:, None]

    def take(a):
        a_GS = a.reshape(groups, shard, *a.shape[1:])
        return a_GS[group_G1, rows_GK].reshape(kept, *a.shape[1:])

    x_KTD = constrain(take(x_BTD), ACTIVATION_AXES)
    y_KTD = block(x_KTD, {k: None if a is None else take(a) for k, a in row_args.items()})
    delta_KTD = ((y_KTD - x_KTD) * (B / kept)).astype(x_BTD.dtype)
    x_GSTD = x_BTD.reshape(groups, shard, *x_BTD.shape[1:])
    x_GSTD = x_GSTD.at[group_G1, rows_GK].add(delta_KTD.reshape(groups, per_group,
                                                                 *x_BTD.shape[1:]))
    return constrain(x_GSTD.reshape(x_BTD.shape), ACTIVATION_AXES)
