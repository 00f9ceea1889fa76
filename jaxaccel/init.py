"""Initialisation schemes that let a transformer train without warmup or normalisation.

``model.init`` picks one; ``jaxaccel.model.init_params`` builds the architecture it needs (the
Fixup family drops the blocks' RMSNorms, keeping only the final norm before the head, which is
outside the residual stream these papers analyse) and then calls ``initialize(params, cfg, key)``,
a function of the parameter tree and the model config. Each scheme is one function:

- ``default``: GPT-2's: every matmul weight and the embedding N(0, 0.02), the residual output
  projections (``wo``, ``w_out``) N(0, 0.02 / sqrt(2 L)), with pre-norm blocks. What the model
  builds; nothing changes.
- ``rezero`` (Bachlechner et al. 2020, "ReZero is All You Need: Fast Convergence at Large
  Depth"): ``x_{l+1} = x_l + alpha_l F_l(x_l)`` with one learned scalar ``alpha_l`` per block,
  shared by its attention and MLP branches as in the paper's transformer layer, initialised to
  ``alpha_l = 0``, and no normalisation: every block starts as the identity map.
- ``skipinit`` (De & Smith 2020, "Batch Normalization Biases Residual Blocks Towards the
  Identity Function in Deep Networks"): a learned scalar multiplier at the end of every
  residual branch (``attn_alpha``, ``mlp_alpha``: two per block), initialised to 0, the
  normalisation removed; also the identity map at initialisation.
- ``tfixup`` (Huang et al. 2020, "Improving Transformer Optimization Through Better
  Initialization"), the decoder's rule with M = L blocks: Xavier-uniform initialisation of every
  projection (U(-a, a), a = sqrt(6 / (fan_in + fan_out))), the input embedding N(0, d^-1/2),
  then the embedding, each block's value and output projections (``wv``, ``wo``) and its MLP
  weights scaled by ``(9 L)^(-1/4)``; queries and keys keep their Xavier scale. No
  normalisation in the blocks and, the paper's point, no learning-rate warmup.

Random draws are keyed by each weight's path and layer index, so unrolled and stacked
(``scan_layers``) blocks get the same values for the same key.
"""

import zlib

import jax
import jax.numpy as jnp



def _named_leaves(params):
    """(name, layer, leaf, rebuild) for every leaf: ``name`` the path without the layer index,
    ``layer`` the index of an unrolled block (None for stacked blocks and other weights)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, leaf in flat:
        keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
        layer = None
        if keys[0] == "blocks" and len(keys) > 1 and isinstance(keys[1], int):
            layer = keys[1]
            keys = [keys[0], *keys[2:]]
        out.append(("/".join(map(str, keys)), layer, leaf))
    return out, treedef


def _layer_names(name: str) -> tuple[str, str]:
    """(layer, leaf) of a path name: ``blocks/attn/wv/kernel`` -> (``wv``, ``kernel``)."""
    parts = name.split("/")
    return (parts[-2] if len(parts) > 1 else parts[0]), parts[-1]


def _xavier(key, shape, dtype):
    """Xavier/Glorot uniform over the last two dimensions (fan in, fan out)."""
    fan_in, fan_out = shape[-2], shape[-1]
    limit = (6.0 / (fan_in + fan_out)) ** 0.5
    return jax.random.uniform(key, shape, dtype, -limit, limit)


def _draw(key, name, layer, leaf, sample):
    """``sample(key, shape)`` keyed by the weight's name and layer (per layer for stacked ones)."""
    key = jax.random.fold_in(key, zlib.crc32(name.encode()))
    if name.startswith("blocks/") and layer is None and leaf.ndim >= 1:   # stacked [L, ...]
        return jnp.stack([sample(jax.random.fold_in(key, i), leaf.shape[1:])
                          for i in range(leaf.shape[0])])
    return sample(jax.random.fold_in(key, 0 if layer is None else layer), leaf.shape)


def default(params, cfg, key):
    """GPT-2's initialisation, as the model builds it."""
    return params


def _zero_gates(params, gates):
    leaves, treedef = _named_leaves(params)
    return jax.tree_util.tree_unflatten(treedef, [
        jnp.zeros_like(leaf) if _layer_names(name)[0] in gates else leaf
        for name, _, leaf in leaves])


def rezero(params, cfg, key):
    """ReZero: every block's ``alpha`` = 0."""
    return _zero_gates(params, ("alpha",))


def skipinit(params, cfg, key):
    """SkipInit: every branch's multiplier (``attn_alpha``, ``mlp_alpha``) = 0."""
    return _zero_gates(params, ("attn_alpha", "mlp_alpha"))


# T-Fixup's weights, by layer name.
TFIXUP_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_in", "w_gate", "w_out", "head")
TFIXUP_SCALED = ("embed", "wv", "wo", "w_in", "w_gate", "w_out")


def tfixup_scale(n_layers: int) -> float:
    """T-Fixup's decoder factor ``(9 L)^(-1/4)``."""
    return (9.0 * n_layers) ** -0.25


def tfixup(params, cfg, key):
    """T-Fixup: Xavier projections, N(0, d^-1/2) embedding, the embedding, v, o and MLP weights
    scaled by ``(9 L)^(-1/4)``."""
    scale = tfixup_scale(cfg.n_layers)
    leaves, treedef = _named_leaves(params)
    new = []
    for name, layer, leaf in leaves:
        module, leaf_name = _layer_names(name)
        if leaf_name == "kernel" and module in TFIXUP_PROJECTIONS:
            leaf = _draw(key, name, layer, leaf, lambda k, s: _xavier(k, s, leaf.dtype))
        elif module == "embed" and leaf_name == "embedding":
            std = cfg.d_model ** -0.5
            leaf = _draw(key, name, layer, leaf,
                         lambda k, s: std * jax.random.normal(k, s, leaf.dtype))
        if module in TFIXUP_SCALED and leaf_name in ("kernel", "embedding"):
            leaf = leaf * scale
        new.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, new)


SCHEMES = {"default": default, "rezero": rezero, "skipinit": skipinit, "tfixup": tfixup}
INIT_SCHEMES = tuple(SCHEMES)


def initialize(params, cfg, key):
    """``params`` (as the model built them) initialised by ``cfg.init``'s scheme."""
    return SCHEMES[cfg.init](params, cfg, key)
