"""Optimizers by name, with the defaults that large-batch transformer training needs.

``make_optimizer(name, ...)`` returns an ``optax.GradientTransformation`` (``adamw``, ``lion``,
``lamb``, ``lars``, ``sgd``, ``adafactor``) around optax's update rules, with weight decay and
LAMB/LARS trust ratios only on weight matrices (``decay_mask``: by rank, type and metadata, no
name but flax's for an ``nnx.Embed`` table), one schedule family (``make_schedule``),
global-norm clipping and optional bfloat16 state. In ``DEFAULTS`` Lion's are AdamW's with lr 10x
smaller and weight decay 10x larger (its authors advise 3-10x; lr * weight decay stays AdamW's);
LAMB's, LARS's and SGD's are the best of a short sweep on the tiny model (BENCHMARKS.md).
"""

import math
import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sharding import EMBED_TABLE
# The optimizers and their DEFAULTS, the schedules and scalings, declared without jax.
from jaxaccel.core.sections import DEFAULTS, LR_SCALING, OPTIMIZERS, SCHEDULES


def make_schedule(name: str, learning_rate: float, *, warmup_steps: int, total_steps: int,
                  final_fraction: float = 0.1):
    """``schedule(step) -> learning rate``: linear warmup from 0, then ``constant`` (the peak),
    ``cosine`` or ``linear`` decay to ``final_fraction`` of it at ``total_steps``, or ``rsqrt``
    (``peak * sqrt(warmup / step)``)."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}",
                          field="optimizer.schedule")
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    decay_steps = max(total_steps - warmup_steps, 1)
    if name == "constant":
        after = optax.constant_schedule(learning_rate)
    elif name == "cosine":
        after = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=final_fraction)
    elif name == "linear":
        after = optax.linear_schedule(learning_rate, learning_rate * final_fraction, decay_steps)
    else:
        offset = max(warmup_steps, 1)
        after = lambda step: learning_rate * jax.lax.rsqrt((step + offset) / offset)  # noqa: E731
    if warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, after], [warmup_steps])


def scale_learning_rate(learning_rate: float, rule: str, batch_size: float,
                        base_batch_size: float) -> float:
    """The learning rate for ``batch_size`` given one tuned at ``base_batch_size``: times the
    batch ratio (``linear``, Goyal et al.), its square root (``sqrt``, for Adam and LAMB) or 1."""
    if rule not in LR_SCALING:
        raise ConfigError(f"unknown learning-rate scaling {rule!r}; choose one of "
                          f"{', '.join(LR_SCALING)}", field="optimizer.lr_scaling")
    if base_batch_size <= 0 or batch_size <= 0:
        raise ConfigError(f"batch sizes must be positive, got {batch_size} and base "
                          f"{base_batch_size}", field="optimizer.base_batch_size")
    ratio = batch_size / base_batch_size
    return learning_rate * {"none": 1.0, "linear": ratio, "sqrt": ratio ** 0.5}[rule]


def path_name(path) -> str:
    """A tree path as ``blocks/layers/0/attn/wq/kernel`` (a Variable's ``.value`` left out)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path if getattr(k, "name", None) != "value")


def mark_no_decay(model) -> None:
    """Mark ``model``'s embedding tables (``nnx.Embed``) ``weight_decay=False``, in place: an
    embedding row is a lookup, not a weight matrix, whatever its rank. (``decay_mask`` spares
    ``nnx.Embed``'s tables unmarked too; this marks them whatever their path.)"""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Embed):
            module.embedding.set_metadata("weight_decay", False)


def decay_mask(params, exclude: tuple[str, ...] = ()):
    """True on the variables weight decay (and LAMB/LARS trust ratios) applies to: ``nnx.Param``
    of two or more dimensions per layer (not counting a scanned stack's layer axis; a plain
    pytree's leaves by rank alone), unless their metadata says ``weight_decay=False``
    (``mark_no_decay``), they are an ``nnx.Embed`` table (a ``Param`` flax names ``embedding``;
    metadata ``weight_decay=True`` decays one), or their path matches an ``exclude`` regular
    expression (``--no-decay``)."""
    try:
        patterns = [re.compile(p) for p in exclude]
    except re.error as e:
        raise ConfigError(f"bad parameter-path pattern {e.pattern!r} ({e})",
                          field="optimizer.no_decay") from None

    def decays(path, leaf):
        if any(p.search(path_name(path)) for p in patterns):
            return False
        if not isinstance(leaf, nnx.Variable):
            return leaf.ndim >= 2
        meta = leaf.get_metadata()
        rank = leaf.ndim - bool(meta.get("stacked"))
        # the one name read: a state keeps no trace of the module that made a variable, and an
        # own model's table must not decay when no mark_no_decay ran
        table = getattr(path[-1], "key", None) == EMBED_TABLE
        return (isinstance(leaf, nnx.Param) and rank >= 2
                and meta.get("weight_decay", not table) is not False)

    return jax.tree_util.tree_map_with_path(decays, params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def with_state_dtype(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """Keep ``inner``'s floating-point state in ``dtype`` between steps, updated in float32."""

    def cast(tree, to):
        return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                            tree)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


def state_bytes(opt_state) -> int:
    """Bytes of the optimizer state's arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state))


def resolve_defaults(name: str, learning_rate: float | None,
                     weight_decay: float | None) -> tuple[float, float]:
    """The learning rate and weight decay, ``DEFAULTS[name]``'s where not given."""
    if name not in DEFAULTS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}",
                          field="optimizer.name")
    defaults = DEFAULTS[name]
    return (defaults.learning_rate if learning_rate is None else learning_rate,
            defaults.weight_decay if weight_decay is None else weight_decay)


def make_optimizer(name: str = "adamw", *, learning_rate: float | None = None,
                   weight_decay: float | None = None, schedule: str = "cosine",
                   warmup_steps: int = 0, total_steps: int, clip_norm: float | None = 1.0,
                   b1: float | None = None, b2: float | None = None, nesterov: bool = True,
                   mask=None, state_dtype=None):
    """The named optimizer as one ``optax.GradientTransformation`` (clipping included), its
    learning rate ``make_schedule(schedule, learning_rate, ...)``; unset hyperparameters are
    ``DEFAULTS[name]``'s. ``mask`` (bools or a function of the params; default ``decay_mask``):
    where weight decay and trust ratios apply. ``state_dtype``: the state's dtype between steps."""
    learning_rate, weight_decay = resolve_defaults(name, learning_rate, weight_decay)
    defaults = DEFAULTS[name]
    b1 = defaults.b1 if b1 is None else b1
    b2 = defaults.b2 if b2 is None else b2
    if not 0 < learning_rate < math.inf:
        raise ConfigError(f"learning rate must be a finite number > 0, got {learning_rate}",
                          field="optimizer.learning_rate")
    if not 0 <= weight_decay < math.inf:
        raise ConfigError(f"weight decay must be a finite number >= 0, got {weight_decay}",
                          field="optimizer.weight_decay")
    if clip_norm is not None and not 0 <= clip_norm < math.inf:
        raise ConfigError(f"clip_norm must be a finite number >= 0 (0 or None = off; a negative "
                          f"one would ascend the gradient), got {clip_norm}",
                          field="optimizer.clip_norm")
    for beta, value in (("b1", b1), ("b2", b2)):
        if value is not None and not 0 <= value < 1:
            raise ConfigError(f"{beta} (a moment's decay) must be in [0, 1), got {value}",
                              field="optimizer.name")
    if total_steps < 1:
        raise ConfigError(f"total steps must be >= 1, got {total_steps}", field="run.steps")
    mask = decay_mask if mask is None else mask
    lr = make_schedule(schedule, learning_rate, warmup_steps=warmup_steps, total_steps=total_steps)

    if name == "adamw":
        rule = optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask)
    elif name == "lion":
        rule = optax.lion(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask)
    elif name == "lamb":
        # From optax's parts: its ``lamb`` puts the trust ratio on every leaf, norm scales too.
        rule = optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=1e-6),
                           optax.add_decayed_weights(weight_decay, mask),
                           optax.masked(optax.scale_by_trust_ratio(), mask),
                           optax.scale_by_learning_rate(lr))
    elif name == "lars":
        rule = optax.lars(lr, weight_decay=weight_decay, weight_decay_mask=mask,
                          trust_ratio_mask=mask, momentum=b1, nesterov=nesterov)
    elif name == "sgd":
        rule = optax.chain(optax.add_decayed_weights(weight_decay, mask),
                           optax.sgd(lr, momentum=b1, nesterov=nesterov))
    else:
        rule = optax.adafactor(lr, decay_rate=b2, momentum=b1, multiply_by_parameter_scale=False,
                               weight_decay_rate=weight_decay or None,
                               weight_decay_mask=mask if weight_decay else None)

    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    optimizer = optax.chain(*parts, rule)
    if state_dtype is not None and jnp.dtype(state_dtype) != jnp.float32:
        optimizer = with_state_dtype(optimizer, state_dtype)
    return optimizer


def build_optimizer(settings, *, batch_rows: int, total_steps: int):
    """The optimizer a config's optimizer section describes
    (``jaxaccel.run.config.OptimizerConfig``),
    its learning-rate schedule, and its hyperparameters as resolved: the optimizer's defaults
    filled in, the peak learning rate scaled from ``base_batch_size`` to ``batch_rows``."""
    base_lr, weight_decay = resolve_defaults(settings.name, settings.learning_rate,
                                             settings.weight_decay)
    learning_rate = scale_learning_rate(base_lr, settings.lr_scaling, batch_rows,
                                        settings.base_batch_size)
    patterns = tuple(p.strip() for p in (settings.no_decay or "").split(",") if p.strip())
    optimizer = make_optimizer(
        settings.name, learning_rate=learning_rate, weight_decay=weight_decay,
        schedule=settings.schedule, warmup_steps=settings.warmup_steps, total_steps=total_steps,
        clip_norm=settings.clip_norm, mask=lambda params: decay_mask(params, patterns),
        state_dtype=jnp.dtype(settings.state_dtype))
    schedule = make_schedule(settings.schedule, learning_rate, warmup_steps=settings.warmup_steps,
                             total_steps=total_steps)
    return optimizer, schedule, {"learning_rate": learning_rate, "weight_decay": weight_decay}
