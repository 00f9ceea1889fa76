"""Parameter-efficient fine-tuning: LoRA and bottleneck adapters.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") freezes a pretrained
weight W [d_in, d_out] and learns its update as a product of two low-rank matrices,
``W + (alpha / r) A B`` with A [d_in, r] (Gaussian at the start) and B [r, d_out] (zero, so the
model starts as the pretrained one). ``model.lora_rank`` > 0 puts A and B (``lora_a``,
``lora_b``) on the projections ``model.lora_targets`` names (q, k, v, o of attention; in, gate,
out of the MLP). ``merge`` folds them back into W for evaluation and export, after which the
model is the base architecture again, with the same logits.

Adapters (Houlsby et al. 2019, "Parameter-Efficient Transfer Learning for NLP") are the
addition-based alternative: ``model.adapter_dim`` > 0 puts a bottleneck ``h + up(gelu(down(h)))``
on the output of every attention and MLP branch (``up`` starting at zero). They add a little
compute and cannot be merged.

With either, ``trainable(cfg)`` says which parameters train: only the LoRA matrices and the
adapters. The step differentiates only those (``grads.value_and_grad(trainable=...)``: no
gradient is computed for the frozen weights), the optimizer keeps state only for them
(``state.init_state``), and the frozen weights pass through every step bit for bit. A run starts
from a trained run's weights with ``run.init_from`` (``python -m experiments.finetune --from``).
"""

import dataclasses

import jax.numpy as jnp

from jaxaccel import buffers

TRAINABLE_NAMES = ("lora_a", "lora_b", "attn_adapter", "mlp_adapter")


def trainable(cfg):
    """The predicate on parameter path names of what trains under ``cfg``, or None (everything)
    when the model has neither LoRA nor adapters nor buffers (``jaxaccel.buffers``, never
    trained)."""
    tuned = bool(cfg.lora_rank or cfg.adapter_dim)
    if not tuned and not buffers.present(cfg):
        return None

    def is_trainable(name: str) -> bool:
        if buffers.is_buffer(name):
            return False
        return not tuned or any(part in TRAINABLE_NAMES for part in name.split("/"))

    return is_trainable


def base_config(cfg):
    """The model config without LoRA and adapters: the architecture a fine-tune starts from."""
    return dataclasses.replace(cfg, lora_rank=0, adapter_dim=0)


def merged_config(cfg):
    """The config of ``merge``'s parameters: without LoRA (adapters, if any, stay)."""
    return dataclasses.replace(cfg, lora_rank=0)


def merge(params, cfg):
    """``params`` with every LoRA pair folded into its weight, ``W + (alpha / r) A B`` (computed
    in float32), and the pairs removed: the parameters of ``merged_config(cfg)``."""
    scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0

    def fold(tree):
        if not isinstance(tree, dict):
            return tree
        if "lora_a" in tree:
            a, b, w = tree["lora_a"], tree["lora_b"], tree["kernel"]
            update = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))
            rest = {k: v for k, v in tree.items() if k not in ("lora_a", "lora_b", "kernel")}
            return {**rest, "kernel": (w.astype(jnp.float32) + scale * update).astype(w.dtype)}
        return {key: fold(value) for key, value in tree.items()}

    return fold(params)


def attach(base_params, fresh_params):
    """Parameters of a LoRA/adapter model: ``fresh_params`` (its initialisation) with every
    weight the base model has taken from ``base_params``; shapes must agree."""

    def take(fresh, base, path):
        if isinstance(fresh, dict):
            return {k: take(v, base.get(k) if isinstance(base, dict) else None, f"{path}/{k}")
                    for k, v in fresh.items()}
        if base is None:
            return fresh
        if base.shape != fresh.shape:
            raise ValueError(f"{path.lstrip('/')}: base {base.shape} vs model {fresh.shape}")
        return jnp.asarray(base, fresh.dtype)

    return take(fresh_params, base_params, "")


def count(params, cfg) -> tuple[int, int]:
    """(trainable, total) parameter counts under ``cfg`` (buffers are neither)."""
    from jaxaccel.grads import partition
    from jaxaccel.model import count_params
    return count_params(partition(params, trainable(cfg))[0]), count_params(params)


def export_merged(run_dir: str, out_dir: str) -> str:
    """Write the model of the LoRA run ``run_dir`` (its latest checkpoint) with its LoRA merged
    into the base weights as a run directory ``out_dir``: ``config.yaml`` (the merged model,
    ``lora_rank`` 0) and an orbax checkpoint of its TrainState at the same step (with a fresh
    optimizer state), which ``run.init_from``, evaluation and further training read like any
    run's."""
    import os

    from jaxaccel.checkpoint import Checkpointer
    from jaxaccel.config import write_config
    from jaxaccel.loop import read_trained_run
    from jaxaccel.optim import build_optimizer
    from jaxaccel.state import init_state

    trained, params, step = read_trained_run(run_dir)
    cfg = dataclasses.replace(trained, model=merged_config(trained.model))
    optimizer, _, _ = build_optimizer(cfg.optimizer, batch_rows=cfg.batch_rows(),
                                      total_steps=cfg.run.steps)
    state = init_state(merge(params, trained.model), optimizer, cfg.run.seed,
                       cfg.make_loss_scale(), cfg.policy(), trainable(cfg.model))
    os.makedirs(out_dir, exist_ok=True)
    write_config(cfg, out_dir)
    checkpointer = Checkpointer(os.path.join(out_dir, "checkpoints"))
    try:
        checkpointer.save(step, state, loader_position={}, config={})
    finally:
        checkpointer.close()
    return out_dir
