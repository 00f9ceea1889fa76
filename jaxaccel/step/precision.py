"""Mixed precision: dtype policies and loss scaling, each a transformation.

A ``Policy`` names three dtypes: parameters are stored in ``param_dtype`` (float32 in every named
policy, so the optimizer updates full-precision weights), the model computes in ``compute_dtype``,
outputs such as logits are cast to ``output_dtype`` before the float32 loss (``cast``).

float16's few exponent bits flush small gradients to zero; loss scaling multiplies the float32
loss by a large factor before differentiation and divides the gradients by it after.
``DynamicLossScale`` follows PyTorch's GradScaler (halve the scale and skip the step on overflow,
double it after ``growth_interval`` finite steps), ``StaticLossScale`` keeps one, ``NoLossScale``
is the identity: pytrees saved with the train state; the two scales count the steps they skip.
``loss_scaled(grad_fn)`` applies one to a gradient function; ``skip_nonfinite(optimizer)`` skips
the update on a non-finite step.
"""

import contextlib
import dataclasses
import functools
import math
from typing import Any, Self

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxaccel.model import nn
from jaxaccel.core.errors import ConfigError
from jaxaccel.model.nn import compute_in      # noqa: F401 - the flax layers' dtype, re-exported
from jaxaccel.core.sections import LOSS_SCALE_KINDS     # declared without jax

_DTYPES = {
    "float32": jnp.float32, "f32": jnp.float32, "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "f16": jnp.float16, "fp16": jnp.float16,
}
_KEYS = ("params", "compute", "output")
_FIELD = "precision.policy"


def _is_floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _cast_floating(tree, dtype):
    """Cast the floating-point leaves of ``tree`` to ``dtype``; other leaves pass unchanged."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype) if _is_floating(x) else x, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Storage, compute and output dtypes; with ``fp8``, ``jaxaccel.techniques.fp8``'s float8
    matmuls."""

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any
    fp8: bool = False

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, name, jnp.dtype(getattr(self, name)))

    def cast_to_param(self, tree):
        """Parameters as they are stored (``jaxaccel.step.state.init_state`` applies it)."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree):
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree):
        return _cast_floating(tree, self.output_dtype)

    @property
    def needs_loss_scaling(self) -> bool:
        """float16 compute underflows small gradients unless the loss is scaled."""
        return self.compute_dtype == jnp.float16

    @property
    def name(self) -> str:
        """The POLICIES name if there is one, else ``params=...,compute=...,output=...``."""
        dtypes = (self.param_dtype, self.compute_dtype, self.output_dtype)
        return next((name for name, policy in POLICIES.items() if policy == self),
                    ",".join(f"{key}={dtype.name}" for key, dtype in zip(_KEYS, dtypes)))

    def __str__(self) -> str:
        return self.name


POLICIES = {
    "fp32": Policy(jnp.float32, jnp.float32, jnp.float32),
    "bf16": Policy(jnp.float32, jnp.bfloat16, jnp.float32),
    "fp16": Policy(jnp.float32, jnp.float16, jnp.float32),
    "fp8": Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8=True),
}


def get_policy(spec: str) -> Policy:
    """A policy by name (``bf16``) or as ``params=float32,compute=bfloat16,output=float32``."""
    spec = spec.strip().lower()
    if spec in POLICIES:
        return POLICIES[spec]
    forms = (f"use one of {', '.join(POLICIES)} or params=<dtype>,compute=<dtype>,output=<dtype> "
             f"with dtypes {', '.join(_DTYPES)}")
    if "=" not in spec:
        raise ConfigError(f"unknown precision {spec!r}: {forms}", field=_FIELD)
    dtypes = {}
    for part in spec.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key not in _KEYS or key in dtypes:
            raise ConfigError(f"bad part {part.strip()!r} in precision {spec!r} (keys are "
                              f"{', '.join(_KEYS)}, each once): {forms}", field=_FIELD)
        if value not in _DTYPES:
            raise ConfigError(f"unknown dtype {value!r} for {key} in precision {spec!r}: {forms}",
                              field=_FIELD)
        dtypes[key] = _DTYPES[value]
    missing = [key for key in _KEYS if key not in dtypes]
    if missing:
        raise ConfigError(f"precision {spec!r} lacks {', '.join(missing)}: {forms}", field=_FIELD)
    return Policy(*(dtypes[key] for key in _KEYS))


def _count_skipped(skipped_steps: jax.Array, grads_finite: jax.Array) -> jax.Array:
    return skipped_steps + jnp.logical_not(grads_finite).astype(jnp.int32)


def _check(ok: bool, message: str, field: str):
    if not ok:
        raise ConfigError(message, field=f"precision.{field}")


def _float32_finite(x) -> bool:
    """``x`` is a number that stays finite as a float32 (1e39 does not: it is inf there)."""
    try:
        return math.isfinite(x) and abs(x) <= float(jnp.finfo(jnp.float32).max)
    except TypeError:
        return False


class _Scaled:
    """``scale_loss`` and ``unscale`` for loss scales with a float32 ``scale`` field."""

    @property
    def loss_scale(self) -> jax.Array:
        return self.scale

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        """The loss times the scale, in float32; compute the loss in float32 before this."""
        return jnp.asarray(loss, jnp.float32) * self.scale

    def unscale(self, grads):
        """Divide every floating leaf by the scale, in float32, keeping each leaf's dtype."""
        return jax.tree.map(lambda g: (g.astype(jnp.float32) / self.scale).astype(g.dtype)
                            if _is_floating(g) else g, grads)


@struct.dataclass
class DynamicLossScale(_Scaled):
    """GradScaler-style scale: back off on overflow, grow after ``growth_interval`` finite steps."""

    scale: jax.Array
    growth_tracker: jax.Array
    skipped_steps: jax.Array
    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    min_scale: float = struct.field(pytree_node=False, default=1.0)

    @classmethod
    def create(cls, initial_scale: float = 2.0**16, growth_factor: float = 2.0,
               backoff_factor: float = 0.5, growth_interval: int = 2000,
               min_scale: float = 1.0) -> Self:
        """A fresh scale; raises ConfigError on settings that cannot work."""
        _check(growth_factor > 1 and _float32_finite(growth_factor),
               f"loss-scale growth_factor must be a finite number > 1, got {growth_factor}",
               "growth_factor")
        _check(0 < backoff_factor < 1,
               f"loss-scale backoff_factor must be in (0, 1), got {backoff_factor}", "backoff")
        _check(growth_interval >= 1,
               f"loss-scale growth_interval must be >= 1, got {growth_interval}", "growth_interval")
        _check(min_scale > 0 and _float32_finite(min_scale),
               f"loss-scale min_scale must be a finite number > 0, got {min_scale}", "min_scale")
        _check(min_scale <= initial_scale and _float32_finite(initial_scale),
               f"initial loss scale must be finite in float32 and >= min_scale {min_scale}, "
               f"got {initial_scale}", "init_scale")
        return cls(scale=jnp.asarray(initial_scale, jnp.float32),
                   growth_tracker=jnp.zeros((), jnp.int32), skipped_steps=jnp.zeros((), jnp.int32),
                   growth_factor=float(growth_factor), backoff_factor=float(backoff_factor),
                   growth_interval=int(growth_interval), min_scale=float(min_scale))

    def adjust(self, grads_finite: jax.Array) -> Self:
        """The scale for the next step, given whether this step's gradients were all finite."""
        tracker = self.growth_tracker + 1
        grow = tracker >= self.growth_interval
        grown = self.scale * self.growth_factor
        finite_scale = jnp.where(grow & jnp.isfinite(grown), grown, self.scale)
        backed_off = jnp.maximum(self.scale * self.backoff_factor, self.min_scale)
        return self.replace(
            scale=jnp.where(grads_finite, finite_scale, backed_off),
            growth_tracker=jnp.where(grads_finite & ~grow, tracker, 0),
            skipped_steps=_count_skipped(self.skipped_steps, grads_finite))


@struct.dataclass
class StaticLossScale(_Scaled):
    """A fixed scale; non-finite steps are still counted (and should still be skipped)."""

    scale: jax.Array
    skipped_steps: jax.Array

    @classmethod
    def create(cls, scale: float = 2.0**15) -> Self:
        _check(0 < scale and _float32_finite(scale),
               f"static loss scale must be positive and finite, got {scale}", "init_scale")
        return cls(scale=jnp.asarray(scale, jnp.float32), skipped_steps=jnp.zeros((), jnp.int32))

    def adjust(self, grads_finite: jax.Array) -> Self:
        return self.replace(skipped_steps=_count_skipped(self.skipped_steps, grads_finite))


@struct.dataclass
class NoLossScale:
    """Scale 1: the identity. Its steps are applied whatever their gradients
    (``train.make_train_step``), so none counts as skipped."""

    skipped_steps: jax.Array

    @classmethod
    def create(cls) -> Self:
        return cls(skipped_steps=jnp.zeros((), jnp.int32))

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        return loss

    def unscale(self, grads):
        return grads

    def adjust(self, grads_finite: jax.Array) -> Self:
        return self


LossScale = DynamicLossScale | StaticLossScale | NoLossScale
def make_loss_scale(kind: str, policy: Policy, *, initial_scale: float = 2.0**16,
                    growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 2000, min_scale: float = 1.0,
                    static_scale: float = 2.0**15) -> LossScale:
    """The loss scale of ``kind`` (``auto``: dynamic for float16 compute, else none), reading
    only that kind's settings, so a config may pass all of them."""
    if kind == "auto":
        kind = "dynamic" if policy.needs_loss_scaling else "none"
    if kind == "dynamic":
        return DynamicLossScale.create(initial_scale, growth_factor, backoff_factor,
                                       growth_interval, min_scale)
    if kind == "static":
        return StaticLossScale.create(static_scale)
    if kind == "none":
        return NoLossScale.create()
    raise ConfigError(f"unknown loss scale {kind!r}: use one of {', '.join(LOSS_SCALE_KINDS)}",
                      field="precision.loss_scale")


def all_finite(tree) -> jax.Array:
    """True iff every element of every floating leaf is finite (a bool scalar array). It reduces
    global arrays: under jit every device gets the same answer and skips the same steps."""
    return functools.reduce(
        jnp.logical_and,
        (jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _is_floating(x)),
        jnp.array(True))


def select_tree(pred: jax.Array, on_true, on_false):
    """``on_true`` if the scalar ``pred`` holds, else ``on_false`` (trees of one structure,
    shapes and dtypes), leaf by leaf; the chosen leaves come back bitwise."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


@contextlib.contextmanager
def computing_in(policy: Policy):
    """Inside, a model merged by ``model.make_apply`` (or ``model.parts``) computes its flax
    layers in the policy's 16-bit ``compute_dtype`` (``compute_in`` on the merged copy)."""
    dtype = None if policy.compute_dtype == jnp.float32 else policy.compute_dtype
    with nn.step(compute_dtype=dtype):
        yield


def cast(fn, policy: Policy):
    """``fn(params, *args)`` in the policy's dtypes: floating ``params`` cast to ``compute_dtype``,
    the result to ``output_dtype``; gradients flow back through the casts in params' dtype. A
    model's ``fn`` (``model.make_apply``) also computes its flax layers in ``compute_dtype``
    (``computing_in``), as the loop's model does: cast variables alone leave a layer whose
    ``dtype`` is None promoting to float32 (``compute_in``). ``fn``'s attributes are kept."""

    @functools.wraps(fn)
    def cast_fn(params, *args, **kwargs):
        with computing_in(policy):
            return policy.cast_to_output(fn(policy.cast_to_compute(params), *args, **kwargs))

    return cast_fn


def float32_warning(locations: list[str], policy: Policy) -> str | None:
    """The warning line for matmuls a 16-bit policy still computes in float32 (``locations``,
    ``jaxaccel.step.trace.float32_matmuls`` of the step), or None. Its fix depends on whose line it
    is: a flax layer multiplies in its ``dtype`` (``compute_in`` sets those left None), other
    code in its operands'."""
    if policy.compute_dtype == jnp.float32 or not locations:
        return None
    shown = "; ".join(locations[:4]) + (f"; and {len(locations) - 4} more"
                                         if len(locations) > 4 else "")
    dtype = policy.compute_dtype.name
    fixes = []
    if any(where.startswith("flax's ") for where in locations):
        fixes.append(f"flax's layers multiply in their dtype, float32 there: build them with "
                     f"dtype=None and precision.compute_in(model, {dtype}) sets it (as the loop "
                     f"and precision.cast of a model.make_apply function do), or give "
                     f"dtype={dtype}")
    if not all(where.startswith("flax's ") for where in locations):
        fixes.append("elsewhere an operand stayed float32 (a float32 constant, an explicit cast "
                     "or a float32 layer's output): cast it to the input's dtype")
    return (f"warning: under --precision {policy.name} the model still multiplies in float32 "
            f"at {shown}: {'; '.join(fixes)}")


def loss_scaled(grad_fn):
    """Loss scaling around a gradient function: ``scaled(params, batch, key, loss_scale) ->
    ((loss, aux), grads, loss_scale)`` unscales the gradients, sets ``aux["grads_finite"]`` (for
    ``skip_nonfinite``) and returns the loss scale adjusted for the next step."""

    def scaled(params, batch, key, loss_scale):
        (loss, aux), grads = grad_fn(params, batch, key, scale=loss_scale.loss_scale)
        grads = loss_scale.unscale(grads)
        finite = all_finite(grads)
        return (loss, {**aux, "grads_finite": finite}), grads, loss_scale.adjust(finite)

    return scaled


def skip_nonfinite(optimizer: optax.GradientTransformation):
    """``optimizer`` that makes no update and keeps its state when the gradients are not all
    finite (``grads_finite=`` from ``loss_scaled``, else tested here). Unlike
    ``optax.apply_if_finite`` it adds no state and never stops skipping."""
    inner = optax.with_extra_args_support(optimizer)

    def update(grads, state, params=None, *, grads_finite=None, **extra):
        finite = all_finite(grads) if grads_finite is None else grads_finite
        updates, new_state = inner.update(grads, state, params, **extra)
        zeros = jax.tree.map(jnp.zeros_like, updates)
        return select_tree(finite, (updates, new_state), (zeros, state))

    return optax.GradientTransformationExtraArgs(inner.init, update)
