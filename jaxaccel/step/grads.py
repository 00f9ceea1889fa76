"""Gradient functions and the transformations that compose them.

A gradient function is ``grad_fn(params, batch, key, *, scale=None) -> ((loss, aux), grads)``:
the loss on ``batch`` (any pytree), its ``aux`` (additive statistics such as token counts) and
the gradient of ``scale * loss`` (loss scaling's hook). The transformations below return
gradient functions of the same signature, so they compose in any order:

    grad_fn = accumulate(value_and_grad(loss_fn), microbatches=4, weight="real_tokens")
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.model import nn
from jaxaccel.core.errors import ConfigError

REDUCTIONS = ("mean", "sum")
# aux entries that are not additive: maxima over microbatches, and per-row values.
OBSERVED_MAX = "observed_max"
ROWS = "rows"


def value_and_grad(loss_fn, *, trainable=None, observed=None):
    """The gradient function of ``loss_fn(params, batch, key) -> (loss, aux)``; the backward
    pass starts from ``scale`` (default 1), bit for bit ``jax.grad`` of ``scale * loss``.

    With ``trainable`` (an NNX filter; for a model's ``nnx.State`` by default
    ``nn.trainable(params)``, ``partition``) only the matched variables are differentiated, the
    others entering as constants (LoRA and adapters freeze the base weights; buffers never
    train). With ``observed`` (default: ``nn.Observation`` where the state holds any) the
    matched variables are probes whose cotangents (FP8's amax) return as ``aux["observed_max"]``.
    """

    def grad_fn(params, batch, key, *, scale=None):
        probed = observed if observed is not None else default_observed(params)
        train, probes, frozen = partition(params, trainable, probed)
        loss, backward, aux = jax.vjp(lambda t, p: loss_fn(combine(t, p, frozen), batch, key),
                                      train, probes, has_aux=True)
        seed = jnp.ones_like(loss) if scale is None else jnp.asarray(scale, loss.dtype)
        grads, observations = backward(seed)
        if probed is not None:
            aux = {**aux, OBSERVED_MAX: observations}
        return (loss, aux), grads

    return grad_fn


def _variables(params) -> list:
    """The ``nnx.Variable`` leaves of a model's state (none for any other pytree)."""
    if not isinstance(params, nnx.State):
        return []
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [v for v in leaves if isinstance(v, nnx.Variable)]


def default_observed(params):
    """``nn.Observation`` when the model's state holds such probes (FP8's amax histories), else
    None: the filter ``value_and_grad`` observes unless told."""
    return nn.Observation if any(isinstance(v, nn.Observation) for v in _variables(params)) \
        else None


def partition(params, trainable=None, observed=None):
    """``(trainable part, observed part, the rest)`` of a model's state by NNX filters
    (``nnx.split_state``). Without ``trainable`` a model's ``nnx.State`` trains what the loop
    trains, ``nn.trainable(params)`` (never a buffer, an RNG key, or a weight a fine-tune
    freezes), and any other pytree trains whole."""
    if trainable is None and _variables(params):
        trainable = nn.trainable(params)
    if trainable is None and observed is None:
        return params, {}, {}
    train_filter = nnx.Param if trainable is None else trainable
    if observed is None:
        train, rest = nnx.split_state(params, train_filter, ...)
        return train, nnx.State({}), rest
    return nnx.split_state(params, train_filter, observed, ...)


def combine(*parts):
    """A state again from the parts of ``partition`` (empty parts skipped)."""
    parts = [p for p in parts if not (isinstance(p, dict) and not p)
             and not (isinstance(p, nnx.State) and not len(p))]
    return parts[0] if len(parts) == 1 else nnx.merge_state(*parts)


def _zeros_like_grads(params, grads_shape):
    """Zeros shaped like the gradients, each made like the parameter at its path (sharded so)."""
    by_path = {jax.tree_util.keystr(p): leaf
               for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(grads_shape)
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.zeros_like(by_path.get(jax.tree_util.keystr(p), s)) for p, s in flat])


def _add_aux(total, aux):
    """Microbatch statistics combined: summed, ``observed_max`` by maximum."""
    return {key: jax.tree.map(jnp.maximum if key == OBSERVED_MAX else jnp.add, total[key], value)
            for key, value in aux.items()}


def split_microbatches(batch, microbatches: int):
    """Every ``[B, ...]`` leaf of ``batch`` as ``[M, B / M, ...]``, taking every M-th row: so
    when the rows are split over devices, each microbatch takes a share of every device's."""
    rows = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(batch)}
    if len(rows) != 1 or None in rows:
        raise ConfigError(f"cannot split a batch into microbatches: its leaves need one shared "
                          f"leading (row) dimension, got leading sizes {sorted(rows, key=str)}")
    (B,) = rows
    if B % microbatches:
        raise ConfigError(f"batch of {B} rows does not split into {microbatches} microbatches; "
                          f"choose a number of microbatches dividing the batch size",
                          field="optimizer.accumulate")
    return jax.tree.map(
        lambda x: x.reshape(B // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1), batch)


def accumulate(grad_fn, microbatches: int, *, reduce: str = "mean", weight: str | None = None):
    """Gradient accumulation of ``grad_fn`` (same signature): ``lax.scan`` runs the batch's
    ``microbatches`` parts (``split_microbatches``; part ``i`` gets the key ``fold_in(key, i)``)
    into one gradient-sized accumulator, so one microbatch's activations are alive at a time.
    ``reduce="sum"`` adds losses and gradients up; ``reduce="mean"`` averages them, weighted by
    ``aux[weight]`` when given: with a token-mean loss and ``weight="real_tokens"``, the whole
    batch's token mean however the tokens fall. ``aux`` entries are summed, ``observed_max`` by
    maximum, and ``rows`` (per-row values) come back in the batch's row order.
    """
    if microbatches < 1:
        raise ConfigError(f"accumulate must be >= 1, got {microbatches}",
                          field="optimizer.accumulate")
    if reduce not in REDUCTIONS:
        raise ConfigError(f"unknown reduction {reduce!r}; choose one of {', '.join(REDUCTIONS)}")
    if weight is not None and reduce != "mean":
        raise ConfigError("a weight only applies to reduce='mean'")
    if microbatches == 1:
        return grad_fn

    def accumulated(params, batch, key, *, scale=None):
        def add_microbatch(carry, index_and_batch):
            index, microbatch = index_and_batch
            (loss, aux), grads = grad_fn(params, microbatch, jax.random.fold_in(key, index),
                                         scale=scale)
            w = aux[weight].astype(jnp.float32) if weight is not None else 1.0
            total_loss, total_weight, total_aux, total_grads = carry
            aux = dict(aux)
            rows = aux.pop(ROWS, None)
            return (total_loss + w * loss, total_weight + w, _add_aux(total_aux, aux),
                    jax.tree.map(lambda t, g: (t + w * g).astype(t.dtype), total_grads,
                                 grads)), rows

        parts = (jnp.arange(microbatches), split_microbatches(batch, microbatches))
        first = jax.tree.map(lambda x: x[0], parts[1])
        (_, aux_shape), grads_shape = jax.eval_shape(
            lambda p, b: grad_fn(p, b, key, scale=scale), params, first)
        aux_shape = {k: v for k, v in aux_shape.items() if k != ROWS}
        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape),
                 _zeros_like_grads(params, grads_shape))
        (loss, total_weight, aux, grads), rows = jax.lax.scan(add_microbatch, zeros, parts)
        if rows is not None:     # [M, B / M, ...] back to the batch's rows (split_microbatches)
            aux[ROWS] = jax.tree.map(
                lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), rows)
        if reduce == "mean":
            divisor = jnp.maximum(total_weight, 1.0) if weight is not None else microbatches
            loss = loss / divisor
            grads = jax.tree.map(lambda g: (g / divisor).astype(g.dtype), grads)
        return (loss, aux), grads

    return accumulated
