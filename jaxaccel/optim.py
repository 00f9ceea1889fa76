"""Optimizers by name, with the defaults that large-batch transformer training needs.

``make_optimizer(name, ...)`` returns an ``optax.GradientTransformation`` for ``adamw``,
``lion``, ``lamb``, ``lars``, ``sgd`` (momentum, optionally Nesterov) and ``adafactor``. The update
rules are optax's own transformations; this module is the glue around them:

- weight decay (and the LAMB/LARS trust ratio) applies to the weight matrices only: the default
  ``decay_mask`` leaves out biases and normalisation scales (every variable under two
  dimensions within one layer, scanned stacks included) and embedding tables (``nnx.Embed``,
  ``mark_no_decay``), judged by rank, variable type and metadata, never by name; pass
  ``mask=`` to choose otherwise;
- one schedule family for all: constant, or linear warmup then cosine or linear decay, or
  inverse square root (``make_schedule``);
- ``scale_learning_rate`` moves a learning rate tuned at one batch size to another (linear or
  square-root rule);
- global-norm clipping before the update, and optionally optimizer state kept in bfloat16
  (``state_dtype``) to halve its memory.

Each optimizer's recommended settings live in ``DEFAULTS``; Lion's are AdamW's scaled as its
authors advise (learning rate 3-10x smaller, weight decay 3-10x larger: here 10x and 10x, so the
product lr * weight decay, the strength of the decay, stays AdamW's). The learning rates of LAMB,
LARS and SGD are the best of a short sweep on the tiny model (BENCHMARKS.md).
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxaccel.errors import ConfigError

SCHEDULES = ("constant", "cosine", "linear", "rsqrt")
LR_SCALING = ("none", "linear", "sqrt")

# Lion takes AdamW's learning rate divided, and weight decay multiplied, by this factor.
LION_FACTOR = 10.0


@dataclasses.dataclass(frozen=True)
class OptimizerDefaults:
    """The settings an optimizer uses when the caller leaves them unset."""

    learning_rate: float
    weight_decay: float
    b1: float | None = None       # first-moment (momentum) decay; None: the optimizer has none
    b2: float | None = None       # second-moment decay
    summary: str = ""


_ADAMW_LR, _ADAMW_WD = 3e-3, 0.1
DEFAULTS = {
    "adamw": OptimizerDefaults(_ADAMW_LR, _ADAMW_WD, 0.9, 0.95,
                               "Adam with decoupled weight decay"),
    "lion": OptimizerDefaults(_ADAMW_LR / LION_FACTOR, _ADAMW_WD * LION_FACTOR, 0.9, 0.99,
                              f"sign of interpolated momentum; lr {LION_FACTOR:g}x smaller and "
                              f"weight decay {LION_FACTOR:g}x larger than AdamW's"),
    "lamb": OptimizerDefaults(3e-2, 0.1, 0.9, 0.999,
                              "Adam update rescaled per layer by ||w|| / ||update||"),
    "lars": OptimizerDefaults(10.0, 1e-4, 0.9, None,
                              "momentum SGD rescaled per layer by 0.001 ||w|| / ||g||"),
    "sgd": OptimizerDefaults(0.1, 0.0, 0.9, None, "SGD with Nesterov momentum"),
    "adafactor": OptimizerDefaults(_ADAMW_LR, 0.0, None, 0.8,
                                   "factored second moments, no momentum, update clipping"),
}
OPTIMIZERS = tuple(DEFAULTS)


def describe_defaults() -> str:
    """One line per optimizer for ``--help``."""
    return "; ".join(f"{name}: lr {d.learning_rate:g}, wd {d.weight_decay:g} ({d.summary})"
                     for name, d in DEFAULTS.items())


def make_schedule(name: str, learning_rate: float, *, warmup_steps: int, total_steps: int,
                  final_fraction: float = 0.1):
    """``schedule(step) -> learning rate``: linear warmup from 0, then the named shape.

    ``constant`` holds the peak; ``cosine`` and ``linear`` decay to ``final_fraction`` of it at
    ``total_steps``; ``rsqrt`` decays as ``peak * sqrt(warmup / step)`` after the warmup.
    """
    if name not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}",
                          field="optimizer.schedule")
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    decay_steps = max(total_steps - warmup_steps, 1)
    end_value = learning_rate * final_fraction
    if name == "constant":
        after = optax.constant_schedule(learning_rate)
    elif name == "cosine":
        after = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=final_fraction)
    elif name == "linear":
        after = optax.linear_schedule(learning_rate, end_value, decay_steps)
    else:
        offset = max(warmup_steps, 1)
        after = lambda step: learning_rate * jax.lax.rsqrt((step + offset) / offset)  # noqa: E731
    if warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, after], [warmup_steps])


def scale_learning_rate(learning_rate: float, rule: str, batch_size: float,
                        base_batch_size: float) -> float:
    """The learning rate for ``batch_size`` given one tuned at ``base_batch_size``.

    ``linear`` multiplies by the batch ratio (Goyal et al.), ``sqrt`` by its square root (the rule
    for adaptive optimizers such as Adam and LAMB), ``none`` leaves it.
    """
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
    """Mark every embedding table of ``model`` (``nnx.Embed``) as taking no weight decay
    (metadata ``weight_decay=False``), in place: an embedding row is a lookup, not a weight
    matrix, whatever its rank."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Embed):
            module.embedding.set_metadata("weight_decay", False)


def decay_mask(params, exclude: tuple[str, ...] = ()):
    """True on the variables weight decay (and LAMB/LARS trust ratios) applies to: weights of
    two or more dimensions per layer (a scanned stack's leading layer axis does not count), but
    not those whose metadata says ``weight_decay=False`` (embedding tables, ``mark_no_decay``)
    or whose path matches one of the ``exclude`` regular expressions (``--no-decay``). Judged by
    rank, type and metadata, never by a variable's name; a plain pytree is judged by rank."""
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
        return (isinstance(leaf, nnx.Param) and rank >= 2
                and meta.get("weight_decay", True) is not False)

    return jax.tree_util.tree_map_with_path(decays, params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def with_state_dtype(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """Keep ``inner``'s floating-point state in ``dtype`` between steps (bfloat16: half the bytes);
    it is updated in float32 and rounded back after each step."""

    def cast(tree, to):
        return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                            tree)

    def init(params):
        return cast(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(init, update)


def state_bytes(opt_state) -> int:
    """Bytes of the optimizer state's arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state))


def _lamb(schedule, b1, b2, weight_decay, mask):
    """LAMB from optax's parts, so that the trust ratio obeys the same mask as the decay (optax's
    ``lamb`` applies the trust ratio to every leaf, norm scales included)."""
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=1e-6),
        optax.add_decayed_weights(weight_decay, mask),
        optax.masked(optax.scale_by_trust_ratio(), mask),
        optax.scale_by_learning_rate(schedule),
    )


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
    """The named optimizer as one ``optax.GradientTransformation`` (clipping included).

    Its learning rate follows ``make_schedule(schedule, learning_rate, ...)``: call that with the
    same arguments for the value at a step. ``learning_rate``, ``weight_decay``, ``b1`` and
    ``b2`` default to ``DEFAULTS[name]``. ``mask``
    (a tree of bools or a function of the params) says where weight decay and trust ratios apply;
    default ``decay_mask``. ``state_dtype`` (e.g. ``jnp.bfloat16``) stores the state in that dtype.
    """
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
    lr = make_schedule(schedule, learning_rate, warmup_steps=warmup_steps,
                       total_steps=total_steps)

    if name == "adamw":
        rule = optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask)
    elif name == "lion":
        rule = optax.lion(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask)
    elif name == "lamb":
        rule = _lamb(lr, b1, b2, weight_decay, mask)
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
    """The optimizer a config's optimizer section describes (``jaxaccel.config.OptimizerConfig``),
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
