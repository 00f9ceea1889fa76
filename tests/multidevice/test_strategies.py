"""Sharded training on 8 simulated CPU devices. ``tests/test_sharding.py`` runs this file in a
subprocess with ``--xla_force_host_platform_device_count=8``; it fails (not skips) elsewhere."""

import dataclasses
import functools
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxaccel.model import gpt
from jaxaccel.techniques import registry as techniques
from jaxaccel.run.checkpoint import Checkpointer
from jaxaccel.step.compiled import CompiledFn
from jaxaccel.run.config import build
from jaxaccel.core.errors import ConfigError
from jaxaccel.data.loader import place_batch
from jaxaccel.run.loop import train
from jaxaccel.model.contract import make_apply
from jaxaccel.step.optim import make_optimizer
from jaxaccel.core.sharding import (STRATEGIES, batch_sharding, bytes_per_device, make_mesh,
                                    mesh_shape, pipelined, replicated)
from jaxaccel.step.state import abstract_sharded_state, init_sharded_state
from jaxaccel.step.train import lm_train_step

assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

# The one-hot embedding, as on a GPU (a CPU's auto is the gather; its case is below).
CFG = {"gpt.d_model": 32, "gpt.n_layers": 1, "gpt.n_heads": 8, "model.max_seq_len": 32,
       "gpt.embedding": "one_hot"}
VOCAB = 128


def config(values=None, /, **changes):
    """The TrainConfig of ``CFG`` (a GPT of 128 ids) with ``values`` by field path and
    ``changes`` to its gpt section by name (``n_layers=4``)."""
    cfg = build(values={**CFG, **(values or {}), **{f"gpt.{k}": v for k, v in changes.items()}})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))
OPTIMIZER = make_optimizer("adamw", learning_rate=1e-2, weight_decay=0.1, warmup_steps=0,
                           total_steps=10)


def batch(seed, B=8, T=32, vocab=128):
    """Random tokens in two documents per row, some padding at the end of each row."""
    rng = np.random.default_rng(seed)
    split, end = int(rng.integers(4, 20)), int(rng.integers(24, T + 1))
    segment_ids = np.zeros((B, T), np.int32)
    segment_ids[:, :split], segment_ids[:, split:end] = 1, 2
    positions = np.where(np.arange(T) < split, np.arange(T), np.arange(T) - split)
    return {"inputs": rng.integers(0, vocab, (B, T)).astype(np.int32),
            "targets": rng.integers(0, vocab, (B, T)).astype(np.int32),
            "weights": (segment_ids > 0).astype(np.float32), "segment_ids": segment_ids,
            "positions": np.tile(positions.astype(np.int32), (B, 1)) * (segment_ids > 0)}


def losses_on(mesh, cfg=None, steps=5):
    """The loss of each of ``steps`` steps, trained with the state and batch sharded on mesh."""
    cfg = cfg or config()
    with jax.set_mesh(mesh):
        state, shardings = init_sharded_state(techniques.variables(cfg), OPTIMIZER, 0, None,
                                              mesh)
        layout = batch_sharding(mesh)
        graphdef = nnx.graphdef(techniques.abstract(cfg))
        step = CompiledFn(lm_train_step(make_apply(graphdef), OPTIMIZER, trainable=nnx.Param),
                          in_shardings=(shardings, layout),
                          out_shardings=(shardings, replicated(mesh)), donate_argnums=0)
        losses = []
        for i in range(steps):
            state, metrics = step(state, place_batch(batch(i, vocab=cfg.model.vocab_size),
                                                     layout))
            losses.append(float(metrics["loss"]))
    return np.array(losses), state


def single_device_mesh():
    return make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def single_losses():
    return losses_on(single_device_mesh())[0]


def trained(strategy, axis_types="auto", embedding="one_hot"):
    """``losses_on`` the strategy's default mesh over 8 devices: (losses, final state, mesh),
    once per process: the checkpoint and memory tests read the states these tests train."""
    return _trained(strategy, axis_types, embedding)


@functools.cache
def _trained(strategy, axis_types, embedding):
    mesh = make_mesh(mesh_shape(strategy, 8), axis_types)
    return *losses_on(mesh, config(embedding=embedding)), mesh


def trains_like_one_device(strategy, axis_types, embedding, single_losses):
    losses, state, mesh = trained(strategy, axis_types, embedding)
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
    kernel = state.params["blocks"]["layers"][0]["mlp"]["w_in"]["kernel"][...]
    assert kernel.sharding.mesh.shape == mesh.shape


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if not pipelined(s)])
def test_every_strategy_trains_like_one_device(strategy, single_losses):
    """With Auto axes (the default)."""
    trains_like_one_device(strategy, "auto", "one_hot", single_losses)


# The last one embeds with the plain gather (a CPU's auto): its gradient sums the same rows.
@pytest.mark.parametrize("strategy, embedding", [
    ("tp", "one_hot"), ("fsdp+tp", "one_hot"), ("dp+fsdp", "gather")])
def test_explicit_axes_train_like_one_device(strategy, embedding, single_losses):
    """With Explicit axes, the strategies that use each mesh axis."""
    trains_like_one_device(strategy, "explicit", embedding, single_losses)


@pytest.mark.parametrize("strategy, axis_types", [("dp+fsdp", "explicit"), ("fsdp+tp", "auto")])
def test_the_sorted_sum_embedding_trains_like_one_device(strategy, axis_types, single_losses):
    """``sorted_sum`` (a GPU's auto above 2,048 ids) sums the table gradient sorted on each
    device's tokens and then over the batch axes (``embedding.sorted_sum_lookup``): the same
    losses as one device. The reference is the one-hot embedding's on one device (the same
    gradient summed another way, as for the gather above), so no run of sorted_sum on one
    device is needed: a sum wrong on every device count fails here too."""
    mesh = make_mesh(mesh_shape(strategy, 8), axis_types)
    losses = losses_on(mesh, config(embedding="sorted_sum"), steps=3)[0]
    np.testing.assert_allclose(losses, single_losses[:3], rtol=1e-5)


@functools.cache
def grouped_query_losses():
    """3 steps of the GPT with 4 key-value heads (of 8), unrolled, XLA attention, on one device:
    the reference of the scanned (1 layer: the same parameters and losses) and Pallas tests."""
    return losses_on(single_device_mesh(), config(attention="xla", n_kv_heads=4), steps=3)[0]


def test_scanned_layers_and_grouped_query_heads_under_tp_with_explicit_axes():
    cfg = config({"remat.scan_layers": True}, n_kv_heads=4)
    mesh = make_mesh({"data": 2, "fsdp": 1, "tensor": 4}, "explicit")
    np.testing.assert_allclose(losses_on(mesh, cfg, steps=3)[0], grouped_query_losses(),
                               rtol=1e-5)


def test_fsdp_stores_an_eighth_of_parameters_and_optimizer_state_per_device():
    """Of the states trained above on 8 devices (the same shapes and shards as at the start)."""
    states = {strategy: bytes_per_device((state.params, state.opt_state))
              for strategy in ("dp", "fsdp") for _, state, _ in [trained(strategy)]}
    assert states["fsdp"] <= states["dp"] / 8 * 1.05, states


def test_tp_over_four_devices_keeps_a_quarter_of_the_mlp_activations():
    from experiments.sharding import mlp_temp_bytes
    cfg = gpt.preset("tiny", vocab_size=VOCAB, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4,
                     d_ff=1024, max_seq_len=32)      # the GPT's shape (gpt.GPTConfig)
    one = mlp_temp_bytes(single_device_mesh(), cfg, (8, 32))
    four = mlp_temp_bytes(make_mesh({"data": 1, "fsdp": 1, "tensor": 4}, devices=jax.devices()[:4]),
                          cfg, (8, 32))
    assert 0.2 <= four / one <= 0.3, (one, four)


def abstract_target(mesh):
    """The shapes of ``config()``'s state in its shardings over ``mesh`` (nothing computed):
    what the checkpoint restores into, as ``Checkpointer.restore`` reads its target."""
    with jax.set_mesh(mesh):
        state, shardings = abstract_sharded_state(techniques.variables(config()), OPTIMIZER, 1,
                                                  None, mesh)
    leaves, tree = jax.tree.flatten(state)
    placed = jax.tree.leaves(shardings)
    assert len(placed) == len(leaves)
    return tree.unflatten([jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
                           for leaf, sharding in zip(leaves, placed)]), shardings


def test_checkpoint_restores_across_meshes(tmp_path):
    """The state dp+fsdp trained above (data=2, fsdp=4), saved and restored on three other
    meshes."""
    _, state, saved_mesh = trained("dp+fsdp")
    assert dict(saved_mesh.shape) == {"stage": 1, "data": 2, "fsdp": 4, "tensor": 1}
    expected = jax.device_get(state)
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiles.append(event)
        if event.endswith("backend_compile_duration") else None)
    checkpointer.save(5, state, loader_position={"epoch": 0, "batch": 5}, config={})
    # Each replicated array is written whole by one replica: orbax's default split them among
    # the replicas with a compiled slicing program each (seconds per save on this mesh).
    assert compiles == [], f"the save compiled {len(compiles)} programs"
    for shape, devices in (({"data": 4, "fsdp": 2, "tensor": 1}, None),
                           ({"data": 1, "fsdp": 2, "tensor": 4}, None),
                           ({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])):
        target, shardings = abstract_target(make_mesh(shape, devices=devices))
        restored, _, step = checkpointer.restore(target, config={})
        assert step == 5
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), expected)
        kernel = restored.params["blocks"]["layers"][0]["attn"]["wq"]["kernel"][...]
        assert kernel.sharding == \
            shardings.params["blocks"]["layers"][0]["attn"]["wq"]["kernel"]
    checkpointer.close()


def loop_config(corpus_path, run_dir, **overrides):
    """A small run's TrainConfig, which saves no checkpoint (but a run resumed from);
    ``overrides`` by field path, e.g. ``{"mesh.shape": ...}``."""
    return build(values={
        "data.path": corpus_path, "gpt.d_model": 32, "gpt.n_layers": 1, "gpt.n_heads": 8,
        "model.max_seq_len": 32, "data.batch_size": 8, "run.steps": 4, "run.log_every": 1,
        "run.eval_every": 0, "run.checkpoint_every": 0, "run.eval_batches": 1,
        "run.final_eval_batches": 1,
        "run.save_checkpoints": False, "run.progress": False, "run.run_dir": str(run_dir),
        "data.cache_dir": os.path.join(os.path.dirname(corpus_path), "cache"), **overrides})


def train_losses(summary):
    with open(os.path.join(summary.run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return np.array([r["loss"] for r in records if r["kind"] == "train"])


def test_training_loop_resumes_on_another_mesh(corpus_path, tmp_path):
    """A run on a dp+fsdp mesh, and the same run split: its first half pipelined (fsdp+pp, 1F1B),
    its checkpoint resumed on the dp+fsdp mesh, without stages (the whole run's compiled steps,
    from the compilation cache; restoring onto one device is the checkpoint test's). The losses
    agree step by step."""
    common = {"remat.scan_layers": True, "optimizer.accumulate": 2, "data.batch_size": 16,
              "gpt.n_layers": 2}                                  # a layer for each stage
    whole = train(loop_config(corpus_path, tmp_path / "whole", **common, **{
        "mesh.strategy": "dp+fsdp", "mesh.shape": "data=2,fsdp=4"}))
    assert whole.mesh == {"stage": 1, "data": 2, "fsdp": 4, "tensor": 1}
    assert whole.compiles == 1 and "pipeline" not in whole.techniques
    first = train(loop_config(corpus_path, tmp_path / "split", **common, **{
        "mesh.strategy": "fsdp+pp", "mesh.shape": "stage=2,fsdp=4",
        "mesh.pipeline_schedule": "1f1b", "run.save_checkpoints": True}),
        should_stop=lambda step: step == 2)
    assert first.interrupted == "requested" and first.mesh["stage"] == 2
    assert first.techniques["pipeline"] == {"schedule": "1f1b", "bubble": pytest.approx(1 / 3)}
    second = train(loop_config(corpus_path, tmp_path / "split", **common, **{
        "mesh.strategy": "dp+fsdp", "mesh.shape": "data=2,fsdp=4", "run.resume": True}))
    assert second.steps == 4 and second.mesh == whole.mesh
    np.testing.assert_allclose(train_losses(second), train_losses(whole), rtol=1e-5)
    assert second.val_loss == pytest.approx(whole.val_loss, rel=1e-5)


def test_fp8_and_nm_sparsity_train_on_fsdp_tp_like_one_device(corpus_path, tmp_path):
    """FP8's products and their gradients are laid out by the kernels' logical axes, so the
    model runs split over fsdp x tensor (a contraction split on both sides needs its output
    sharding under explicit axes); amaxes and masks are global, so the losses agree with one
    device's up to float8 rounding of differently reduced sums."""
    common = {"precision.policy": "fp8", "sparsity.pattern": "2:4", "sparsity.every": 2}
    one = train(loop_config(corpus_path, tmp_path / "one", **common, **{"mesh.num_devices": 1}))
    split = train(loop_config(corpus_path, tmp_path / "split", **common, **{
        "mesh.strategy": "fsdp+tp", "mesh.axis_types": "explicit"}))
    assert split.mesh["tensor"] == 2 and split.techniques["fp8"]["note"].startswith("emulated")
    np.testing.assert_allclose(train_losses(split), train_losses(one), rtol=2e-2)
    assert split.techniques["sparsity"]["density"] == one.techniques["sparsity"]["density"] == 0.5


def test_token_dropping_and_importance_sampling_train_on_fsdp_like_one_device(corpus_path,
                                                                              tmp_path):
    """The kept tokens are gathered and scattered within each batch row, so rows split over fsdp
    never exchange them; the per-id loss buffer and the rows' scores are global sums, so the
    draws and the losses agree with one device's."""
    common = {"token_drop.keep": 0.5, "token_drop.layers": "0:1",
              "token_drop.score": "loss", "data.batching": "fixed",
              "data.sampling": "loss", "run.steps": 6}
    one = train(loop_config(corpus_path, tmp_path / "one", **common, **{"mesh.num_devices": 1}))
    split = train(loop_config(corpus_path, tmp_path / "split", **common, **{
        "mesh.strategy": "fsdp"}))
    assert split.mesh["fsdp"] == 8 and split.techniques["sampling"] == "loss"
    np.testing.assert_allclose(train_losses(split), train_losses(one), rtol=1e-4)
    assert split.val_loss == pytest.approx(one.val_loss, rel=1e-4)


def test_loop_rejects_a_batch_the_data_axes_do_not_divide(corpus_path, tmp_path):
    with pytest.raises(ConfigError, match="batch_size=12 does not split over the mesh"):
        train(loop_config(corpus_path, tmp_path / "run", **{"data.batch_size": 12,
                                                            "mesh.strategy": "fsdp"}))


def test_pallas_attention_runs_per_shard_under_fsdp_and_tp():
    """The Pallas kernel, which XLA cannot split, runs through shard_map on each device's rows
    and heads, and trains as the XLA attention does on one device."""
    pallas = config(attention="pallas", n_kv_heads=4)
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2}, "explicit")
    np.testing.assert_allclose(losses_on(mesh, pallas, steps=2)[0], grouped_query_losses()[:2],
                               rtol=1e-5)


def test_sharding_experiment_writes_every_row(corpus_path, tmp_path):
    """The single row and a pipelined one (4 stages of fsdp=2). A strategy without stages
    adds no check of the experiment's own: its mesh is mesh_shape's (test_sharding.py), its
    memory bytes_per_device's of init_sharded_state's state (the fsdp test above), its loss
    one device's (test_every_strategy_trains_like_one_device)."""
    from experiments import sharding
    out = tmp_path / "sharding.json"
    code = sharding.main(["--data", corpus_path, "--d-model", "32", "--n-layers", "4",
                          "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "8",
                          "--steps", "2", "--strategies", "fsdp+pp",
                          "--pipeline-schedules", "1f1b", "--pipeline-microbatches", "4",
                          "--cache-dir", os.path.join(os.path.dirname(corpus_path), "cache"),
                          "--json", str(out)])
    assert code == 0
    rows = {row["strategy"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["single", "fsdp+pp (1f1b)"]
    assert rows["single"]["mesh"] == "1,1,1,1"
    assert rows["fsdp+pp (1f1b)"]["mesh"] == "4,1,2,1"
    assert rows["fsdp+pp (1f1b)"]["bubble"] == pytest.approx(3 / 7)
    assert rows["fsdp+pp (1f1b)"]["blocks_fraction"] <= 0.25 * 1.05
    # the blocks split over 4 stages x 2 (fsdp), the embedding and head over fsdp alone
    single_bytes = rows["single"]["param_opt_bytes_per_device"]
    assert rows["fsdp+pp (1f1b)"]["param_opt_bytes_per_device"] < single_bytes / 4
    assert all(row["loss_diff_vs_single"] < 1e-5 for row in rows.values())
