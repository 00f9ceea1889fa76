"""The training state and the pure step functions.

``train_step(state, batch) -> (state, metrics)`` and ``eval_step(state, batch) -> metrics`` are
pure functions of pytrees, built once from the model's apply function, the optimizer and the
precision policy. The caller jits them (with donation of the state) and shards them.

One step: cast the float32 master parameters to the policy's compute dtype, differentiate the
scaled loss (over microbatches if accumulating), unscale the float32 gradients, update, and, when
a loss scale is in use, keep the old parameters and optimizer state if any gradient is not
finite (the loss scale backs off and counts the skipped step).
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxaccel.errors import ConfigError
from jaxaccel.precision import (POLICIES, LossScale, NoLossScale, Policy, all_finite,
                                select_tree)


@struct.dataclass
class TrainState:
    """Everything a step reads and writes; orbax saves and restores it whole."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    loss_scale: LossScale


def init_state(params, optimizer: optax.GradientTransformation, seed: int,
               loss_scale: LossScale | None = None) -> TrainState:
    return TrainState(params=params, opt_state=optimizer.init(params),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(seed),
                      loss_scale=NoLossScale.create() if loss_scale is None else loss_scale)


def weighted_cross_entropy(logits_BTV, targets_BT, weights_BT):
    """Returns (sum of weighted token losses, sum of weights), both float32."""
    token_loss_BT = optax.softmax_cross_entropy_with_integer_labels(
        logits_BTV.astype(jnp.float32), targets_BT)
    weights_BT = weights_BT.astype(jnp.float32)
    return jnp.sum(token_loss_BT * weights_BT), jnp.sum(weights_BT)


def make_grad_fn(apply_fn, *, dropout: bool = False, policy: Policy = POLICIES["fp32"]):
    """``grad_fn(params, batch, key, normalizer, loss_scale) -> ((loss, weight_sum), grads)``.

    The loss is ``sum(weights * token_loss) / normalizer``, computed in float32 from logits in the
    policy's output dtype; the model runs on parameters cast to the compute dtype. The caller
    passes the weight sum of the whole global batch as ``normalizer``, so losses and gradients of
    parts of a batch add up to those of the whole: the property gradient accumulation rests on.
    The gradients are those of ``loss_scale.scale_loss(loss)`` (still scaled), in the parameters'
    dtype.
    """

    def loss_fn(params, batch, key, normalizer, loss_scale):
        logits_BTV = apply_fn(policy.cast_to_compute(params), batch, key if dropout else None)
        loss_sum, weight_sum = weighted_cross_entropy(policy.cast_to_output(logits_BTV),
                                                      batch["targets"], batch["weights"])
        loss = loss_sum / normalizer
        return loss_scale.scale_loss(loss), (loss, weight_sum)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def loss_and_grads(params, batch, key, normalizer, loss_scale):
        (_, aux), grads = grad_fn(params, batch, key, normalizer, loss_scale)
        return aux, grads

    return loss_and_grads


def split_microbatches(batch, microbatches: int):
    """``[B, ...]`` leaves to ``[microbatches, B / microbatches, ...]``, taking every k-th row.

    Strided rather than contiguous, so that when the batch's rows are split over devices each
    microbatch takes the same share of every device's rows and stays spread over all of them.
    """
    rows = batch["inputs"].shape[0]
    if rows % microbatches:
        raise ConfigError(f"batch of {rows} rows does not split into {microbatches} microbatches; "
                          f"choose --accumulate dividing the batch size")
    return jax.tree.map(
        lambda x: x.reshape(rows // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1),
        batch)


def accumulate_gradients(grad_fn, microbatches: int):
    """Gradient accumulation as a transformation of ``grad_fn`` (same signature).

    The batch is split into ``microbatches`` parts whose gradients ``lax.scan`` sums into one
    gradient-sized accumulator, so only one microbatch's activations are alive at a time. With the
    global ``normalizer`` the result equals the whole batch's loss and gradient. Each microbatch
    gets its own dropout key.
    """
    if microbatches < 1:
        raise ConfigError(f"accumulate must be >= 1, got {microbatches}; fix --accumulate")
    if microbatches == 1:
        return grad_fn

    def accumulated(params, batch, key, *args):
        def add_microbatch(carry, index_and_batch):
            index, microbatch = index_and_batch
            (loss, weight_sum), grads = grad_fn(params, microbatch, jax.random.fold_in(key, index),
                                                *args)
            total_loss, total_weight, total_grads = carry
            return (total_loss + loss, total_weight + weight_sum,
                    jax.tree.map(jnp.add, total_grads, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                 jax.tree.map(jnp.zeros_like, params))
        parts = (jnp.arange(microbatches), split_microbatches(batch, microbatches))
        (loss, weight_sum, grads), _ = jax.lax.scan(add_microbatch, zeros, parts)
        return (loss, weight_sum), grads

    return accumulated


def make_train_step(apply_fn, optimizer: optax.GradientTransformation, schedule=None, *,
                    dropout: bool = False, accumulate: int = 1,
                    policy: Policy = POLICIES["fp32"]):
    """Build the pure ``train_step(state, batch) -> (state, metrics)``.

    ``schedule(step)``, when given, puts the learning rate into the metrics.
    ``accumulate`` > 1 computes the gradient over that many microbatches of the batch. The loss
    scale lives in the state: with a ``NoLossScale`` every step updates (non-finite steps are
    only counted); with a static or dynamic scale a non-finite step changes nothing but the
    scale and the skip count. The finiteness test reduces the global gradient, so under a
    sharded jit every device takes the same decision.
    """
    grad_fn = accumulate_gradients(make_grad_fn(apply_fn, dropout=dropout, policy=policy),
                                   accumulate)

    def train_step(state: TrainState, batch):
        key = jax.random.fold_in(state.rng, state.step)
        normalizer = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)
        (loss, real_tokens), scaled_grads = grad_fn(state.params, batch, key, normalizer,
                                                    state.loss_scale)
        grads = state.loss_scale.unscale(scaled_grads)
        finite = all_finite(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if not isinstance(state.loss_scale, NoLossScale):
            params, opt_state = select_tree(finite, (params, opt_state),
                                            (state.params, state.opt_state))
        loss_scale = state.loss_scale.adjust(finite)
        metrics = {
            "loss": loss,
            "real_tokens": real_tokens,
            "padded_tokens": jnp.sum(batch["segment_ids"] == 0),
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "loss_scale": state.loss_scale.loss_scale,
            "skipped_steps": loss_scale.skipped_steps,
        }
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                                  loss_scale=loss_scale)
        return new_state, metrics

    return train_step


def make_eval_step(apply_fn, policy: Policy = POLICIES["fp32"]):
    """Build ``eval_step(state, batch) -> {"loss_sum", "weight_sum"}``; sums add up across batches."""

    def eval_step(state: TrainState, batch):
        logits_BTV = apply_fn(policy.cast_to_compute(state.params), batch, None)
        loss_sum, weight_sum = weighted_cross_entropy(policy.cast_to_output(logits_BTV),
                                                      batch["targets"], batch["weights"])
        return {"loss_sum": loss_sum, "weight_sum": weight_sum}

    return eval_step
