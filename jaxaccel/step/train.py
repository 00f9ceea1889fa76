"""The training state and the pure step, composed from transformations.

``make_train_step(grad_fn, optimizer)`` is the whole step, pure, for the caller to jit (donating
the state) and shard; ``grad_fn`` is any gradient function of ``jaxaccel.step.grads``. For a
language model ``lm_train_step`` composes it (the one place where settings become transformations):

    loss_fn = lm_loss(precision.cast(model.make_apply(graphdef), policy))  # bf16 model, f32 loss
    grad_fn = grads.accumulate(grads.value_and_grad(loss_fn), 4, weight="real_tokens")
    step = make_train_step(grad_fn, optimizer)
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxaccel.step import grads, precision
from jaxaccel.model import nn
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.sampling import row_scores


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
        found = None if stats is None else stats(params, logits_BTV, batch)
        if found is not None:
            aux[BUFFER_STATS] = found
        if sampling != "uniform":
            real_tokens = jnp.sum(batch["weights"] > 0).astype(jnp.float32)
            aux |= {"real_tokens": real_tokens, grads.ROWS: row_scores(logits_BTV, batch, sampling)}
            return loss_sum / jnp.maximum(real_tokens, 1.0), aux
        return loss_sum / jnp.maximum(weight_sum, 1.0), aux

    return loss_fn


# aux entry of a technique's additive statistics, which feed the model's buffers, not metrics.
BUFFER_STATS = "buffer_stats"

# lm_train_step's default ``update_buffers`` and ``stats``: the model's own (``nn.updater``,
# ``nn.loss_stats``), found when the step is traced from the graph model.make_apply's function
# carries (``apply_fn.graphdef``, kept by precision.cast); None passes none.
AUTO = "auto"


def model_updater(graphdef):
    """``update_buffers`` of the model ``graphdef`` describes: its ``nn.updater`` applied to the
    state the step gives it (the state unchanged when no module updates buffers)."""

    def update(params, step, stats):
        found = nn.updater(nnx.merge(graphdef, params))
        return params if found is None else found(params, step, stats)

    return update


def model_stats(graphdef):
    """``stats`` of the model ``graphdef`` describes: its ``nn.loss_stats``, or None."""

    def stats(params, logits_BTV, batch):
        found = nn.loss_stats(nnx.merge(graphdef, params))
        return None if found is None else found(params, logits_BTV, batch)

    return stats


def unknown_updater(params, step, stats):
    """``update_buffers`` where the model's is unknown: refuses a state that holds buffers."""
    held = [v for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
            if isinstance(v, nn.Buffer)]
    if held:
        kinds = sorted({type(v).__name__ for v in held})
        raise ConfigError(
            f"the model's state holds {len(held)} technique buffers ({', '.join(kinds)}) that "
            f"only its update_buffers keeps current, and lm_train_step cannot find it: apply_fn "
            f"is not model.make_apply's (nor precision.cast of it); pass "
            f"update_buffers=nn.updater(model) (or None to leave them unchanged)")
    return params


def make_train_step(grad_fn, optimizer: optax.GradientTransformation, schedule=None, *,
                    trainable=None, update_buffers=None):
    """Build the pure ``train_step(state, batch) -> (state, metrics)``.

    Step keys are ``fold_in(state.rng, state.step)``; the state's loss scale scales the backward
    pass. With a static or dynamic scale a step whose global gradient is not finite changes
    only the scale and its skip count (``precision.skip_nonfinite``), alike on every device; with
    ``NoLossScale`` (fp32, bf16) every step is applied, as without a loss scale anywhere (a
    non-finite one makes the parameters NaN: the loop stops on the loss as diverged), and none
    is counted as skipped. The select a skip needs holds the old and the new optimizer state at
    once, which fp32 and bf16 steps do not pay. Metrics: ``grad_fn``'s aux and, given
    ``schedule``, the learning rate. With ``trainable`` (an
    NNX filter; for a model's state by default ``nn.trainable``, ``grads.partition``)
    ``grad_fn`` returns that part's gradients and the rest passes through bit for bit.
    ``update_buffers(params, step, stats)`` (``nn.updater``) updates the buffers after the
    optimizer from the aux entries ``observed_max`` and ``buffer_stats``, which leave the
    metrics; a skipped step updates none.
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
        skips = not isinstance(state.loss_scale, precision.NoLossScale)
        train, _, frozen = grads.partition(state.params, trainable)
        updates, opt_state = (skipping if skips else always).update(
            grads_, state.opt_state, train, grads_finite=finite)
        params = grads.combine(optax.apply_updates(train, updates), frozen)
        if update_buffers is not None:      # not from a skipped step's amaxes or losses
            # its Variables: the updates write in place, so a skipping step keeps a copy first
            kept = jax.tree.map(lambda x: x, params) if skips else None
            updated = update_buffers(params, state.step, stats)
            if skips and updated is not params:     # (a model without buffers: itself)
                params = precision.select_tree(finite, updated, kept)
            else:
                params = updated
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
                  accumulate: int = 1, trainable=None, observed=None, update_buffers=AUTO,
                  stats=AUTO, sampling: str = "uniform"):
    """The train step of a language model (``model.make_apply``): the model under ``policy``,
    the token-mean loss, ``accumulate`` microbatches weighted by their real tokens, the loss
    reweighted for ``sampling``; ``trainable``, ``observed`` and ``update_buffers`` as in
    ``make_train_step`` and ``grads.value_and_grad``. Every trainer builds its step here, so a
    setting cannot reach one step and miss another.

    Unset, each is what the loop passes for the model: ``trainable`` ``nn.trainable(state)``,
    ``observed`` ``nn.Observation`` where the state holds any, and (``AUTO``) ``update_buffers``
    and ``stats`` the model's ``nn.updater`` and ``nn.loss_stats``, read from the graph of
    ``model.make_apply``'s ``apply_fn``; a state with buffers and another ``apply_fn`` is one
    ConfigError line asking for ``update_buffers``."""
    graphdef = getattr(apply_fn, "graphdef", None)
    if stats == AUTO:
        stats = None if graphdef is None else model_stats(graphdef)
    if update_buffers == AUTO:
        update_buffers = unknown_updater if graphdef is None else model_updater(graphdef)
    loss_fn = lm_loss(precision.cast(apply_fn, policy), sampling=sampling, stats=stats)
    grad_fn = grads.accumulate(
        grads.value_and_grad(loss_fn, trainable=trainable, observed=observed), accumulate,
        weight="real_tokens")
    return make_train_step(grad_fn, optimizer, schedule, trainable=trainable,
                           update_buffers=update_buffers)


def lm_eval_step(apply_fn, policy=precision.POLICIES["fp32"]):
    """The evaluation step of a language model under ``policy``."""
    return make_eval_step(precision.cast(apply_fn, policy))
