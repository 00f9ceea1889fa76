"""Remat policies and scanned layers: the same numbers as no remat, less compiled memory, clear
errors, and a planner whose choice fits its budget."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxaccel.step import grads
from jaxaccel.techniques import registry as techniques
from jaxaccel.step.compiled import abstract, memory_bytes
from jaxaccel.run.config import build, parse
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import abstract_batch
from jaxaccel.run.loop import train, train_step_of
from jaxaccel.model.contract import make_apply
from jaxaccel.step.optim import build_optimizer, decay_mask
from jaxaccel.techniques.planner import choose_policy, compile_step, largest_batch, plan_remat
from jaxaccel.techniques.remat import REMAT_POLICIES, check_policy
from jaxaccel.step.state import init_state
from jaxaccel.step.train import lm_loss, lm_train_step

SMALL = {"gpt.d_model": 32, "gpt.n_layers": 2, "gpt.n_heads": 4, "model.max_seq_len": 16,
         "gpt.dropout": 0.1}
pure = nnx.to_pure_dict


def small_cfg(values=None, vocab_size=64):
    """A TrainConfig of a small GPT of ``vocab_size`` ids (below the byte tokenizer's, which
    ``config.build`` would take), ``values`` by field path."""
    cfg = build(values={**SMALL, **(values or {})})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def init_params(cfg, seed=0):
    """The model's state (``nnx.State``) with every technique of ``cfg``."""
    return nnx.state(techniques.build(cfg, jax.random.PRNGKey(seed)))


def apply_of(cfg):
    return make_apply(nnx.graphdef(techniques.abstract(cfg)))


def random_batch(B=2, T=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 64, (B, T + 1)).astype(np.int32)
    segment_ids = np.ones((B, T), np.int32)
    segment_ids[1, T // 2:] = 2
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    positions[1, T // 2:] -= T // 2
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((B, T), np.float32), "segment_ids": segment_ids,
            "positions": positions}


def stack_blocks(params: dict) -> dict:
    """Unrolled variables (a pure dict: ``blocks/layers`` = {0: ..., 1: ...}) in the stacked
    layout of ``scan_layers`` (``blocks/layers`` = one dict of [L, ...] arrays)."""
    layers = params["blocks"]["layers"]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in range(len(layers))])
    return {**params, "blocks": {**params["blocks"], "layers": stacked}}


def unstack_blocks(params: dict) -> dict:
    """The inverse of ``stack_blocks``."""
    layers = params["blocks"]["layers"]
    L = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "blocks": {**params["blocks"], "layers": {
        i: jax.tree.map(lambda x: x[i], layers) for i in range(L)}}}


def every_policy(scan: bool, params) -> dict:
    """``{policy: (loss, gradients)}`` for every remat policy (``scan``: the blocks scanned),
    from the same values ``params`` (unrolled), with dropout on, gradients in the unrolled
    layout. One jitted function computes them all, each policy's parameters an argument of
    their own (XLA cannot merge the policies' work): one compile, about half the time of one
    per policy."""
    fns, states = {}, {}
    for policy in REMAT_POLICIES:
        cfg = small_cfg({"remat.policy": policy, "remat.scan_layers": scan})
        fns[policy] = grads.value_and_grad(lm_loss(apply_of(cfg)), trainable=nnx.Param)
        states[policy] = nnx.state(techniques.abstract(cfg))
        nnx.replace_by_pure_dict(states[policy],      # the same values (stacked when scanned)
                                 stack_blocks(pure(params)) if scan else pure(params))

    @jax.jit
    def run(states):
        return {p: fns[p](states[p], random_batch(), jax.random.PRNGKey(1)) for p in fns}

    results = run(states)
    return {p: (results[p][0][0], unstack_blocks(pure(results[p][1])) if scan
                else pure(results[p][1])) for p in REMAT_POLICIES}


@pytest.fixture(scope="module")
def reference():
    """The unrolled model's parameters and every policy's loss and gradients, unrolled."""
    params = init_params(small_cfg())
    return params, every_policy(False, params)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_every_policy_gives_the_loss_and_gradients_of_none(reference, scan):
    """Each remat policy, unrolled and scanned, gives the loss and gradients of no remat
    (unrolled): the same dropout masks recomputed, nothing lost."""
    params, unrolled = reference
    loss_none, grads_none = unrolled["none"]
    results = unrolled if not scan else every_policy(True, params)
    for policy, (loss, grads) in results.items():
        np.testing.assert_allclose(loss, loss_none, rtol=1e-6, err_msg=policy)
        assert jax.tree.structure(grads) == jax.tree.structure(grads_none), policy
        for path, g, g_none in zip(jax.tree_util.tree_leaves_with_path(grads),
                                   jax.tree.leaves(grads), jax.tree.leaves(grads_none)):
            error = float(jnp.linalg.norm(g - g_none) / jnp.linalg.norm(g_none))
            assert error < 1e-6, (policy, jax.tree_util.keystr(path[0]), error)


def test_scanned_init_is_the_unrolled_init_stacked():
    unrolled = pure(init_params(small_cfg(), 3))
    scanned_state = init_params(small_cfg({"remat.scan_layers": True}), 3)
    scanned = pure(scanned_state)
    assert scanned["blocks"]["layers"]["attn_norm"]["scale"].shape == (2, 32)
    assert scanned["blocks"]["layers"]["mlp"]["w_in"]["kernel"].shape == (2, 32, 128)
    jax.tree.map(np.testing.assert_array_equal, stack_blocks(unrolled), scanned)
    jax.tree.map(np.testing.assert_array_equal, unstack_blocks(scanned), unrolled)
    # Every stacked variable says so (its first dimension is the layers').
    blocks = jax.tree.leaves(scanned_state["blocks"], is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert blocks and all(v.get_metadata().get("stacked") for v in blocks)


@pytest.mark.parametrize("exclude", [(), (r"attn/wq",)], ids=["by-rank", "with-pattern"])
def test_decay_mask_is_the_same_for_stacked_blocks(exclude):
    """Weight decay is decided by rank, type and metadata, not by names (the old default name
    patterns are gone): a norm's scale [L, d] in the stacked layout is rank 1 per layer and
    does not decay, as in the unrolled one; the embedding is marked (``mark_no_decay``); an
    ``exclude`` pattern of ``--no-decay`` matches both layouts' paths."""
    def mask(scan):
        return pure(decay_mask(init_params(small_cfg({"remat.scan_layers": scan})), exclude))

    unrolled, stacked = mask(False), mask(True)
    blocks = stacked["blocks"]["layers"]
    assert blocks["attn_norm"]["scale"] is False
    assert blocks["attn"]["wq"]["kernel"] is (not exclude)
    assert blocks["attn"]["wk"]["kernel"] is True
    for name in ("attn_norm", "mlp", "attn"):
        for i in range(2):
            assert jax.tree.leaves(blocks[name]) == \
                jax.tree.leaves(unrolled["blocks"]["layers"][i][name])
    assert {k: v for k, v in stacked.items() if k != "blocks"} == \
        {k: v for k, v in unrolled.items() if k != "blocks"}
    assert stacked["embed"]["embedding"] is False and stacked["head"]["kernel"] is True
    assert stacked["final_norm"]["scale"] is False


def test_compiled_temporaries_shrink_with_remat():
    """Each policy keeps fewer activations than none and more than full (4 layers: full
    keeps about a third of none's temporaries here, at 6 layers a fifth)."""
    cfg = {"gpt.d_model": 32, "gpt.n_layers": 4, "gpt.n_heads": 4, "model.max_seq_len": 64,
           "gpt.dropout": 0.0}
    temp = {}
    for policy in ("none", "dots", "attention", "full"):
        graphdef, params = nnx.split(techniques.abstract(small_cfg({**cfg,
                                                                    "remat.policy": policy})))
        grad_fn = jax.jit(grads.value_and_grad(lm_loss(make_apply(graphdef)),
                                               trainable=nnx.Param))
        compiled = grad_fn.lower(params, abstract_batch((8, 64)), jax.random.PRNGKey(0)).compile()
        temp[policy] = memory_bytes(compiled)["temp"]
    assert temp["none"] > temp["attention"] > temp["full"]
    assert temp["none"] > temp["dots"] > temp["full"]
    assert temp["full"] < 0.4 * temp["none"]


def test_unknown_policy_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="unknown remat policy 'bogus'; choose one of "
                                          "none, full, dots, attention, mlp, offload") as info:
        techniques.check(small_cfg({"remat.policy": "bogus"}))
    assert info.value.field == "remat.policy"
    with pytest.raises(ConfigError, match="unknown remat policy"):
        check_policy("bogus")
    # --remat takes save:NAME,NAME too, so it has no fixed choices: the run refuses a bad one
    # before any work, in one line naming the flag.
    from experiments.train import main as train_main
    assert train_main(["--remat", "bogus", "--run-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown remat policy 'bogus'" in err[0] and "--remat" in err[0]
    assert not (tmp_path / "bad").exists()


def test_largest_batch_search_matches_brute_force():
    for budget in (900, 1000, 1037, 5000, 123_456):
        calls = []

        def total_at(b):
            calls.append(b)
            return 1000 + 37 * b + (b % 3) * 5 + (b * b) // 50

        expected = max([b for b in range(1, 2001) if total_at(b) <= budget], default=0)
        for hint in (2, 8, 3000):
            calls.clear()
            assert largest_batch(total_at, budget, limit=2000, hint=hint) == expected
            assert len(calls) == len(set(calls)) <= 10
    assert largest_batch(lambda b: 10, 100, limit=64) == 64


def test_planner_choice_fits_its_budget():
    cfg = small_cfg({"model.max_seq_len": 64, "gpt.dropout": 0.0})
    optimizer = optax.sgd(0.1)
    state = init_state(init_params(cfg), optimizer, seed=0, trainable=nnx.Param)
    abstract_state = abstract(state)

    @functools.cache        # one step function per policy: a batch compiled twice is cached
    def make_step(policy):
        return lm_train_step(apply_of(dataclasses.replace(cfg, remat=dataclasses.replace(
            cfg.remat, policy=policy))), optimizer, trainable=nnx.Param)

    def total(policy, batch):
        return memory_bytes(compile_step(make_step(policy), abstract_state, batch, 64))["total"]

    sizes = plan_remat(make_step, abstract_state, seq_len=64, batch_size=8, budget=1 << 40,
                       policies=("none", "full"), search=False).rows
    none, full = (r["total_bytes"] for r in sizes)
    assert full < none
    budget = (none + full) // 2
    plan = plan_remat(make_step, abstract_state, seq_len=64, batch_size=8, budget=budget,
                      policies=("none", "full"))
    rows = {r["policy"]: r for r in plan.rows}
    assert not rows["none"]["fits"] and 0 < rows["none"]["max_batch"] < 8
    assert plan.policy == "full" and plan.criterion == "flops"
    assert rows["full"]["flops"] > rows["none"]["flops"]     # the recomputation
    best, probed = rows["full"]["max_batch"], rows["full"]["probed"]
    assert best >= 8 and probed[best] <= budget < probed[best + 1]
    assert total("full", 8) == rows["full"]["total_bytes"] <= budget
    with pytest.raises(ConfigError, match="lower the batch size or raise memory_budget"):
        plan_remat(make_step, abstract_state, seq_len=64, batch_size=8, budget=full // 2,
                   policies=("full",), search=False)


def test_planner_picks_the_fastest_policy_that_fits():
    rows = [{"policy": "none", "total_bytes": 900, "fits": False, "flops": 1.0, "step_s": 1.0},
            {"policy": "dots", "total_bytes": 500, "fits": True, "flops": 1.2, "step_s": 1.5},
            {"policy": "attention", "total_bytes": 400, "fits": True, "flops": 1.3, "step_s": 1.1},
            {"policy": "full", "total_bytes": 300, "fits": True, "flops": 1.4, "step_s": None}]
    assert choose_policy(rows, 600, 8) == ("dots", "flops")         # full has no timing
    rows[3]["step_s"] = 1.4
    assert choose_policy(rows, 600, 8) == ("attention", "step_s")
    with pytest.raises(ConfigError, match="leanest, 'full', needs 300"):
        choose_policy([{**r, "fits": False} for r in rows], 200, 8)


def small_run(corpus_path, tmp_path, **values):
    """A run of one block 16 wide (SGD: its step compiles the quickest), one final
    evaluation batch, no plot."""
    return build(values={
        "gpt.d_model": 16, "gpt.n_layers": 1, "gpt.n_heads": 2, "model.max_seq_len": 16,
        "data.path": corpus_path, "data.seq_len": 16, "data.batch_size": 4,
        "optimizer.name": "sgd", "optimizer.warmup_steps": 1, "run.eval_every": 0,
        "run.eval_batches": 1, "run.final_eval_batches": 1, "run.loss_plot": False,
        "run.checkpoint_every": 0, "run.progress": False, "run.run_dir": str(tmp_path / "run"),
        "data.cache_dir": str(tmp_path / "cache"), **values})


def test_remat_and_scan_flags_reach_the_run(corpus_path, tmp_path):
    cfg = parse(["--remat", "full", "--scan-layers", "--d-model", "32", "--n-layers", "2",
                 "--n-heads", "4", "--max-seq-len", "32"])
    assert cfg.remat.policy == "full" and cfg.remat.scan_layers
    summary = train(small_run(corpus_path, tmp_path, **{
        "remat.policy": "full", "remat.scan_layers": True, "run.steps": 2}))
    assert summary.techniques["remat"] == {"policy": "full", "scan_layers": True, "plan": None}
    assert np.isfinite(summary.val_loss)


def test_memory_budget_chooses_the_policy_of_the_run(corpus_path, tmp_path):
    """The budget's plan, which compiles the step under every policy, replaces the configured
    policy; the blocks scanned as in the test above."""
    summary = train(small_run(corpus_path, tmp_path, **{
        "remat.policy": "full", "remat.scan_layers": True, "run.memory_budget": 10**12,
        "run.steps": 2}))
    plan = summary.techniques["remat"]["plan"]
    assert [r["policy"] for r in plan["rows"]] == list(REMAT_POLICIES)
    assert all(r["fits"] for r in plan["rows"]) and plan["criterion"] == "flops"
    # fewest FLOPs: no recomputation
    assert plan["policy"] == summary.techniques["remat"]["policy"] == "none"
    assert summary.techniques["remat"]["scan_layers"]
    assert plan["batch_size"] == 4 and np.isfinite(summary.val_loss)


def test_the_remat_experiment_steps_compute_in_its_precision():
    """experiments.remat builds each row's step from the run's config: --precision bf16 keeps
    fewer compiled temporaries than fp32 (it once measured fp32 whatever it printed). One
    block at sequence length 64: bf16 keeps about 0.85 of fp32's (two blocks at 256: 0.90)."""
    from experiments.remat import DEFAULTS, FIXED, RematConfig
    temps = {}
    for policy in ("fp32", "bf16"):
        cfg = parse(["--precision", policy, "--n-layers", "1", "--d-model", "32", "--seq-len",
                     "64"], RematConfig, defaults=DEFAULTS, fixed=FIXED)
        optimizer, _, _ = build_optimizer(cfg.optimizer, batch_rows=4, total_steps=10)
        state = jax.eval_shape(lambda: init_state(
            techniques.variables(cfg)(jax.random.PRNGKey(0)), optimizer, 0, None, cfg.policy(),
            trainable=nnx.Param))
        executable = compile_step(train_step_of(cfg, techniques.abstract(cfg), optimizer), state,
                                  4, cfg.seq_len)
        temps[policy] = memory_bytes(executable)["temp"]
    assert temps["bf16"] < 0.9 * temps["fp32"], temps
