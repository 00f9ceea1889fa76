"""Stochastic depth (Huang et al. 2016, "Deep Networks with Stochastic Depth"): in training block
l of L (from 1) is skipped for a random subset of the rows at ``p_l = (l / L) * P`` (the linear
decay rule), ``P = model.stochastic_depth``.

With static shapes: block l computes exactly ``kept_rows(B, p_l)`` rows, drawn uniformly without
replacement, and adds their change ``block(x) - x`` scaled by B/k, so the expected output is the
block's (as timm's DropPath's 1/(1-p)); evaluation runs every block. Under a mesh rows are
chosen within each ``data`` x ``fsdp`` shard, so gather and scatter stay on device. ``apply``
installs ``StochasticDepth``, a block transform (a scanned stack runs one ``lax.scan`` per run
of layers with equal counts); layer l's rows come from the step's key folded with l and
``SKIP_KEY``. Pipeline strategies refuse it (it needs static layer indices).
"""

import jax
import jax.numpy as jnp

from jaxaccel.model import nn
from jaxaccel.core.sections import StochasticDepthSettings     # declared without jax
from jaxaccel.core.sharding import constrain, refuse_pipeline

ACTIVATION_AXES = ("batch", "seq", "embed")
SKIP_KEY = 0x5D       # folded into a layer's key for its rows (its dropout uses the key itself)


class StochasticDepth(nn.BlockTransform):
    """Block l computes ``kept_rows(B, l/L x rate)`` of the batch's rows in training."""

    order = 10
    field = "stochastic_depth.rate"

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
        _, stack = nn.the_stack(model, "stochastic depth", "stochastic_depth.rate")
        stack.add(StochasticDepth(settings.rate))


def drop_rates(rate: float, n_layers: int) -> list[float]:
    """The skip rate of each block under the linear rule, the last block's being ``rate``."""
    return [rate * (layer + 1) / n_layers for layer in range(n_layers)]


def row_groups() -> int:
    """How many shards the batch's rows are split into on the mesh in context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    shape = {} if mesh.empty else dict(mesh.shape)
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
    """``block(x_KTD, row_args_K)`` on ``kept`` random rows of ``x_BTD`` (per each of ``groups``
    shards), its change scaled by B / kept; ``row_args``: per-row arrays [B, ...] or None."""
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


def transform(model, cfg, ctx) -> None:
    apply(model, cfg.stochastic_depth)


def report(cfg, ctx) -> dict | None:
    """The rate, and the share of rows the blocks computed at the run's last depth."""
    rate = cfg.stochastic_depth.rate
    if not rate:
        return None
    rows = cfg.batch_rows() // cfg.optimizer.accumulate
    depth = (ctx.run.get("stages") or [[0, None]])[-1][1] or 1
    groups = ctx.mesh_shape["data"] * ctx.mesh_shape["fsdp"]
    return {"rate": rate, "kept": kept_fraction(rate, depth, rows, groups)}


def describe(report: dict) -> str:
    return (f"stochastic depth {report['rate']:g} (blocks compute {report['kept']:.1%} of "
            f"their rows)")
