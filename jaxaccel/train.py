"""The training state and the pure step functions.

``train_step(state, batch) -> (state, metrics)`` and ``eval_step(state, batch) -> metrics`` are
pure functions of pytrees, built once from the model's apply function and the optimizer. The
caller jits them (with donation of the state) and shards them.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct


@struct.dataclass
class TrainState:
    """Everything a step reads and writes; orbax saves and restores it whole."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array


def init_state(params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    return TrainState(params=params, opt_state=optimizer.init(params),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(seed))


def weighted_cross_entropy(logits_BTV, targets_BT, weights_BT):
    """Returns (sum of weighted token losses, sum of weights), both float32."""
    token_loss_BT = optax.softmax_cross_entropy_with_integer_labels(
        logits_BTV.astype(jnp.float32), targets_BT)
    weights_BT = weights_BT.astype(jnp.float32)
    return jnp.sum(token_loss_BT * weights_BT), jnp.sum(weights_BT)


def make_loss_fn(apply_fn, *, dropout: bool = False):
    """``loss_fn(params, batch, key) -> (mean loss, weight sum)``: the DESIGN.md weighted loss."""

    def loss_fn(params, batch, key):
        logits_BTV = apply_fn(params, batch, key if dropout else None)
        loss_sum, weight_sum = weighted_cross_entropy(logits_BTV, batch["targets"], batch["weights"])
        return loss_sum / jnp.maximum(weight_sum, 1.0), weight_sum

    return loss_fn


def make_train_step(apply_fn, optimizer: optax.GradientTransformation, schedule, *,
                    dropout: bool = False):
    """Build the pure ``train_step(state, batch) -> (state, metrics)``."""
    grad_fn = jax.value_and_grad(make_loss_fn(apply_fn, dropout=dropout), has_aux=True)

    def train_step(state: TrainState, batch):
        key = jax.random.fold_in(state.rng, state.step)
        (loss, real_tokens), grads = grad_fn(state.params, batch, key)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "real_tokens": real_tokens,
            "padded_tokens": jnp.sum(batch["segment_ids"] == 0),
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(state.step),
        }
        new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
        return new_state, metrics

    return train_step


def make_eval_step(apply_fn):
    """Build ``eval_step(state, batch) -> {"loss_sum", "weight_sum"}``; sums add up across batches."""

    def eval_step(state: TrainState, batch):
        logits_BTV = apply_fn(state.params, batch, None)
        loss_sum, weight_sum = weighted_cross_entropy(logits_BTV, batch["targets"], batch["weights"])
        return {"loss_sum": loss_sum, "weight_sum": weight_sum}

    return eval_step
