"""Pipeline parallelism: the stacked blocks split into stages over the mesh's ``stage`` axis, the
batch into microbatches that flow through the stages on a schedule.

The model's blocks must be a scanned ``nn.Stack`` (``--scan-layers``); stage s of S holds layers
``s * L/S .. (s+1) * L/S - 1`` and their optimizer state. The model is cut at its stack
(``model.parts``): the embedding runs on the first stage, the final norm, head and loss on the
last, a microbatch at a time. Their weights are replicated over ``stage`` (one SPMD program
cannot give stages shards of different shapes), their gradients summed over stages. Only
``stage`` is a manual axis (``jax.shard_map``; within a stage the usual constraints split the
blocks over the other axes); activations go on and gradients back by ``lax.ppermute``.

A schedule is two tables, ``forward[t, s]`` and ``backward[t, s]``: the microbatch stage s runs
at tick t, or -1; ``lax.switch`` picks the branch (idle, first, middle or last stage), so idle
slots cost nothing. A stage keeps the *input* of each microbatch run forward and not yet
backward; its backward recomputes the forward from it inside ``jax.vjp``. The first stage keeps
nothing (it re-embeds the ids); the last runs no separate forward: its backward computes its
blocks, the head and the loss, seeded with ``scale / real tokens of the batch``.

- ``gpipe`` (Huang et al. 2019): all forwards, then all backwards; a stage after the first keeps
  M inputs.
- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): a microbatch goes backward on the last
  stage in the tick it arrives, so stage s keeps at most 2(S - 1 - s) + 1 inputs (2(S - 2) + 1
  on stage 1) for any M: in lockstep ticks, more than an asynchronous 1F1B's S - s.

Both idle (S - 1) / (M + S - 1) of the step (``bubble_fraction``). Gradients, loss and aux equal
``grads.accumulate``'s over the same microbatches with ``weight="real_tokens"``.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxaccel.step import grads as grads_lib
from jaxaccel.model import nn
from jaxaccel.core.errors import ConfigError
from jaxaccel.model.contract import join_at, parts as model_parts, split_at, stack_of
from jaxaccel.step.precision import POLICIES, Policy, computing_in
from jaxaccel.core.sections import PIPELINE_SCHEDULES as SCHEDULES     # declared without jax
from jaxaccel.core.sharding import constrain
from jaxaccel.step.train import weighted_cross_entropy

AXIS = "stage"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which microbatch each stage runs forward and backward at each tick (-1: none), and how
    many stage inputs a stage keeps at once (``slots``)."""

    name: str
    stages: int
    microbatches: int
    forward: np.ndarray        # [ticks, S]
    backward: np.ndarray       # [ticks, S]
    slots: int

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]


def check(name: str, stages: int, microbatches: int) -> None:
    """One clear line if the schedule cannot run ``microbatches`` over ``stages``."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of "
                          f"{', '.join(SCHEDULES)}", field="mesh.pipeline_schedule")
    if name == "1f1b" and microbatches < stages:
        raise ConfigError(
            f"1f1b needs at least as many microbatches as pipeline stages, got accumulate="
            f"{microbatches} for {stages} stages; set accumulate to {stages} or more (or use "
            f"the gpipe schedule)", field="optimizer.accumulate")


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The tick tables of ``name`` for S stages and M microbatches (see the module docstring)."""
    check(name, stages, microbatches)
    S, M = stages, microbatches
    stage = np.arange(S)
    if name == "gpipe":
        # Forwards at m + s; the last stage starts backward as its last input arrives (tick
        # M + S - 2) and the gradients flow back one stage per tick.
        ticks = 2 * M + 2 * S - 3
        backward_tick = lambda m: M + S - 2 + (S - 1 - stage) + m           # noqa: E731
    else:
        # Microbatch m reaches the last stage at m + S - 1 and goes backward there at once.
        ticks = M + 2 * S - 2
        backward_tick = lambda m: m + 2 * (S - 1) - stage                    # noqa: E731
    forward = np.full((ticks, S), -1, np.int32)
    backward = np.full((ticks, S), -1, np.int32)
    for m in range(M):
        forward[m + stage, stage] = m
        backward[backward_tick(m), stage] = m
    # The first stage recomputes from the token ids and keeps no inputs.
    slots = int(max([1] + [_peak_alive(forward[:, s], backward[:, s]) for s in range(1, S)]))
    return Schedule(name, S, M, forward, backward, slots)


def _peak_alive(forward, backward) -> int:
    """The most microbatches run forward and not yet backward at once (both counted in the tick
    where they meet, since the forward stores before the backward reads)."""
    alive = peak = 0
    for f, b in zip(forward, backward):
        alive += f >= 0
        peak = max(peak, alive)
        alive -= b >= 0
    return peak


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a pipelined step: (S - 1) / (M + S - 1), for both schedules."""
    return (stages - 1) / (microbatches + stages - 1)


def _stage_kinds(stages: int):
    """(first, last) of each stage kind: 0 stage 0, 1 the middle ones, 2 the last (or one: both)."""
    return ((True, True),) if stages == 1 else ((True, False), (False, False), (False, True))


def _stage_function(parts, policy, mbs, keys, frozen, frozen_layers, total_layers):
    """``stage_fn(kind, stage_layers, rest, x_BTD, m, first_layer)``: stage ``kind`` (first?,
    last?) on microbatch m of ``mbs``: the model up to its stack on the first (``x_BTD`` unused),
    the stage's layers, and on the last what follows the stack, returning the summed token loss
    and weight. ``frozen`` and ``frozen_layers``: the variables outside the stack and of the
    stage's layers that are not differentiated (RNG streams, say)."""

    def stage_fn(kind, stage_layers, rest, x_BTD, m, first_layer):
        first, last = kind
        mb = _select(mbs, m)
        state = join_at(grads_lib.combine(rest, frozen), (*parts.stack_path, "layers"),
                        grads_lib.combine(stage_layers, frozen_layers))
        embedded, token_args = parts.embed(state, mb)
        if first:
            x_BTD = embedded
        key = None if keys is None else keys[m]
        y_BTD = parts.blocks(stack_of(state, parts.stack_path), x_BTD, token_args, mb, key,
                             first_layer, total_layers)
        if not last:
            return y_BTD
        logits_BTV = policy.cast_to_output(parts.head(state, mb, y_BTD))
        return weighted_cross_entropy(logits_BTV, mb["targets"], mb["weights"])

    return stage_fn


def stage_count() -> int:
    """The size of the ``stage`` axis of the mesh in context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or AXIS not in mesh.axis_names else mesh.shape[AXIS]


def _position(stages: int):
    """This stage's index and kind (an index into ``_stage_kinds``), inside ``_on_stages``."""
    if stages == 1:
        return 0, 0
    s = jax.lax.axis_index(AXIS)
    return s, jnp.minimum(s, 1) + (s == stages - 1)


def _on_stages(run, stages: int, in_specs, out_specs):
    """``run`` once per stage, manual over ``stage`` only; ``run`` itself for a single stage."""
    if stages == 1:
        return run
    return jax.shard_map(run, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS},
                         check_vma=False)


def _zeros_like(tree, dtype=None):
    """Zeros of each leaf's shape and sharding (its type, under Explicit axes)."""
    return jax.tree.map(lambda x: jnp.zeros_like(x, dtype=dtype or x.dtype), tree)


def _add(total, part):
    return jax.tree.map(lambda t, p: t + p.astype(t.dtype), total, part)


def _select(tree, index):
    return jax.tree.map(lambda x: x[index], tree)


def _shift(x, stages, direction):
    """``x`` sent one stage on (+1) or back (-1); the end that receives nothing gets zeros."""
    pairs = [(s, s + direction) for s in range(stages) if 0 <= s + direction < stages]
    return jax.lax.ppermute(x, AXIS, pairs) if pairs else jnp.zeros_like(x)


def _scanned_stack(model):
    """The model's stack; ConfigError unless it is scanned."""
    _, stack = nn.the_stack(model, "pipeline parallelism", "mesh.strategy")
    if not stack.scanned:
        raise ConfigError("pipeline stages split the stacked blocks, but the stack is not "
                          "scanned; turn scan_layers on", field="remat.scan_layers")
    return stack


def check_layers(model, stages: int) -> None:
    """One clear line if the model's layers do not split evenly over the stages."""
    layers = len(_scanned_stack(model))
    if layers < stages or layers % stages:
        raise ConfigError(f"the model's {layers} layers do not split evenly over {stages} "
                          f"pipeline stages; choose a stage count (mesh stage=N) dividing "
                          f"{layers}", field="mesh.shape")


def pipeline_grad_fn(model, microbatches: int, schedule: str = "gpipe", *,
                     policy: Policy = POLICIES["fp32"], trainable=None):
    """The gradient function (``jaxaccel.step.grads`` signature) of ``model``'s (abstract or not)
    language-model loss, its stack pipelined over the mesh's ``stage`` axis, ``microbatches`` per
    step, differentiating the ``trainable`` variables (an NNX filter; the others are constants).
    Loss, aux and gradients are ``accumulate(value_and_grad(lm_loss(cast(apply, policy))),
    microbatches, weight="real_tokens")``'s, with its keys (``fold_in(key, i)``)."""
    total_layers = len(_scanned_stack(model))
    graphdef, abstract_state = nnx.split(model)
    parts = model_parts(graphdef, abstract_state)
    layers_at = (*parts.stack_path, "layers")
    check(schedule, 1, microbatches)

    def grad_fn(params, batch, key, *, scale=None):
        stages = stage_count()
        mbs = grads_lib.split_microbatches(batch, microbatches)
        keys = (key[None] if microbatches == 1 else
                jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(microbatches)))
        real_tokens = jnp.sum(batch["weights"].astype(jnp.float32))
        seed = (1.0 if scale is None else scale) / jnp.maximum(real_tokens, 1.0)
        train, _, frozen = grads_lib.partition(params, trainable)
        rest, blocks = split_at(policy.cast_to_compute(train), layers_at)
        frozen, frozen_blocks = split_at(policy.cast_to_compute(frozen), layers_at)
        x_spec, _ = jax.eval_shape(parts.embed, policy.cast_to_compute(params), _select(mbs, 0))
        pipe = _GradPipe(parts, policy, total_layers, stages,
                         make_schedule(schedule, stages, microbatches), x_spec, frozen)

        def run(stage_blocks, stage_frozen, rest, seed, mbs, keys):
            return _stage_grads(pipe, stage_blocks, stage_frozen, rest, seed, mbs, keys)

        staged = _on_stages(run, stages, in_specs=(P(AXIS), P(AXIS), P(), P(), P(), P()),
                            out_specs=(P(), P(), P(AXIS)))
        loss_sum, d_rest, d_blocks = staged(blocks, frozen_blocks, rest, seed, mbs, keys)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), join_at(d_rest, layers_at, d_blocks),
                             train)
        loss = loss_sum / jnp.maximum(real_tokens, 1.0)
        aux = {"real_tokens": real_tokens,
               "padded_tokens": jnp.sum(batch["segment_ids"] == 0).astype(jnp.float32)}
        return (loss, aux), grads

    return _computing_in(grad_fn, policy)


@dataclasses.dataclass(frozen=True)
class _GradPipe:
    """What every stage's program of one pipelined gradient step shares (``_stage_grads``)."""

    parts: object
    policy: Policy
    total_layers: int
    stages: int
    plan: Schedule
    x_spec: jax.ShapeDtypeStruct    # the activations passed between stages: [B, T, ...]
    frozen: dict                    # the variables outside the stack not differentiated

    @property
    def x_axes(self) -> tuple:
        return ("batch", "seq", *(None,) * (len(self.x_spec.shape) - 2))


def _stage_grads(pipe: _GradPipe, stage_blocks, stage_frozen, rest, seed, mbs, keys):
    """One stage's program (run by ``_on_stages``): the schedule's ticks, each running a
    microbatch forward and one backward (or idling); (the loss summed over the batch's tokens,
    the gradients of what is outside the stack, both summed over the stages, and those of this
    stage's layers)."""
    plan, stages = pipe.plan, pipe.stages
    stage_fn = _stage_function(pipe.parts, pipe.policy, mbs, keys, pipe.frozen, stage_frozen,
                               pipe.total_layers)
    s, kind = _position(stages)
    first_layer = s * (pipe.total_layers // stages)
    forward, backward = jnp.asarray(plan.forward), jnp.asarray(plan.backward)
    x0 = constrain(jnp.zeros(pipe.x_spec.shape, pipe.x_spec.dtype), pipe.x_axes)
    carry = dict(sent=x0, returned=x0,
                 inputs=constrain(jnp.zeros((plan.slots, *pipe.x_spec.shape), x0.dtype),
                                  (None, *pipe.x_axes)),
                 d_blocks=_zeros_like(stage_blocks, jnp.float32),
                 d_rest=_zeros_like(rest, jnp.float32),
                 loss_sum=jnp.zeros((), jnp.float32))
    forwards, backwards = _grad_branches(stage_fn, _stage_kinds(stages), stage_blocks, rest,
                                         seed, first_layer, x0)

    def tick(carry, t):
        f, b = forward[t, s], backward[t, s]
        # Forward: what the previous stage sent (the first stage embeds its own
        # microbatch), kept for the backward and passed on.
        mf = jnp.maximum(f, 0)
        y = jax.lax.switch(jnp.where(f >= 0, 1 + kind, 0), forwards, carry["sent"], mf)
        slot = mf % plan.slots
        inputs = carry["inputs"].at[slot].set(
            jnp.where(f >= 0, carry["sent"], carry["inputs"][slot]))
        # Backward: recompute from the kept input and pull the gradient through.
        mb = jnp.maximum(b, 0)
        loss, d_blocks, d_rest, d_x = jax.lax.switch(
            jnp.where(b >= 0, 1 + kind, 0), backwards, inputs[mb % plan.slots], mb,
            carry["returned"], carry["d_blocks"], carry["d_rest"])
        new = dict(sent=_shift(y, stages, +1), returned=_shift(d_x, stages, -1),
                   inputs=inputs, d_blocks=d_blocks, d_rest=d_rest,
                   loss_sum=carry["loss_sum"] + loss)
        return new, None

    carry, _ = jax.lax.scan(tick, carry, jnp.arange(plan.ticks))
    # The embedding's gradient is on the first stage, the head's and the loss on the last.
    total = (carry["loss_sum"], carry["d_rest"])
    if stages > 1:
        total = jax.lax.psum(total, AXIS)
    return (*total, carry["d_blocks"])


def _grad_branches(stage_fn, kinds, stage_blocks, rest, seed, first_layer: int, x0):
    """The branches ``lax.switch`` picks from in a tick: idle, then one per stage kind. Forward:
    ``(x, m) -> y``; backward: ``(x, m, returned, d_blocks, d_rest) -> (loss, d_blocks, d_rest,
    d_x)``, ``returned`` the gradient the next stage sent back."""

    def run_forward(k):
        return lambda x, m: stage_fn(kinds[k], stage_blocks, rest, x, m, first_layer)

    def idle_forward(x, m):
        return x0

    # A backward branch adds its gradients to the running sums it is given; a stage without
    # such gradients (idle, or a middle one's for embedding and head) passes them through.
    def run_backward(k):
        first, last = kinds[k]

        def pull(x, m, returned, d_blocks, d_rest):
            out, vjp = jax.vjp(
                lambda sb, r, x: stage_fn(kinds[k], sb, r, x, m, first_layer),
                stage_blocks, rest, x)
            if last:       # the loss, seeded
                loss = out[0]
                d_blocks_mb, d_rest_mb, d_x = vjp((seed.astype(loss.dtype),
                                                   jnp.zeros_like(out[1])))
            else:
                loss = jnp.zeros((), jnp.float32)
                d_blocks_mb, d_rest_mb, d_x = vjp(returned.astype(out.dtype))
            if first or last:
                d_rest = _add(d_rest, d_rest_mb)
            return loss, _add(d_blocks, d_blocks_mb), d_rest, d_x
        return pull

    def idle_backward(x, m, returned, d_blocks, d_rest):
        return jnp.zeros((), jnp.float32), d_blocks, d_rest, x0

    # Branches: idle, then one per kind (the last stage computes nothing forward yet).
    forwards = [idle_forward] + [idle_forward if last else run_forward(k)
                                 for k, (_, last) in enumerate(kinds)]
    backwards = [idle_backward] + [run_backward(k) for k in range(len(kinds))]
    return forwards, backwards


def _computing_in(fn, policy: Policy):
    """``fn`` with the model's flax layers computing in the policy's dtype, as ``precision.cast``
    makes a model's apply."""

    @functools.wraps(fn)
    def in_policy(*args, **kwargs):
        with computing_in(policy):
            return fn(*args, **kwargs)

    return in_policy


def pipeline_eval_fn(model, microbatches: int, *, policy: Policy = POLICIES["fp32"]):
    """``eval_step(state, batch) -> {"loss_sum", "weight_sum"}`` (``train.make_eval_step``'s
    contract), pipelined: each microbatch forward, one stage per tick, the last summing the loss."""
    total_layers = len(_scanned_stack(model))
    graphdef, abstract_state = nnx.split(model)
    parts = model_parts(graphdef, abstract_state, segment_attention=False)

    def eval_step(state, batch):
        stages = stage_count()
        layers = total_layers // stages
        mbs = grads_lib.split_microbatches(batch, microbatches)
        params = policy.cast_to_compute(state.params)
        rest, blocks = split_at(params, (*parts.stack_path, "layers"))
        kinds = _stage_kinds(stages)
        x_spec, _ = jax.eval_shape(parts.embed, params, _select(mbs, 0))
        x_axes = ("batch", "seq", *(None,) * (len(x_spec.shape) - 2))

        def run(stage_blocks, rest, mbs):
            stage_fn = _stage_function(parts, policy, mbs, None, {}, {}, total_layers)
            s, kind = _position(stages)
            x0 = constrain(jnp.zeros(x_spec.shape, x_spec.dtype), x_axes)
            zero = jnp.zeros((), jnp.float32)

            def branch(k):
                def forward(x, m):
                    out = stage_fn(kinds[k], stage_blocks, rest, x, m, s * layers)
                    return (x0, *out) if kinds[k][1] else (out, zero, zero)
                return forward

            branches = [lambda x, m: (x0, zero, zero)] + [branch(k) for k in range(len(kinds))]

            def tick(carry, t):
                sent, loss_sum, weight_sum = carry
                m = t - s
                y, loss, weight = jax.lax.switch(
                    jnp.where((m >= 0) & (m < microbatches), 1 + kind, 0), branches, sent,
                    jnp.clip(m, 0, microbatches - 1))
                return (_shift(y, stages, +1), loss_sum + loss, weight_sum + weight), None

            (_, loss_sum, weight_sum), _ = jax.lax.scan(
                tick, (x0, zero, zero), jnp.arange(microbatches + stages - 1))
            if stages > 1:
                loss_sum, weight_sum = jax.lax.psum((loss_sum, weight_sum), AXIS)
            return loss_sum, weight_sum

        staged = _on_stages(run, stages, in_specs=(P(AXIS), P(), P()), out_specs=(P(), P()))
        loss_sum, weight_sum = staged(blocks, rest, mbs)
        return {"loss_sum": loss_sum, "weight_sum": weight_sum}

    return _computing_in(eval_step, policy)
