"""Remat policies and scanned layers: the same numbers as no remat, less compiled memory, clear
errors, and a planner whose choice fits its budget."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.remat import DEFAULTS, FIXED, RematConfig
from jaxaccel import grads
from jaxaccel.compiled import abstract, memory_bytes
from jaxaccel.config import build, parse
from jaxaccel.errors import ConfigError
from jaxaccel.loader import abstract_batch
from jaxaccel.loop import train, train_step_of
from jaxaccel.model import ModelConfig, init_params, make_apply
from jaxaccel.optim import build_optimizer, decay_mask
from jaxaccel.planner import choose_policy, compile_step, largest_batch, plan_remat
from jaxaccel.remat import REMAT_POLICIES, check_policy
from jaxaccel.state import init_state
from jaxaccel.train import lm_loss, lm_train_step

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, dropout=0.1)


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
    """Unrolled parameters (``blocks`` = {0: ..., 1: ...}) in the stacked layout of
    ``scan_layers`` (``blocks`` = one dict of [L, ...] arrays)."""
    layers = [params["blocks"][i] for i in range(len(params["blocks"]))]
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def unstack_blocks(params: dict) -> dict:
    """The inverse of ``stack_blocks``."""
    L = jax.tree.leaves(params["blocks"])[0].shape[0]
    return {**params, "blocks": {i: jax.tree.map(lambda x: x[i], params["blocks"])
                                 for i in range(L)}}


def loss_and_grads(cfg, params):
    """Loss and gradients with dropout on, gradients in the unrolled layout."""
    grad_fn = jax.jit(grads.value_and_grad(lm_loss(make_apply(cfg))))
    (loss, _), g = grad_fn(params, random_batch(), jax.random.PRNGKey(1))
    return loss, unstack_blocks(g) if cfg.scan_layers else g


@pytest.fixture(scope="module")
def reference():
    params = init_params(ModelConfig(**SMALL), jax.random.PRNGKey(0))
    return params, loss_and_grads(ModelConfig(**SMALL), params)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_every_policy_gives_the_loss_and_gradients_of_none(reference, policy, scan):
    params, (loss_none, grads_none) = reference
    cfg = ModelConfig(**SMALL, remat=policy, scan_layers=scan)
    loss, grads = loss_and_grads(cfg, stack_blocks(params) if scan else params)
    np.testing.assert_allclose(loss, loss_none, rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(grads_none)
    for path, g, g_none in zip(jax.tree_util.tree_leaves_with_path(grads),
                               jax.tree.leaves(grads), jax.tree.leaves(grads_none)):
        error = float(jnp.linalg.norm(g - g_none) / jnp.linalg.norm(g_none))
        assert error < 1e-6, (jax.tree_util.keystr(path[0]), error)


def test_scanned_init_is_the_unrolled_init_stacked():
    unrolled = init_params(ModelConfig(**SMALL), jax.random.PRNGKey(3))
    scanned = init_params(ModelConfig(**SMALL, scan_layers=True), jax.random.PRNGKey(3))
    assert scanned["blocks"]["attn_norm"]["scale"].shape == (2, 32)
    assert scanned["blocks"]["mlp"]["w_in"]["kernel"].shape == (2, 32, 128)
    jax.tree.map(np.testing.assert_array_equal, stack_blocks(unrolled), scanned)
    jax.tree.map(np.testing.assert_array_equal, unstack_blocks(scanned), unrolled)


@pytest.mark.parametrize("exclude", [None, ()], ids=["default", "no-patterns"])
def test_decay_mask_is_the_same_for_stacked_blocks(exclude):
    params = init_params(ModelConfig(**SMALL), jax.random.PRNGKey(0))
    mask = decay_mask if exclude is None else (lambda p: decay_mask(p, exclude))
    unrolled, stacked = mask(params), mask(stack_blocks(params))
    assert stacked["blocks"]["attn_norm"]["scale"] is False
    assert stacked["blocks"]["attn"]["wq"]["kernel"] is True
    for name in ("attn_norm", "mlp", "attn"):
        for i in range(2):
            assert jax.tree.leaves(stacked["blocks"][name]) == \
                jax.tree.leaves(unrolled["blocks"][i][name])
    assert {k: v for k, v in stacked.items() if k != "blocks"} == \
        {k: v for k, v in unrolled.items() if k != "blocks"}


def test_compiled_temporaries_shrink_with_remat():
    cfg = dict(vocab_size=64, d_model=64, n_layers=6, n_heads=4, max_seq_len=128)
    temp = {}
    for policy in ("none", "dots", "attention", "full"):
        model_cfg = ModelConfig(**cfg, remat=policy)
        params = jax.eval_shape(lambda: init_params(model_cfg, jax.random.PRNGKey(0)))
        grad_fn = jax.jit(grads.value_and_grad(lm_loss(make_apply(model_cfg))))
        compiled = grad_fn.lower(params, abstract_batch((8, 128)), jax.random.PRNGKey(0)).compile()
        temp[policy] = memory_bytes(compiled)["temp"]
    assert temp["none"] > temp["attention"] > temp["full"]
    assert temp["none"] > temp["dots"] > temp["full"]
    assert temp["full"] < 0.4 * temp["none"]


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown remat policy 'bogus'; choose one of "
                                          "none, full, dots, attention, mlp, offload") as info:
        ModelConfig(**SMALL, remat="bogus")
    assert info.value.field == "model.remat"
    with pytest.raises(ConfigError, match="unknown remat policy"):
        check_policy("bogus")
    with pytest.raises(SystemExit):
        parse(["--remat", "bogus"])


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
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
    optimizer = optax.sgd(0.1)
    state = init_state(init_params(cfg, jax.random.PRNGKey(0)), optimizer, seed=0)
    abstract_state = abstract(state)

    def make_step(policy):
        return lm_train_step(make_apply(dataclasses.replace(cfg, remat=policy)), optimizer)

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
    return build(values={
        "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 32,
        "data.path": corpus_path, "data.seq_len": 32, "data.batch_size": 4,
        "optimizer.warmup_steps": 1, "run.eval_every": 0, "run.eval_batches": 2,
        "run.checkpoint_every": 0, "run.progress": False, "run.run_dir": str(tmp_path / "run"),
        "data.cache_dir": str(tmp_path / "cache"), **values})


def test_remat_and_scan_flags_reach_the_run(corpus_path, tmp_path):
    cfg = parse(["--remat", "full", "--scan-layers", "--d-model", "32", "--n-layers", "2",
                 "--n-heads", "4", "--max-seq-len", "32"])
    assert cfg.model.remat == "full" and cfg.model.scan_layers
    summary = train(small_run(corpus_path, tmp_path, **{
        "model.remat": "full", "model.scan_layers": True, "run.steps": 3}))
    assert summary.remat == "full" and summary.scan_layers is True
    assert summary.remat_plan is None and np.isfinite(summary.val_loss)


def test_memory_budget_chooses_the_policy_of_the_run(corpus_path, tmp_path):
    summary = train(small_run(corpus_path, tmp_path, **{
        "model.remat": "full", "run.memory_budget": 10**12, "run.steps": 2}))
    plan = summary.remat_plan
    assert [r["policy"] for r in plan["rows"]] == list(REMAT_POLICIES)
    assert all(r["fits"] for r in plan["rows"]) and plan["criterion"] == "flops"
    assert plan["policy"] == summary.remat == "none"     # fewest FLOPs: no recomputation
    assert plan["batch_size"] == 4 and np.isfinite(summary.val_loss)


def test_the_remat_experiment_steps_compute_in_its_precision():
    """experiments.remat builds each row's step from the run's config: --precision bf16 keeps
    fewer compiled temporaries than fp32 (it once measured fp32 whatever it printed)."""
    temps = {}
    for policy in ("fp32", "bf16"):
        cfg = parse(["--precision", policy, "--n-layers", "2", "--d-model", "64"], RematConfig,
                    defaults=DEFAULTS, fixed=FIXED)
        optimizer, _, _ = build_optimizer(cfg.optimizer, batch_rows=4, total_steps=10)
        state = jax.eval_shape(lambda: init_state(
            init_params(cfg.model, jax.random.PRNGKey(0)), optimizer, 0, None, cfg.policy()))
        executable = compile_step(train_step_of(cfg, cfg.model, optimizer), state, 4, cfg.seq_len)
        temps[policy] = memory_bytes(executable)["temp"]
    assert temps["bf16"] < 0.9 * temps["fp32"], temps
