"""N:M structured sparse training (``--sparsity 2:4``).

In every group of M consecutive input weights of a column (``w[K, N]`` grouped along K, as
NVIDIA's sparse tensor cores need) only the N largest in magnitude are kept. ``apply`` wraps
each ``--sparsity-targets`` layer (default: the ``nn.Stack``'s linear layers) in ``Sparse``,
whose ``Mask`` buffer is recomputed from the kernel every ``sparsity_every`` steps. Gradients
are SR-STE's (Zhou et al. 2021, "Learning N:M Fine-grained Structured Sparse Neural Networks
From Scratch"): straight through to the dense weights, plus ``sparsity_decay * (1 - mask) * w``.

Ampere and Hopper run a 2:4 operand at up to twice the dense rate, with cuSPARSELt or CUTLASS
kernels that XLA does not emit and jax 0.11.2 does not expose (``jax.experimental.sparse`` has
no N:M format): the masked matmul runs dense, and ``savings`` counts what it would save.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.model import nn
from jaxaccel.techniques import surgery
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import SparsitySettings     # declared without jax
from jaxaccel.core.sharding import refuse_pipeline


def parse_pattern(text: str) -> tuple[int, int]:
    """``"2:4"`` -> (2, 4): keep N of every M weights; one clear error otherwise."""
    n, sep, m = text.partition(":")
    try:
        n, m = int(n), int(m)
    except ValueError:
        n = m = None
    if not sep or n is None or not 0 < n < m:
        raise ConfigError(f"sparsity must be N:M with 0 < N < M (e.g. 2:4) or none, got "
                          f"{text!r}", field="sparsity.pattern")
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


class Mask(nn.Buffer):
    """A sparse layer's N:M mask (bool, the kernel's shape)."""


class Sparse(surgery.Wrapper, nn.Updated):
    """The wrapped layer multiplies by its N:M-masked kernel (SR-STE gradients)."""

    changes_product = True

    def __init__(self, base, n: int, m: int, decay: float, every: int):
        super().__init__(base)
        k_in = self.kernel.shape[-2]
        if k_in % m:
            raise ConfigError(f"sparsity {n}:{m} groups {m} input features, but a targeted "
                              f"layer has {k_in}; choose layers (--sparsity-targets) or a "
                              f"model whose input widths are multiples of {m}",
                              field="sparsity.pattern")
        self.n, self.m, self.decay, self.every = n, m, decay, every
        self.mask = Mask(nm_mask(self.kernel[...], n, m), eager_sharding=False,
                         out_sharding=surgery.kernel_axes(base))

    def __call__(self, x, *args, **kwargs):
        mask, decay = self.mask[...], self.decay

        def masked(inner):
            return lambda x, kernel, *a, **kw: inner(x, sparse_weight(kernel, mask, decay), *a,
                                                     **kw)

        with surgery.dot(self.linear(), masked):
            return self.base(x, *args, **kwargs)

    def fold(self) -> None:
        self.kernel[...] = jnp.where(self.mask[...], self.kernel[...], 0).astype(
            self.kernel[...].dtype)

    def update(self, step, stats, observed):
        """Recompute the mask from the updated kernel after steps ``every - 1``,
        ``2 every - 1``, ...; unchanged after the others (a ``where``: nothing recompiles)."""
        due = (step + 1) % self.every == 0
        fresh = nm_mask(self.kernel[...], self.n, self.m)
        self.mask[...] = jnp.where(due, fresh, self.mask[...])


def check(cfg) -> None:
    """The pattern, and what N:M sparsity cannot combine with: pipeline stages."""
    if cfg.sparsity.pattern != "none":
        parse_pattern(cfg.sparsity.pattern)
        refuse_pipeline(cfg.mesh.strategy, "sparsity", "sparsity.pattern")


def apply(model, settings: SparsitySettings) -> int:
    """Wrap the targeted linear layers of ``model`` in ``Sparse``; how many (0 when off)."""
    if settings.pattern == "none":
        return 0
    n, m = parse_pattern(settings.pattern)
    return surgery.wrap(model, settings.targets, lambda path, layer: Sparse(
        layer, n, m, settings.decay, settings.every), field="sparsity.targets")


def masks(state) -> list:
    return jax.tree.leaves(nnx.filter_state(state, Mask))


def density(state) -> float:
    """The share of the masked weights that the masks keep (N/M when every mask is N:M)."""
    leaves = masks(state)
    return sum(int(jnp.sum(m)) for m in leaves) / max(sum(m.size for m in leaves), 1)


def savings(state, pattern: str, flops_per_token: float, bytes_per_weight: int = 2) -> dict:
    """What N:M sparse matmuls would save per token trained: ``flops_share`` of the training
    FLOPs, (1 - N/M) of the masked weights' 6 FLOPs per token (``flops_share_fwd_dgrad``: 4 of
    the 6, NVIDIA's recipe keeping the weight gradient dense), and ``weight_bytes_share`` of their
    bytes, stored compressed (N/M of the values plus 2 index bits each for 2:4, as cuSPARSELt)."""
    n, m = parse_pattern(pattern)
    sparse = sum(mask.size for mask in masks(state))
    index_bits = max(1, (m - 1).bit_length())
    compressed = n / m * (1 + index_bits / (8 * bytes_per_weight))
    return {"pattern": f"{n}:{m}", "sparse_params": sparse,
            "flops_share": 6 * sparse * (1 - n / m) / flops_per_token,
            "flops_share_fwd_dgrad": 4 * sparse * (1 - n / m) / flops_per_token,
            "weight_bytes_share": 1 - compressed}


WRAPPERS = (Sparse,)


def transform(model, cfg, ctx) -> None:
    apply(model, cfg.sparsity)


def report(cfg, ctx) -> dict | None:
    pattern = cfg.sparsity.pattern
    if pattern == "none":
        return None
    return {"pattern": pattern, "density": density(ctx.params),
            **savings(ctx.params, pattern, ctx.run.get("flops_per_token") or 1.0)}


def describe(report: dict) -> str:
    return f"{report['pattern']} sparse ({report['density']:.1%} of the masked weights kept)"
