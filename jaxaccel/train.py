"""The training state and the pure step, composed from transformations.

``make_train_step(grad_fn, optimizer)`` is the whole step, pure, for the caller to jit (donating
the state) and shard; ``grad_fn`` is any gradient function of ``jaxaccel.grads``. For a language
model ``lm_train_step`` composes it (the one place where settings become transformations):

    loss_fn = lm_loss(precision.cast(model.make_apply(graphdef), policy))  # bf16 model, f32 loss
    grad_fn = grads.accumulate(grads.value_and_grad(loss_fn), 4, weight="real_tokens")
    step = make_train_step(grad_fn, optimizer)
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxaccel import grads, precision
from jaxaccel.sampling import row_scores


@struct.dataclass
class TrainState:
    """Everything a step reads and writes; orbax saves and restores it whole."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    loss_scale: precision.LossScale


def weighted_cross_entropy(logits_BTV, targets_BT, weights_BT):
    """Returns (sum of weighted token losses, sum of weights), both float32."""
    token_loss_BT = optax.softmax_cross_entropy_with_integer_labels(
        logits_BTV.astype(jnp.float32), targets_BT)
    weights_BT = weights_BT.astype(jnp.float32)
    return jnp.sum(token_loss_BT * weights_BT), jnp.sum(weights_BT)


def lm_loss(apply_fn, *, sampling: str = "uniform", stats=None):
    """The language-model loss of a Batch: ``loss_fn(params, batch, key) -> (loss, aux)``.

    ``loss``: the float32 mean cross entropy over the real tokens (``sum(weights * token_loss) /
    sum(weights)``); ``aux``: ``real_tokens`` (the weight sum) and ``padded_tokens``. With
    importance ``sampling`` the weights carry each row's importance weight, the loss is divided
    by the real-token count (then ``real_tokens``) and ``aux["rows"]`` holds each row's score
    sum. ``stats(params, logits_BTV, batch)`` (``nn.loss_stats``) goes to ``aux["buffer_stats"]``
    (what the model's buffers are updated from: token dropping's per-id losses).
    """

    def loss_fn(params, batch, key):
        logits_BTV = apply_fn(params, batch, key)
        loss_sum, weight_sum = weighted_cross_entropy(logits_BTV, batch["targets"],
                                                      batch["weights"])
        aux = {"real_tokens": weight_sum,
               "padded_tokens": jnp.sum(batch["segment_ids"] == 0).astype(jnp.float32)}
        if stats is not None:
            aux[BUFFER_STATS] = stats(params, logits_BTV, batch)
        if sampling != "uniform":
            real_tokens = jnp.sum(batch["weights"] > 0).astype(jnp.float32)
            aux |= {"real_tokens": real_tokens, grads.ROWS: row_scores(logits_BTV, batch, sampling)}
            return loss_sum / jnp.maximum(real_tokens, 1.0), aux
        return loss_sum / jnp.maximum(weight_sum, 1.0), aux

    return loss_fn


# aux entry of a technique's additive statistics, which feed the model's buffers, not metrics.
BUFFER_STATS = "buffer_stats"


def make_train_step(grad_fn, optimizer: optax.GradientTransformation, schedule=None, *,
                    trainable=None, update_buffers=None):
    """Build the pure ``train_step(state, batch) -> (state, metrics)``.

    Step keys are ``fold_in(state.rng, state.step)``; the state's loss scale scales the backward
    pass. With ``NoLossScale`` every step updates; with a static or dynamic scale a step whose
    global gradient is not finite changes only the scale and the skip count
    (``precision.skip_nonfinite``), alike on every device. Metrics: ``grad_fn``'s aux and, given
    ``schedule``, the learning rate. With ``trainable`` (an NNX filter) ``grad_fn`` returns that
    part's gradients and the rest passes through bit for bit. ``update_buffers(params, step,
    stats)`` (``nn.updater``) updates the buffers after the optimizer from the aux entries
    ``observed_max`` and ``buffer_stats``, which leave the metrics.
    """
    scaled_grad_fn = precision.loss_scaled(grad_fn)
    always = optax.with_extra_args_support(optimizer)
    skipping = precision.skip_nonfinite(optimizer)

    def train_step(state: TrainState, batch):
        key = jax.random.fold_in(state.rng, state.step)
        (loss, aux), grads_, loss_scale = scaled_grad_fn(state.params, batch, key,
                                                         state.loss_scale)
        aux = dict(aux)
        finite = aux.pop("grads_finite")
        stats = {k: aux.pop(k) for k in (grads.OBSERVED_MAX, BUFFER_STATS) if k in aux}
        update = always if isinstance(state.loss_scale, precision.NoLossScale) else skipping
        train, _, frozen = grads.partition(state.params, trainable)
        updates, opt_state = update.update(grads_, state.opt_state, train, grads_finite=finite)
        params = grads.combine(optax.apply_updates(train, updates), frozen)
        if update_buffers is not None:
            params = update_buffers(params, state.step, stats)
        metrics = {"loss": loss, **aux, "grad_norm": optax.tree.norm(grads_),
                   "update_norm": optax.tree.norm(updates),
                   "loss_scale": state.loss_scale.loss_scale,
                   "skipped_steps": loss_scale.skipped_steps}
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        return state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                             loss_scale=loss_scale), metrics

    return train_step


def make_eval_step(apply_fn):
    """``eval_step(state, batch) -> {"loss_sum", "weight_sum"}``; sums add up across batches."""

    def eval_step(state: TrainState, batch):
        logits_BTV = apply_fn(state.params, batch, None)
        loss_sum, weight_sum = weighted_cross_entropy(logits_BTV, batch["targets"],
                                                      batch["weights"])
        return {"loss_sum": loss_sum, "weight_sum": weight_sum}

    return eval_step


def lm_train_step(apply_fn, optimizer, schedule=None, *, policy=precision.POLICIES["fp32"],
                  accumulate: int = 1, trainable=None, observed=None, update_buffers=None,
                  stats=None, sampling: str = "uniform"):
    """The train step of a language model (``model.make_apply``): the model under ``policy``,
    the token-mean loss, ``accumulate`` microbatches weighted by their real tokens, the loss
    reweighted for ``sampling``; ``trainable``, ``observed`` and ``update_buffers`` as in
    ``make_train_step`` and ``grads.value_and_grad``. Every trainer builds its step here, so a
    setting cannot reach one step and miss another."""
    loss_fn = lm_loss(precision.cast(apply_fn, policy), sampling=sampling, stats=stats)
    grad_fn = grads.accumulate(
        grads.value_and_grad(loss_fn, trainable=trainable, observed=observed), accumulate,
        weight="real_tokens")
    return make_train_step(grad_fn, optimizer, schedule, trainable=trainable,
                           update_buffers=update_buffers)


def lm_eval_step(apply_fn, policy=precision.POLICIES["fp32"]):
    """The evaluation step of a language model under ``policy``."""
    return make_eval_step(precision.cast(apply_fn, policy))
