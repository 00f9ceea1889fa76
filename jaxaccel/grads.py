"""Gradient functions and the transformations that compose them.

A gradient function is ``grad_fn(params, batch, key, *, scale=None) -> ((loss, aux), grads)``:
the loss of ``params`` on ``batch`` (any pytree), its ``aux`` (a dict of additive statistics such
as token counts) and the gradient. ``key`` is a PRNG key for dropout and the like. ``scale``
seeds the backward pass, so the gradients are those of ``scale * loss``: the hook loss scaling
(``jaxaccel.precision.loss_scaled``) uses. Each transformation below takes a gradient function
and returns one with the same signature, so they compose in any order:

    grad_fn = accumulate(value_and_grad(loss_fn), microbatches=4, weight="real_tokens")
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.errors import ConfigError

REDUCTIONS = ("mean", "sum")
# aux entries that are not additive: maxima over microbatches, and per-row values.
OBSERVED_MAX = "observed_max"
ROWS = "rows"


def value_and_grad(loss_fn, *, trainable=None, observed=None):
    """The gradient function of ``loss_fn(params, batch, key) -> (loss, aux)``.

    The backward pass starts from ``scale`` (default 1) instead of 1: the gradient of
    ``scale * loss``, computed without changing the loss function, bit for bit what
    ``jax.grad(lambda p: scale * loss_fn(p, ...)[0])`` gives. ``params`` is any pytree.

    With ``trainable`` (an NNX filter: a variable type, ``nn.trainable(state)``) ``params`` is a
    model's ``nnx.State`` and only the variables it matches are differentiated: the gradients are
    that part of the state alone, and the others enter the forward pass as constants, so no
    gradient is computed for them at all (LoRA and adapters freeze the base weights; buffers
    are never trained).

    With ``observed`` (a filter, ``nn.Observation``) the variables it matches are probes: they
    are differentiated too, but their cotangents are observations the backward pass reports
    (FP8's amax), not gradients. They come back as ``aux["observed_max"]`` (a State shaped like
    those variables, combined across microbatches by maximum), never in the gradients.
    """

    def grad_fn(params, batch, key, *, scale=None):
        train, probes, frozen = partition(params, trainable, observed)
        loss, backward, aux = jax.vjp(
            lambda t, p: loss_fn(combine(t, p, frozen), batch, key), train, probes,
            has_aux=True)
        seed = jnp.ones_like(loss) if scale is None else jnp.asarray(scale, loss.dtype)
        grads, observations = backward(seed)
        if observed is not None:
            aux = {**aux, OBSERVED_MAX: observations}
        return (loss, aux), grads

    return grad_fn


def partition(params, trainable=None, observed=None):
    """``(trainable part, observed part, the rest)`` of a model's state by NNX filters
    (``nnx.split_state``); without filters the whole of ``params`` (any pytree) trains."""
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
    if len(parts) == 1:
        return parts[0]
    return nnx.merge_state(*parts)


def _zeros_like_grads(params, grads_shape):
    """Zeros shaped like the gradients (all of ``params``, or its trainable part), each made like
    the parameter at its path (so with its sharding)."""
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
    """Every ``[B, ...]`` leaf of ``batch`` as ``[M, B / M, ...]``, taking every M-th row.

    Strided rather than contiguous, so that when the rows are split over devices each
    microbatch takes the same share of every device's rows and stays spread over all of them.
    """
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
    """Gradient accumulation as a transformation of ``grad_fn`` (same signature).

    The batch (any pytree whose leaves share a leading row dimension) is split into
    ``microbatches`` parts (``split_microbatches``); ``lax.scan`` runs them one after the other
    and adds their losses and gradients into one gradient-sized accumulator, so only one
    microbatch's activations are alive at a time. Microbatch ``i`` gets the key
    ``fold_in(key, i)``. How the parts combine is explicit:

    - ``reduce="sum"``: losses and gradients add up (losses that are sums over the batch);
    - ``reduce="mean"``: they are averaged (losses that are means over the batch), weighted by
      ``aux[weight]`` when ``weight`` names an aux entry: with a token-mean loss and
      ``weight="real_tokens"`` the result is the whole batch's token mean, however unevenly the
      real tokens fall into microbatches.

    ``aux`` entries are additive statistics and are summed, except ``aux["observed_max"]``
    (``value_and_grad``'s observations), whose leaves combine by maximum, and ``aux["rows"]``, a
    dict of per-row values ``[rows of the microbatch, ...]``, which come back as the whole
    batch's rows in the batch's order.
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
