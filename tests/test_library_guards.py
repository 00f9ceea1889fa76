"""The library calls are as safe as the loop (issue 51): what ``experiments.train`` does for a
model of one's own, the public calls a user composes in code (README, "Your own model") do too,
or refuse in one line. Each test is one case of the issue, on a tiny model jaxaccel did not write
(``examples/tiny_lm.py``, ``tests/foreign_model.py``), traced where nothing must run."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from jaxaccel.techniques import fp8, remat, sparsity, token_drop
from jaxaccel.step import grads, optim, precision, trace
from jaxaccel.model import contract as model_lib, nn
from jaxaccel.core import sharding
from jaxaccel.run.config import build
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import abstract_batch
from jaxaccel.run.loop import preflight
from jaxaccel.step.state import init_state
from jaxaccel.step.train import lm_loss, lm_train_step, make_train_step

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_LM = os.path.join(os.path.dirname(HERE), "examples", "tiny_lm.py") + ":make"
FOREIGN = os.path.join(HERE, "foreign_model.py") + ":make"
VOCAB, SEQ = 320, 16


def tiny_lm(**techniques):
    """``examples/tiny_lm.py`` at its smallest, with the layer and block techniques named."""
    lm = model_lib.load_factory(TINY_LM)(VOCAB, SEQ, rngs=nnx.Rngs(params=0), width=32, depth=1,
                                         heads=2)
    if "sparsity" in techniques:
        sparsity.apply(lm, sparsity.SparsitySettings(pattern="2:4", every=1))
    if "fp8" in techniques:
        fp8.apply(lm, fp8.Fp8Settings())
    if "token_drop" in techniques:
        token_drop.apply(lm, token_drop.TokenDropSettings(keep=0.5, layers="0:1", score="loss"),
                         VOCAB)
    return lm


def batch(seed=0, B=2, T=8):
    ids = np.random.RandomState(seed).randint(3, VOCAB - 20, (B, T + 1)).astype(np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": np.ones((B, T), np.float32),
            "segment_ids": np.ones((B, T), np.int32),
            "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}


def forward_jaxpr(apply, state):
    return jax.make_jaxpr(apply)(state, dict(abstract_batch((2, 8))), jax.random.PRNGKey(0))


class Untagged(nnx.Module):
    """Blocks in a Stack, no tensor tagged, and a float32 constant in its own forward pass."""

    def __init__(self, vocab_size, max_seq_len, *, rngs, constant=False):
        self.constant = constant
        self.emb = nnx.Embed(vocab_size, 16, rngs=rngs)
        self.blocks = nn.Stack([nnx.Linear(16, 16, rngs=rngs)])
        self.head = nnx.Linear(16, vocab_size, rngs=rngs)

    def __call__(self, inputs, positions=None, segment_ids=None):
        x = self.emb(inputs)
        if self.constant:
            x = x @ jnp.eye(16, dtype=jnp.float32)
        return self.head(self.blocks(x))


# -- 1, 2: precision ----------------------------------------------------------------------------

def test_cast_computes_an_own_models_layers_in_the_policys_dtype():
    """``precision.cast`` of a model's apply once left every flax layer (dtype None) promoting
    to float32 unless ``compute_in`` was called: now it sets them on the merged copy (the user's
    module untouched), and the logits are those of the loop's model (``compute_in`` first:
    nothing applied twice)."""
    lm = tiny_lm()
    graphdef, state = nnx.split(lm)
    bf16 = precision.get_policy("bf16")
    assert trace.float32_matmuls(forward_jaxpr(
        precision.cast(model_lib.make_apply(graphdef), bf16), state)) == []
    assert lm.head.dtype is None                                  # the user's module as it was
    looped = tiny_lm()
    assert precision.compute_in(looped, jnp.bfloat16) > 0        # what techniques.build does
    inputs = batch()
    plain = precision.cast(model_lib.make_apply(graphdef), bf16)(state, inputs)
    loop_graphdef, loop_state = nnx.split(looped)
    loop = precision.cast(model_lib.make_apply(loop_graphdef), bf16)(loop_state, inputs)
    chex.assert_trees_all_equal(plain, loop)
    fp32 = precision.cast(model_lib.make_apply(graphdef), precision.get_policy("fp32"))
    assert len(trace.float32_matmuls(forward_jaxpr(fp32, state))) > 0      # fp32 left alone


def test_the_float32_warning_names_the_fix_of_each_kind_of_line():
    """The warning suggested a cast where the fix was the layers' dtype: a flax layer's line now
    gets ``dtype=None`` and ``precision.compute_in``, the model's own line the cast."""
    bf16 = precision.get_policy("bf16")
    graphdef, state = nnx.split(tiny_lm())
    # a user's own apply function (merging the model itself) gets no compute_in: flax's Linear
    # is named as flax's
    own_apply = precision.cast(lambda s, b, key=None: nnx.merge(graphdef, s)(b["inputs"]), bf16)
    where = trace.float32_matmuls(forward_jaxpr(own_apply, state))
    warning = precision.float32_warning(where, bf16)
    assert any(w.startswith("flax's linear.py") for w in where), where
    assert "\n" not in warning and "dtype=None" in warning
    assert "precision.compute_in(model, bfloat16)" in warning
    constant = Untagged(VOCAB, SEQ, rngs=nnx.Rngs(0), constant=True)
    c_graphdef, c_state = nnx.split(constant)
    where = trace.float32_matmuls(forward_jaxpr(
        precision.cast(model_lib.make_apply(c_graphdef), bf16), c_state))
    assert where and all("test_library_guards.py" in w for w in where), where
    warning = precision.float32_warning(where, bf16)
    assert "cast it to the input's dtype" in warning and "compute_in" not in warning
    assert precision.float32_warning(where, precision.get_policy("fp32")) is None


# -- 3: the decay mask ---------------------------------------------------------------------------

def test_the_default_decay_mask_spares_embed_tables_unmarked():
    """An own model's ``nnx.Embed`` tables decayed unless ``mark_no_decay`` ran: the default
    mask now spares them (metadata ``weight_decay=True`` still decays one), and a step of
    ``make_optimizer`` with zero gradients leaves them while it decays the kernels."""
    lm = tiny_lm()
    state = nnx.state(lm)
    mask = optim.decay_mask(state)
    assert mask["tok_emb"]["embedding"] is False and mask["pos_emb"]["embedding"] is False
    assert mask["head"]["kernel"] is True and mask["blocks"]["layers"][0]["fc1"]["kernel"]
    lm.pos_emb.embedding.set_metadata("weight_decay", True)
    assert optim.decay_mask(nnx.state(lm))["pos_emb"]["embedding"] is True
    lm.pos_emb.embedding.set_metadata("weight_decay", False)
    optimizer = optim.make_optimizer("adamw", learning_rate=0.1, weight_decay=0.5, total_steps=2,
                                     clip_norm=None)
    params = nnx.filter_state(state, nnx.Param)
    updates, _ = optimizer.update(jax.tree.map(jnp.zeros_like, params), optimizer.init(params),
                                  params)
    assert not np.any(updates["tok_emb"]["embedding"][...])
    assert np.all(np.asarray(updates["head"]["kernel"][...]) != 0)


# -- 4: remat ------------------------------------------------------------------------------------

def test_remat_apply_refuses_a_policy_whose_tags_the_model_never_names():
    """``remat.apply`` acted as full on a model without the policy's tags; the loop refused it.
    The library call now refuses too, in one line, before changing the model."""
    model = Untagged(VOCAB, SEQ, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="never tag them") as caught:
        remat.apply(model, remat.RematSettings(policy="attention", scan_layers=True))
    assert caught.value.field == "remat.policy" and "\n" not in str(caught.value)
    assert not model.blocks.scanned and not list(model.blocks.transforms)     # untouched
    remat.apply(model, remat.RematSettings(policy="full"))       # full names no tags
    assert len(model.blocks.transforms) == 1
    tagged = tiny_lm()
    remat.apply(tagged, remat.RematSettings(policy="attention"))
    assert tagged.blocks.transforms[0].name == "attention"


# -- 5: tensor parallelism -----------------------------------------------------------------------

def test_tensor_parallelism_says_which_weights_it_keeps_whole(monkeypatch, capsys):
    """Tensor parallelism kept a model that names no logical axes whole on every device, and
    said nothing: the library's shardings and the loop's preflight now say which weights, with
    the fix, in one warning line (embedding tables, which it keeps whole anyway, not counted)."""
    monkeypatch.setattr(sharding, "_SAID", set(), raising=False)      # said once a process
    mesh = AbstractMesh((1, 1, 1, 2), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    state = nnx.state(tiny_lm())
    sharding.param_shardings(mesh, state)
    sharding.param_shardings(mesh, state)                       # said once
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: tensor parallelism (2 devices) keeps "
                                               "5 weights whole"), err
    assert "blocks/layers/0/fc1/kernel" in err[0] and "embedding" not in err[0]
    assert "nnx.with_partitioning" in err[0] and "--axis-rules" in err[0]
    one_device = AbstractMesh((1, 1, 2, 1), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    sharding.param_shardings(one_device, state)                 # no tensor axis: nothing said
    rules = "qkv/kernel=embed,heads;proj/kernel=heads,embed;fc1/kernel=embed,mlp;" \
            "fc2/kernel=mlp,embed;head/kernel=embed,vocab"
    sharding.param_shardings(mesh, state, sharding.parse_axis_rules(rules))
    assert capsys.readouterr().err == ""
    # The loop: a model that names some axes trains under tp, saying what stays whole.
    cfg = build(values={"model.name": FOREIGN, "model.args": "width: 16, depth: 1",
                        "model.max_seq_len": 16, "data.seq_len": 16, "data.batch_size": 2,
                        "mesh.strategy": "tp", "mesh.axis_rules": "qkv/kernel=embed,heads"})
    preflight(cfg, {"stage": 1, "data": 1, "fsdp": 1, "tensor": 2})
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "keeps 4 weights whole" in err[0], err
    assert "layers/layers/0/down/kernel" in err[0]


# -- 6: a non-finite step ------------------------------------------------------------------------

def test_a_non_finite_step_under_the_fp32_loss_scale_is_not_counted_as_skipped():
    """With the fp32 policy's loss scale (none) a non-finite step is applied, as without any
    loss scale (skipping would hold two optimizer states at once in every fp32 and bf16 step),
    and it was counted as skipped: ``skipped_steps`` now counts only steps a scale skipped."""
    lm = tiny_lm(fp8=True)
    graphdef, variables = nnx.split(lm)
    apply = model_lib.make_apply(graphdef)

    def poisoned(state, inputs, key=None):
        logits = apply(state, inputs, key)
        return logits * jnp.where(inputs["inputs"][0, 0] == 3, jnp.nan, 1.0)

    poisoned.graphdef = graphdef                               # the model's buffer updates
    optimizer = optax.adamw(1e-3)
    fp32 = precision.get_policy("fp32")
    state = init_state(variables, optimizer, seed=0,
                       loss_scale=precision.make_loss_scale("auto", fp32))
    assert isinstance(state.loss_scale, precision.NoLossScale)
    step = jax.jit(lm_train_step(poisoned, optimizer, policy=fp32))
    inputs = batch()
    inputs["inputs"][0, 0] = 3
    new, metrics = step(state, inputs)
    assert int(metrics["skipped_steps"]) == 0 and int(new.loss_scale.skipped_steps) == 0
    assert not all(np.all(np.isfinite(x)) for x in jax.tree.leaves(nnx.filter_state(
        new.params, nnx.Param)))


# -- 7, 8: the step's defaults -------------------------------------------------------------------

def test_the_plain_library_step_trains_what_the_loop_trains():
    """``lm_train_step(make_apply(graphdef), optimizer)`` trained FP8's amax histories with
    AdamW, and 2:4 sparsity failed with a float0 TypeError, unless ``trainable=``,
    ``observed=`` and ``update_buffers=`` were given: the defaults are now the loop's, so the
    plain call is the explicit one, bit for bit, and the optimizer holds no buffer."""
    lm = tiny_lm(fp8=True, sparsity=True, token_drop=True)
    graphdef, variables = nnx.split(lm)
    optimizer = optax.adamw(1e-2)
    plain = init_state(variables, optimizer, seed=0)
    held = jax.tree.leaves(plain.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert not [v for v in held if isinstance(v, nn.Buffer)]
    trainable = nn.trainable(variables)
    explicit = init_state(variables, optimizer, seed=0, trainable=trainable)
    chex.assert_trees_all_equal(plain, explicit)
    plain_step = jax.jit(lm_train_step(model_lib.make_apply(graphdef), optimizer))
    explicit_step = jax.jit(lm_train_step(
        model_lib.make_apply(graphdef), optimizer, trainable=trainable, observed=nn.Observation,
        update_buffers=nn.updater(lm), stats=nn.loss_stats(lm)))
    plain, _ = plain_step(plain, batch())
    explicit, _ = explicit_step(explicit, batch())
    chex.assert_trees_all_equal(plain, explicit)
    history = plain.params["blocks"]["layers"][0]["fc1"]["history"][...]
    assert np.all(np.asarray(history[:, 0]) > 0)                # the amaxes, recorded
    token_loss = plain.params["blocks"]["transforms"][0]["token_loss"][...]
    assert len(np.unique(np.asarray(token_loss))) > 1            # moved from the losses


def test_a_step_that_cannot_find_the_models_updates_says_which_argument():
    """Where ``apply_fn`` is a user's own function, ``lm_train_step`` cannot find the model's
    buffer updates or loss statistics: a state with buffers asks for ``update_buffers=``, and
    loss-scored token dropping without ``stats=`` (once a bare ``NoneType`` TypeError) asks for
    ``stats=``, each in one line, when the step is traced."""
    lm = tiny_lm(token_drop=True)
    graphdef, variables = nnx.split(lm)
    apply = model_lib.make_apply(graphdef)
    own = lambda state, inputs, key=None: apply(state, inputs, key)   # noqa: E731
    optimizer = optax.adamw(1e-3)
    state = init_state(variables, optimizer, seed=0)
    with pytest.raises(ConfigError, match=r"pass update_buffers=nn.updater\(model\)") as caught:
        jax.eval_shape(lm_train_step(own, optimizer), state, batch())
    assert "TokenLoss" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"pass stats=nn.loss_stats\(model\)") as caught:
        jax.eval_shape(lm_train_step(own, optimizer, update_buffers=nn.updater(lm)), state,
                       batch())
    assert "\n" not in str(caught.value)
    jax.eval_shape(lm_train_step(own, optimizer, update_buffers=nn.updater(lm),
                                 stats=nn.loss_stats(lm)), state, batch())       # as asked
    jax.eval_shape(lm_train_step(own, optimizer, update_buffers=None), state, batch())


def test_fp8_updates_without_observed_amaxes_say_so():
    """A gradient function that observes nothing (a user's own) left FP8's update a bare
    ``NoneType`` TypeError: it names ``observed=`` now."""
    lm = tiny_lm(fp8=True)
    graphdef, variables = nnx.split(lm)
    loss_grad = grads.value_and_grad(lm_loss(model_lib.make_apply(graphdef)))

    def observing_nothing(params, inputs, key, *, scale=None):
        (loss, aux), g = loss_grad(params, inputs, key, scale=scale)
        return (loss, {k: v for k, v in aux.items() if k != grads.OBSERVED_MAX}), g

    optimizer = optax.adamw(1e-3)
    step = make_train_step(observing_nothing, optimizer, update_buffers=nn.updater(lm))
    with pytest.raises(ConfigError, match="observed=nn.Observation") as caught:
        jax.eval_shape(step, init_state(variables, optimizer, seed=0), batch())
    assert "\n" not in str(caught.value)
