"""The initial TrainState: the model's state, optimizer state, step, key and loss scale, made
sharded.

``init_state`` builds it from a model's state (``nnx.State``) on the host's default device;
``init_sharded_state`` creates it directly in its shards over a mesh: the model is built inside a
function jitted with the state's shardings as its outputs, so no device ever holds more than its
shard, and the PRNG key is an argument of that function, not a constant in it (XLA would
otherwise constant-fold the whole random initialisation at compile time, minutes for a
GPT-2-sized model on a GPU). On a GPU that function's threefry hashes are lowered to JAX's own
kernel rather than to XLA's inlined arithmetic: the same bits, and on an H200 its compilation for
GPT-2 small took 3.8 s instead of 47.4 s. The optimizer's state covers what trains
(``nn.trainable``: a filter on the variables' types).
"""

import math

import jax
import jax.numpy as jnp
import optax
from jax._src import config as jax_config     # the threefry lowering switch has no public name

from jaxaccel.model import nn
from jaxaccel.step.grads import partition
from jaxaccel.data.loader import abstract_key
from jaxaccel.step.precision import NoLossScale, Policy
from jaxaccel.core.sharding import param_shardings, state_shardings
from jaxaccel.step.train import TrainState


def init_state(params, optimizer: optax.GradientTransformation, seed: int, loss_scale=None,
               policy: Policy | None = None, trainable=None) -> TrainState:
    """The state at step 0; the variables stored in ``policy.param_dtype`` when given; the
    optimizer's state covers only the ``trainable`` variables (an NNX filter) when given."""
    if policy is not None:
        params = policy.cast_to_param(params)
    return TrainState(params=params, opt_state=optimizer.init(partition(params, trainable)[0]),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(seed),
                      loss_scale=NoLossScale.create() if loss_scale is None else loss_scale)


def init_sharded_state(make_params, optimizer, seed: int, loss_scale, mesh,
                       policy: Policy | None = None, *, axis_rules=None, args=()):
    """The initial TrainState of the model ``make_params(key, *args) -> nnx.State`` builds,
    created in its shards over ``mesh``, and the shardings (a TrainState of NamedShardings)."""
    make_state, _, shardings = state_maker(make_params, optimizer, seed, loss_scale, mesh,
                                           policy, axis_rules, args)
    return create_state(make_state, shardings, seed, args), shardings


def create_state(make_state, shardings, seed: int, args=()):
    """The state ``make_state`` (of ``state_maker``) makes, created in ``shardings``."""
    return compile_init(lower_state(make_state, shardings, seed, args))(
        jax.random.PRNGKey(seed), *args)


# The initialisation runs once, so on a CPU a state of at most this many elements compiles it at
# LLVM's optimisation level 0. Measured on the project's 2-core CPU (2026-11-28): a 1-layer
# 32-wide GPT's compiled in 0.59 s instead of 1.24 (ran in 0.04 s either way), the tiny
# preset's (10 M elements with AdamW's moments) in 1.21 s instead of 1.72, running 0.20 s
# instead of 0.08; GPT-2 small's (370 M) would run 3.8 s instead of 0.73 for 0.9 s less compile.
FAST_INIT_ELEMENTS = 2**25


def compile_init(lowered):
    """``lower_state``'s computation compiled (see ``FAST_INIT_ELEMENTS``)."""
    elements = sum(math.prod(x.shape) for x in jax.tree.leaves(lowered.out_info))
    if jax.default_backend() == "cpu" and elements <= FAST_INIT_ELEMENTS:
        return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    return lowered.compile()


def lower_init(make_params, optimizer, seed: int, loss_scale, mesh, platform: str | None,
               policy: Policy | None = None, *, axis_rules=None, args=()):
    """``init_sharded_state``'s computation lowered for ``platform`` ("cuda", "cpu"; None: the
    default backend's), no device of it needed, and the state's shardings."""
    make_state, _, shardings = state_maker(make_params, optimizer, seed, loss_scale, mesh,
                                           policy, axis_rules, args)
    return lower_state(make_state, shardings, seed, args, platform), shardings


def lower_state(make_state, shardings, seed: int, args=(), platform: str | None = None):
    with jax_config.threefry_gpu_kernel_lowering(True):
        return jax.jit(make_state, out_shardings=shardings).trace(
            abstract_key(), *args).lower(
                lowering_platforms=None if platform is None else (platform,))


def abstract_sharded_state(make_params, optimizer, seed: int, loss_scale, mesh,
                           policy: Policy | None = None, *, axis_rules=None, args=()):
    """The shapes of ``init_sharded_state``'s state (nothing computed) and its shardings."""
    _, abstract_state, shardings = state_maker(make_params, optimizer, seed, loss_scale, mesh,
                                               policy, axis_rules, args)
    return abstract_state, shardings


def state_maker(make_params, optimizer, seed, loss_scale, mesh, policy, axis_rules, args=()):
    """``(make_state(key, *args), its state's shapes, their shardings)``: traced once here for
    the shapes; ``create_state`` makes the state."""
    def make_state(key, *args):
        params = make_params(key, *args)
        return init_state(params, optimizer, seed, loss_scale, policy, nn.trainable(params))

    abstract_state = jax.eval_shape(make_state, abstract_key(), *args)
    shardings = state_shardings(mesh, abstract_state,
                                param_shardings(mesh, abstract_state.params, axis_rules))
    return make_state, abstract_state, shardings
