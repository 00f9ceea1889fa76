"""N:M structured sparse training (``--sparsity 2:4``).

In every group of M consecutive input weights of a dense layer's column (``w[K, N]`` grouped
along K, the reduction axis, as NVIDIA's sparse tensor cores need), only the N of largest
magnitude are kept. 2:4 halves the multiplications of those matmuls; Ampere and Hopper tensor
cores run a 2:4 sparse operand at up to twice the dense rate.

The masks are buffers (``jaxaccel.buffers``): each sparse layer holds ``nm_mask`` (bool, the
kernel's shape) beside its kernel, computed from the kernel at initialisation and again from the
updated kernel every ``sparsity_every`` steps (``update_masks``). The forward pass multiplies by
``w * mask``; the backward pass is SR-STE's (Zhou et al. 2021, "Learning N:M Fine-grained
Structured Sparse Neural Networks From Scratch"): the dense weights get the gradient of the
sparse ones as if the mask were not there (straight-through), so pruned weights keep learning
and can grow back into the mask, plus ``sparsity_decay * (1 - mask) * w``, a decay on the pruned
weights only that keeps the masks from flipping back and forth.

Which layers: the blocks' q, k, v, o and MLP projections; the embedding and the output head stay
dense. What this saves and what runs: ``savings`` counts the FLOPs and weight bytes a 2:4 sparse
matmul would save. The speed itself needs sparse tensor-core kernels (cuSPARSELt, or CUTLASS's
sparse GEMMs), which XLA does not emit and jax 0.11.2 does not expose (``jax.experimental.sparse``
has BCOO/BCSR formats for unstructured sparsity, lowered to gathers and cuSPARSE SpMM, no N:M
format); so here the masked matmul is a dense one and runs at the dense speed: we measure the
quality cost of N:M training, and the savings stay counted, not timed.
"""

import functools

import jax
import jax.numpy as jnp

from jaxaccel.buffers import map_parents
from jaxaccel.errors import ConfigError

BUFFER = "nm_mask"


def parse_pattern(text: str) -> tuple[int, int]:
    """``"2:4"`` -> (2, 4): keep N of every M weights; one clear error otherwise."""
    n, sep, m = text.partition(":")
    try:
        n, m = int(n), int(m)
    except ValueError:
        n = m = None
    if not sep or n is None or not 0 < n < m:
        raise ConfigError(f"sparsity must be N:M with 0 < N < M (e.g. 2:4) or none, got "
                          f"{text!r}", field="model.sparsity")
    return n, m


def nm_mask(w, n: int, m: int):
    """The N:M mask of ``w`` [..., K, N_out]: in each group of ``m`` consecutive rows (inputs)
    of a column, True for the ``n`` of largest magnitude (ties go to the earlier row)."""
    *lead, K, cols = w.shape
    groups = jnp.abs(w.astype(jnp.float32)).reshape(*lead, K // m, m, cols)
    # A weight's rank in its group: how many others beat it (larger, or equal and earlier).
    a, b = groups[..., :, None, :], groups[..., None, :, :]        # [.., m (self), m (other), N]
    earlier = jnp.arange(m)[None, :] < jnp.arange(m)[:, None]      # other before self
    beaten_by = (b > a) | ((b == a) & earlier[:, :, None])
    rank = jnp.sum(beaten_by, axis=-2)
    return (rank < n).reshape(w.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def sparse_weight(w, mask, decay: float):
    """``w * mask``, whose gradient is SR-STE's: the incoming gradient unmasked, plus
    ``decay * (1 - mask) * w`` (module docstring)."""
    return jnp.where(mask, w, jnp.zeros((), w.dtype))


def _sparse_fwd(w, mask, decay):
    return sparse_weight(w, mask, decay), (w, mask)


def _sparse_bwd(decay, residuals, g):
    w, mask = residuals
    pruned = jnp.where(mask, 0.0, decay * w.astype(jnp.float32))
    return (g.astype(jnp.float32) + pruned).astype(w.dtype), None


sparse_weight.defvjp(_sparse_fwd, _sparse_bwd)


def update_masks(params, step, cfg):
    """``params`` with every ``nm_mask`` recomputed from its (updated) kernel after steps
    ``sparsity_every - 1``, ``2 * sparsity_every - 1``, ...; unchanged after the others."""
    n, m = parse_pattern(cfg.sparsity)
    due = (step + 1) % cfg.sparsity_every == 0

    def refresh(layer):
        fresh = nm_mask(layer["kernel"], n, m)
        return {**layer, BUFFER: jnp.where(due, fresh, layer[BUFFER])}

    return map_parents(params, BUFFER, refresh)


def init_masks(params, cfg):
    """``params`` with every ``nm_mask`` set from its freshly initialised kernel."""
    n, m = parse_pattern(cfg.sparsity)
    return map_parents(params, BUFFER,
                       lambda layer: {**layer, BUFFER: nm_mask(layer["kernel"], n, m)})


def density(params) -> float:
    """The share of the masked weights that the masks keep (N/M when every mask is N:M)."""
    kept, total = 0, 0
    for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if str(getattr(leaf_path[-1], "key", "")) == BUFFER:
            kept += int(jnp.sum(leaf))
            total += leaf.size
    return kept / max(total, 1)


def sparse_params(cfg) -> int:
    """Weights of ``cfg``'s model under N:M masks (the blocks' projections)."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    mlp = d * cfg.d_ff * (3 if cfg.mlp == "swiglu" else 2)
    return cfg.n_layers * (attn + mlp)


def savings(cfg, seq_len: int, bytes_per_weight: int = 2) -> dict:
    """What an N:M sparse matmul would save on the model of ``cfg`` per token trained:

    - ``flops_share``: the share of the training FLOPs (``model.flops_per_token``) that the
      sparse operand removes, (1 - N/M) of the masked weights' 6 FLOPs per token (forward and
      both backward matmuls; the weight gradient is dense in NVIDIA's recipe, so the share
      counting only forward and input gradient, 4 of the 6, is ``flops_share_fwd_dgrad``);
    - ``weight_bytes_share``: the share of the masked weights' bytes saved when stored
      compressed (values N/M of them, plus 2 bits of index per kept value for 2:4, as
      cuSPARSELt stores them).
    """
    from jaxaccel.model import flops_per_token
    n, m = parse_pattern(cfg.sparsity)
    sparse = sparse_params(cfg)
    total = flops_per_token(cfg, seq_len)
    index_bits = max(1, (m - 1).bit_length())
    compressed = n / m * (1 + index_bits / (8 * bytes_per_weight))
    return {"pattern": f"{n}:{m}", "sparse_params": sparse,
            "flops_share": 6 * sparse * (1 - n / m) / total,
            "flops_share_fwd_dgrad": 4 * sparse * (1 - n / m) / total,
            "weight_bytes_share": 1 - compressed}
