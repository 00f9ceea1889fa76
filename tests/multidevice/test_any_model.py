"""A model jaxaccel did not write (``tests/foreign_model.py``), sharded over 8 simulated CPU
devices by every strategy, gives the one-device losses. ``tests/test_any_model.py`` runs this file
in a subprocess with ``--xla_force_host_platform_device_count=8``; it fails (not skips)
elsewhere."""

import functools
import os

import jax
import numpy as np
import pytest

from jaxaccel.techniques import registry as techniques
from jaxaccel.run.config import build
from jaxaccel.run.loop import train_step_of
from jaxaccel.techniques.registry import variables as make_params
from jaxaccel.step.optim import build_optimizer
from jaxaccel.core.sharding import batch_sharding, build_mesh, parse_axis_rules, pipelined
from jaxaccel.step.state import init_sharded_state

assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

FOREIGN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "foreign_model.py") + ":make"
# The foreign model names no logical axes: tensor parallelism takes them from rules.
RULES = ("qkv/kernel=embed,heads;qkv/bias=heads;out/kernel=heads,embed;up/kernel=embed,mlp;"
         "up/bias=mlp;down/kernel=mlp,embed")


def batch(seed, B=8, T=32):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 300, (B, T + 1)).astype(np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:],
            "weights": np.ones((B, T), np.float32), "segment_ids": np.ones((B, T), np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()}


def losses(strategy: str, devices: int | None, shape: str | None = None, **values) -> list[float]:
    """The first three steps' losses of the foreign model under ``strategy``."""
    cfg = build(values={"model.name": FOREIGN, "model.max_seq_len": 32, "data.seq_len": 32,
                        "data.batch_size": 8, "mesh.strategy": strategy,
                        "mesh.axis_rules": RULES, "optimizer.warmup_steps": 0, **values})
    mesh, _ = build_mesh(strategy, shape, "auto", devices)
    with jax.set_mesh(mesh):
        model = techniques.abstract(cfg)
        optimizer, schedule, _ = build_optimizer(cfg.optimizer, batch_rows=8, total_steps=10)
        state, shardings = init_sharded_state(make_params(cfg, None), optimizer, 0,
                                              cfg.make_loss_scale(), mesh, cfg.policy(),
                                              axis_rules=parse_axis_rules(RULES))
        step = jax.jit(train_step_of(cfg, model, optimizer, schedule),
                       in_shardings=(shardings, batch_sharding(mesh)),
                       out_shardings=(shardings, None), donate_argnums=0)
        out = []
        for seed in range(3):
            state, metrics = step(state, batch(seed))
            out.append(float(metrics["loss"]))
    return out


def extra_of(strategy: str) -> dict:
    """A pipeline's settings: the stack scanned (its 2 layers split over the stages) and
    microbatches to fill it. The other strategies shard the model with one block (``depth: 1``):
    what they split is each block's weights, the same in every block, and a second block was a
    third of each compile."""
    if pipelined(strategy):
        return {"remat.scan_layers": True, "optimizer.accumulate": 2}
    return {"model.args": "depth: 1"}


@functools.cache
def one_device_losses(pipeline: bool) -> list[float]:
    """The one-device losses the strategies are compared to, run once per configuration (the
    plain one and the pipelines') rather than once per strategy: the same program on the same
    batches, so every strategy's run meets the same numbers."""
    return losses("dp", 1, **extra_of("pp" if pipeline else "dp"))


# In an order that lets tests/test_any_model.py run them in 4 parts of about the same length
# (a pipeline's compile is about twice another strategy's; each configuration's one-device run
# is compiled once per part, the run-wide compilation cache serving the repeats).
@pytest.mark.parametrize("strategy, shape", [
    ("dp+pp", "stage=2,data=4"), ("dp", None), ("fsdp", None), ("fsdp+pp", "stage=2,fsdp=4"),
    ("tp", None), ("fsdp+tp", None)])
def test_every_strategy_gives_the_one_device_losses(strategy, shape):
    one = one_device_losses(pipelined(strategy))
    np.testing.assert_allclose(losses(strategy, None, shape, **extra_of(strategy)), one,
                               rtol=2e-5)
