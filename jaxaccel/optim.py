"""Optimizer construction: an ``optax.GradientTransformation`` built by name.

This issue ships AdamW with linear warmup, cosine decay, global-norm clipping and weight decay
masked off norms, biases and embeddings. Other optimizers plug in here.
"""

import jax
import optax

from jaxaccel.errors import ConfigError

OPTIMIZERS = ("adamw",)


def warmup_cosine(learning_rate: float, warmup_steps: int, total_steps: int,
                  final_fraction: float = 0.1):
    """Linear warmup from 0 to ``learning_rate``, then cosine decay to ``final_fraction`` of it."""
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1), end_value=learning_rate * final_fraction)


def decay_mask(params):
    """True for the matrices that weight decay applies to: every >= 2-D kernel but embeddings."""
    def decays(path, leaf):
        names = [getattr(k, "key", getattr(k, "name", "")) for k in path]
        return leaf.ndim >= 2 and "embed" not in names
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(name: str = "adamw", *, learning_rate: float, weight_decay: float = 0.1,
                   warmup_steps: int = 0, total_steps: int, clip_norm: float | None = 1.0,
                   b1: float = 0.9, b2: float = 0.95):
    """Return ``(optimizer, schedule)``; ``schedule(step)`` gives the learning rate for metrics."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose --optimizer from {', '.join(OPTIMIZERS)}")
    if learning_rate <= 0:
        raise ConfigError(f"learning rate must be positive, got {learning_rate}; fix --learning-rate")
    schedule = warmup_cosine(learning_rate, warmup_steps, total_steps)
    parts = []
    if clip_norm:
        parts.append(optax.clip_by_global_norm(clip_norm))
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))
    return optax.chain(*parts), schedule
