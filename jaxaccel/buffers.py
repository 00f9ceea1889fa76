"""Buffers: leaves of the parameter dict that hold a technique's state, not weights.

Some techniques keep state beside the weights it belongs to: FP8's amax history per matmul
(``fp8_amax``, ``jaxaccel.fp8``), N:M sparsity's mask per weight (``nm_mask``,
``jaxaccel.sparsity``), token dropping's running loss per vocabulary entry (``token_loss``,
``jaxaccel.token_drop``). They live in the parameter dict next to their weights, so they are
stacked with ``scan_layers``, sharded by ``model.param_axes``, checkpointed, grown by progressive
stacking and restored like the weights, but they are not trained:

- ``lora.trainable(cfg)`` leaves them out, so the optimizer has no state for them and the
  gradient function computes no gradient for them;
- the step updates them after the optimizer's update (``updater(cfg)``, passed to
  ``train.make_train_step``) from what the step observed: FP8's amaxes come back as the
  cotangents of their history leaves (``observed``: ``grads.value_and_grad(observed=...)``),
  token dropping's losses as additive statistics (``aux["buffer_stats"]``), and the sparsity
  masks are recomputed from the new weights on their schedule.
"""

NAMES = ("fp8_amax", "nm_mask", "token_loss")
OBSERVED = ("fp8_amax",)       # the buffers whose cotangents are observations


def leaf_name(path_name: str) -> str:
    return path_name.rsplit("/", 1)[-1]


def is_buffer(path_name: str) -> bool:
    """Whether the parameter at ``path_name`` (``blocks/attn/wq/fp8_amax``) is a buffer."""
    return leaf_name(path_name) in NAMES


def observed(path_name: str) -> bool:
    """The predicate of ``grads.value_and_grad(observed=...)``: FP8's histories."""
    return leaf_name(path_name) in OBSERVED


def present(cfg) -> bool:
    """Whether a model of ``cfg`` (a ModelConfig) has buffers."""
    from jaxaccel import token_drop
    return bool(cfg.fp8 or cfg.sparsity != "none" or token_drop.has_buffer(cfg))


def updater(cfg):
    """``update(params, step, stats) -> params`` for the buffers of ``cfg``'s model (the hook of
    ``train.make_train_step``), or None when it has none."""
    if not present(cfg):
        return None
    from jaxaccel import fp8, sparsity, token_drop

    def update(params, step, stats):
        if cfg.fp8:
            params = fp8.update_histories(params, stats["observed_max"])
        if cfg.sparsity != "none":
            params = sparsity.update_masks(params, step, cfg)
        if token_drop.has_buffer(cfg):
            params = token_drop.update_buffer(params, stats, cfg)
        return params

    return update


def map_parents(tree, name: str, fn, *others):
    """``tree`` with every dict that holds a leaf ``name`` replaced by ``fn(that dict, *the dicts
    at the same path in others)``; ``others`` hold at least the paths to those dicts."""
    if not isinstance(tree, dict):
        return tree
    if name in tree:
        return fn(tree, *others)
    return {key: (map_parents(value, name, fn, *(o[key] for o in others))
                  if isinstance(value, dict) and all(key in o for o in others) else value)
            for key, value in tree.items()}
