import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxaccel.techniques import registry as techniques
from jaxaccel.step.compiled import CompiledFn, memory_bytes
from jaxaccel.run.config import TrainConfig, build
from jaxaccel.model.contract import make_apply
from jaxaccel.step.optim import decay_mask, make_optimizer, make_schedule
from jaxaccel.step.state import init_state
from jaxaccel.step.train import lm_eval_step, lm_train_step, weighted_cross_entropy


def config(**values):
    """The tiny preset at 1 x 32 (one block: a step compiles faster, and nothing here needs a
    second), context 16, vocabulary 64 (``values``: more settings)."""
    cfg = build(TrainConfig, {"gpt.d_model": 32, "gpt.n_layers": 1, "gpt.n_heads": 4,
                              "model.max_seq_len": 16, **values})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=64))


CFG = config()


def init_params(cfg, key):
    """The model's state (every technique of ``cfg`` applied) and its graph."""
    graphdef, state = nnx.split(techniques.build(cfg, key))
    return graphdef, state


def random_batch(seed, B=4, T=16, pad=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 64, (B, T + 1)).astype(np.int32)
    weights = np.ones((B, T), np.float32)
    seg = np.ones((B, T), np.int32)
    if pad:
        weights[:, -pad:] = 0
        seg[:, -pad:] = 0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights,
            "segment_ids": seg, "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}


def make(steps=100, lr=3e-3):
    optimizer = make_optimizer(learning_rate=lr, total_steps=steps, warmup_steps=5)
    schedule = make_schedule("cosine", lr, warmup_steps=5, total_steps=steps)
    graphdef, params = init_params(CFG, jax.random.PRNGKey(0))
    state = init_state(params, optimizer, seed=0)
    apply_fn = make_apply(graphdef)
    return state, lm_train_step(apply_fn, optimizer, schedule), lm_eval_step(apply_fn)


def test_weighted_cross_entropy_ignores_zero_weights():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, 5)), jnp.float32)
    targets = jnp.array([[1, 2, 3]])
    full, _ = weighted_cross_entropy(logits[:, :2], targets[:, :2], jnp.ones((1, 2)))
    masked, count = weighted_cross_entropy(logits, targets, jnp.array([[1.0, 1.0, 0.0]]))
    assert count == 2 and np.isclose(full, masked)


def test_loss_falls_when_overfitting_one_batch():
    state, train_step, eval_step = make()
    step = jax.jit(train_step, donate_argnums=0)
    batch = random_batch(0, pad=3)
    sums = jax.jit(eval_step)(state, batch)
    first = float(sums["loss_sum"] / sums["weight_sum"])
    for _ in range(60):
        state, metrics = step(state, batch)
    assert first > 3.5
    assert float(metrics["loss"]) < 0.5 * first
    assert int(state.step) == 60
    assert float(metrics["real_tokens"]) == 4 * 13 and int(metrics["padded_tokens"]) == 4 * 3
    assert float(metrics["grad_norm"]) > 0 and float(metrics["learning_rate"]) > 0


def test_train_step_is_deterministic():
    state_a, train_step, _ = make()
    state_b, _, _ = make()
    step = jax.jit(train_step)
    for seed in range(3):
        state_a, _ = step(state_a, random_batch(seed))
        state_b, _ = step(state_b, random_batch(seed))
    chex.assert_trees_all_equal(state_a, state_b)


def test_weight_decay_skips_norms_and_embeddings():
    _, params = init_params(CFG, jax.random.PRNGKey(0))
    mask = decay_mask(params)
    assert mask["blocks"]["layers"][0]["attn"]["wq"]["kernel"] is True
    assert mask["blocks"]["layers"][0]["attn_norm"]["scale"] is False
    assert mask["embed"]["embedding"] is False        # an nnx.Embed: weight_decay=False metadata
    assert mask["head"]["kernel"] is True


def test_weight_decay_of_a_scanned_stack_counts_rank_per_layer():
    """Scanned, a norm scale is [layers, d] and a kernel [layers, d, f]: the leading layer axis
    (metadata ``stacked``) does not count, so the mask is the unrolled model's."""
    _, params = init_params(config(**{"remat.scan_layers": True}), jax.random.PRNGKey(0))
    mask = decay_mask(params)
    assert params["blocks"]["layers"]["attn_norm"]["scale"].ndim == 2
    assert mask["blocks"]["layers"]["attn"]["wq"]["kernel"] is True
    assert mask["blocks"]["layers"]["attn_norm"]["scale"] is False
    assert mask["embed"]["embedding"] is False


def test_weight_decay_is_decided_by_rank_type_and_metadata_not_names():
    """The names that used to exempt a variable (embed, norm, bias) no longer do: a matrix
    named ``bias`` decays, a vector named ``kernel`` does not, a buffer never does, and any
    variable marked ``weight_decay=False`` is exempt; ``exclude`` regexes add exemptions."""
    from jaxaccel.model import nn

    class Foreign(nnx.Module):
        def __init__(self):
            self.bias = nnx.Param(jnp.ones((4, 4)))
            self.kernel = nnx.Param(jnp.ones((4,)))
            self.norm = nnx.Param(jnp.ones((4, 4)))
            self.table = nnx.Param(jnp.ones((4, 4)), weight_decay=False)
            self.history = nn.Buffer(jnp.ones((4, 4)))
            self.lookup = nnx.Embed(8, 4, rngs=nnx.Rngs(0))

    model = Foreign()
    from jaxaccel.step.optim import mark_no_decay
    mark_no_decay(model)
    mask = decay_mask(nnx.state(model))
    assert mask["bias"] is True and mask["norm"] is True
    assert mask["kernel"] is False and mask["table"] is False and mask["history"] is False
    assert mask["lookup"]["embedding"] is False
    assert decay_mask(nnx.state(model), exclude=("^bias$",))["bias"] is False


def test_compiles_are_counted_once_per_shape_and_match_xla():
    backend_compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: backend_compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    state, train_step, _ = make()
    step = CompiledFn(train_step, donate_argnums=0)
    before = len(backend_compiles)
    for seed in range(4):
        state, _ = step(state, random_batch(seed))
    assert step.compiles == 1
    assert len(backend_compiles) - before == 1   # XLA itself compiled the step exactly once
    state, _ = step(state, random_batch(9, T=8))
    assert step.compiles == 2 and step.compile_seconds > 0
    assert memory_bytes(step.last)["temp"] > 0


def test_largest_memory_bytes_is_the_biggest_shape_not_the_last():
    from jaxaccel.step.compiled import largest_memory_bytes
    fn = CompiledFn(lambda x: jnp.tanh(x @ x.T).sum())
    big, small = jnp.ones((256, 64)), jnp.ones((8, 64))
    fn(big)
    fn(small)
    assert fn.compiles == 2
    assert memory_bytes(fn.last) == memory_bytes(fn.compile(small))
    largest = largest_memory_bytes(fn)
    assert largest == memory_bytes(fn.compile(big))
    assert largest["total"] > memory_bytes(fn.compile(small))["total"]
