"""The initial TrainState: parameters, optimizer state, step, key and loss scale, made sharded.

``init_state`` builds it from parameters on the host's default device; ``init_sharded_state``
creates it directly in its shards over a mesh: the initialisation is jitted with the state's
shardings as its outputs, so no device ever holds more than its shard, and the PRNG key is an
argument of that function, not a constant in it (XLA would otherwise constant-fold the whole
random initialisation at compile time, minutes for a GPT-2-sized model on a GPU).
"""

import jax
import jax.numpy as jnp
import optax

from jaxaccel.grads import partition
from jaxaccel.lora import trainable as trainable_of
from jaxaccel.model import init_params, param_axes
from jaxaccel.precision import NoLossScale, Policy
from jaxaccel.sharding import param_shardings, state_shardings
from jaxaccel.train import TrainState


def init_state(params, optimizer: optax.GradientTransformation, seed: int, loss_scale=None,
               policy: Policy | None = None, trainable=None) -> TrainState:
    """The state at step 0; the parameters stored in ``policy.param_dtype`` when given; the
    optimizer's state covers only the ``trainable`` parameters when a predicate is given."""
    if policy is not None:
        params = policy.cast_to_param(params)
    return TrainState(params=params, opt_state=optimizer.init(partition(params, trainable)[0]),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(seed),
                      loss_scale=NoLossScale.create() if loss_scale is None else loss_scale)


def init_sharded_state(model_cfg, optimizer, seed: int, loss_scale, mesh,
                       policy: Policy | None = None):
    """The initial TrainState of a GPT, created in its shards over ``mesh``, and the
    shardings (a TrainState of NamedShardings)."""
    make_state, abstract_state, shardings = _state_maker(model_cfg, optimizer, seed, loss_scale,
                                                         mesh, policy)
    return jax.jit(make_state, out_shardings=shardings)(jax.random.PRNGKey(seed)), shardings


def abstract_sharded_state(model_cfg, optimizer, seed: int, loss_scale, mesh,
                           policy: Policy | None = None):
    """The shapes of ``init_sharded_state``'s state (nothing computed) and its shardings."""
    _, abstract_state, shardings = _state_maker(model_cfg, optimizer, seed, loss_scale, mesh,
                                                policy)
    return abstract_state, shardings


def _state_maker(model_cfg, optimizer, seed, loss_scale, mesh, policy):
    def make_state(key):
        return init_state(init_params(model_cfg, key), optimizer, seed, loss_scale, policy,
                          trainable_of(model_cfg))

    abstract_state = jax.eval_shape(make_state, jax.random.PRNGKey(seed))
    shardings = state_shardings(mesh, abstract_state,
                                param_shardings(mesh, param_axes(abstract_state.params)))
    return make_state, abstract_state, shardings
