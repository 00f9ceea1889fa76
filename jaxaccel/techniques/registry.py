"""The techniques a run's settings name, applied to its model in one order and checked against
each other. Each is a module with a settings dataclass and an ``apply(model, settings, ...)``;
``build`` orders them: the factory's model, the init scheme, ``--init-from``'s weights, the layer
techniques (LoRA, adapters, N:M sparsity, FP8, compute dtype), then the block techniques (scan and
remat, stochastic depth, token dropping). A new one also needs its ``jaxaccel.run.config`` section.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.techniques import (fp8, init, lora, remat, sparsity, stacking, stochastic_depth,
                                 token_drop)
from jaxaccel.model import contract as model_lib
from jaxaccel.step import optim, precision
from jaxaccel.data import sampling
from jaxaccel.core.sharding import pipelined

LORA_KEY = 0x10A      # folded into the model's key for the fine-tuning weights' draws


def build(cfg, key, *, depth: int | None = None, base_state=None) -> nnx.Module:
    """The model of ``cfg`` (a ``TrainConfig``) from ``key`` with its techniques; ``depth`` cuts
    its stack (a stacking stage); ``base_state`` replaces its weights before LoRA or adapters."""
    model = model_lib.build(cfg.model, cfg.gpt, key)
    optim.mark_no_decay(model)
    full_layers = stacking.truncate(model, depth) if depth is not None else None
    init.apply(model, cfg.init, key)
    if base_state is not None:
        nnx.update(model, base_state)
    tune_key = jax.random.fold_in(key, LORA_KEY)
    lora.apply_lora(model, cfg.lora, tune_key)
    lora.apply_adapters(model, cfg.adapters, tune_key)
    sparsity.apply(model, cfg.sparsity)
    policy = cfg.policy()
    if policy.fp8:
        fp8.apply(model, cfg.fp8)
    if policy.compute_dtype != jnp.float32:
        precision.compute_in(model, policy.compute_dtype)
    remat.apply(model, cfg.remat, check=False)     # preflight checks the traced step's tags
    stochastic_depth.apply(model, cfg.stochastic_depth)
    token_drop.apply(model, cfg.token_drop, cfg.model.vocab_size, full_layers)
    return model


def abstract(cfg, **kwargs) -> nnx.Module:
    """``build`` with ShapeDtypeStructs for arrays, to check the model before any work."""
    return model_lib.abstract(lambda: build(cfg, jax.random.PRNGKey(0), **kwargs))


def variables(cfg, depth: int | None = None):
    """``make(key, *base) -> nnx.State`` of ``build``, for the sharded initialisation."""
    def make(key, *base):
        return nnx.state(build(cfg, key, depth=depth, base_state=base[0] if base else None))
    return make


def tuned(cfg) -> bool:
    """Whether the run fine-tunes (LoRA or adapters: only their weights train)."""
    return bool(cfg.lora.rank or cfg.adapters.dim)


def check(cfg) -> None:
    """Each technique, and importance sampling, checks its settings and what it cannot join."""
    for technique in (lora, sparsity, fp8, remat, stochastic_depth, token_drop, stacking,
                      sampling):
        technique.check(cfg)


def report(cfg, params, mesh_shape: dict, run: dict) -> dict:
    """What each technique the run used did, for its summary (``run``: what the loop measured)."""
    from jaxaccel.techniques.pipeline import bubble_fraction
    done = {"attention": (cfg.gpt.attention or "xla") if model_lib.is_preset(cfg.model.name)
            else None}
    if cfg.init.scheme != "default":
        done["init"] = cfg.init.scheme
    if cfg.remat.policy != "none" or cfg.remat.scan_layers or run.get("remat_plan"):
        done["remat"] = {"policy": cfg.remat.policy, "scan_layers": cfg.remat.scan_layers,
                         "plan": run.get("remat_plan")}
    if cfg.stochastic_depth.rate:
        rows = cfg.batch_rows() // cfg.optimizer.accumulate
        depth = (run.get("stages") or [[0, None]])[-1][1] or 1
        done["stochastic_depth"] = {
            "rate": cfg.stochastic_depth.rate,
            "kept": stochastic_depth.kept_fraction(cfg.stochastic_depth.rate, depth, rows,
                                                   mesh_shape["data"] * mesh_shape["fsdp"])}
    if cfg.token_drop.keep < 1:
        done["token_drop"] = {"keep": cfg.token_drop.keep, "score": cfg.token_drop.score}
    if tuned(cfg):
        done["lora"] = {"rank": cfg.lora.rank, "adapter_dim": cfg.adapters.dim,
                        "init_from": cfg.run.init_from}
    elif cfg.run.init_from:
        done["init_from"] = cfg.run.init_from
    if cfg.sparsity.pattern != "none":
        done["sparsity"] = {"pattern": cfg.sparsity.pattern, "density": sparsity.density(params),
                            **sparsity.savings(params, cfg.sparsity.pattern,
                                               run.get("flops_per_token") or 1.0)}
    if cfg.policy().fp8:
        done["fp8"] = {"note": run.get("fp8_note"),
                       "gemms": fp8.fp8_gemms(run.get("executables") or [])}
    if cfg.stacking.stages > 1:
        done["stacking"] = {"stages": run.get("stages")}
    if pipelined(cfg.mesh.strategy):
        done["pipeline"] = {"schedule": cfg.mesh.pipeline_schedule,
                            "bubble": bubble_fraction(mesh_shape["stage"],
                                                      cfg.optimizer.accumulate)}
    if cfg.data.sampling != "uniform":
        done["sampling"] = cfg.data.sampling
    return {k: v for k, v in done.items() if v is not None}
