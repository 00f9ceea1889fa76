"""Backend parameters of the flash attention kernel, kept apart from its algorithm.

The algorithm (``jaxaccel.kernels.flash_attention``) needs only block sizes; how a backend runs a
block (Triton's warps and software-pipelining stages today, Mosaic GPU's warpgroups tomorrow) is
chosen here, per pass and per head dim. A new backend is a new table and a new
``compiler_params`` branch.

The Triton table holds starting points in the spirit of Triton's fused-attention tutorial (wide
query tiles forward, wide key tiles for dK/dV, wide query tiles for dQ; fewer, smaller tiles as
the head dim grows, to stay within registers and shared memory). They have not been measured
by us: ``python -m experiments.attention`` on a GPU is how to tune them.
"""

import dataclasses

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton


@dataclasses.dataclass(frozen=True)
class Stage:
    """How one pass tiles its work: query rows x key rows per tile, and Triton's launch knobs."""

    block_q: int
    block_k: int
    num_warps: int | None = None
    num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class FlashParams:
    """One ``Stage`` per pass: forward, dK/dV (a program per key tile), dQ (per query tile)."""

    forward: Stage
    dkv: Stage
    dq: Stage

    def stages(self) -> tuple[Stage, ...]:
        return (self.forward, self.dkv, self.dq)


# Largest head dim each row serves -> parameters (Triton backend, GPU).
TRITON = {
    64: FlashParams(forward=Stage(128, 64, 4, 3), dkv=Stage(32, 128, 4, 3),
                    dq=Stage(128, 32, 4, 3)),
    128: FlashParams(forward=Stage(128, 64, 8, 3), dkv=Stage(64, 128, 8, 2),
                     dq=Stage(128, 64, 8, 2)),
    256: FlashParams(forward=Stage(64, 32, 8, 2), dkv=Stage(32, 64, 8, 1),
                     dq=Stage(64, 32, 8, 1)),
}

# Interpret mode (CPU): every grid step is a loop iteration of an XLA program, so small tiles
# only cost time; 32 still gives several tiles at test lengths.
INTERPRET = FlashParams(forward=Stage(32, 32), dkv=Stage(32, 32), dq=Stage(32, 32))

MIN_BLOCK = 16   # Triton's dot needs every dimension of a tile product >= 16


def flash_params(head_dim: int, seq_len: int, *, interpret: bool, block_q: int | None = None,
                 block_k: int | None = None) -> FlashParams:
    """The table's parameters for this head dim; ``block_q``/``block_k`` override every pass.

    Blocks never exceed the sequence rounded up to a power of two (at least ``MIN_BLOCK``), so a
    short sequence is not padded to a long tile.
    """
    params = INTERPRET if interpret else next(
        p for d, p in sorted(TRITON.items()) if head_dim <= d)
    cap = max(MIN_BLOCK, pl.next_power_of_2(seq_len))

    def fit(stage: Stage) -> Stage:
        return dataclasses.replace(stage, block_q=min(block_q or stage.block_q, cap),
                                   block_k=min(block_k or stage.block_k, cap))

    return FlashParams(*(fit(s) for s in params.stages()))


def compiler_params(stage: Stage, *, interpret: bool):
    """The ``pallas_call`` compiler parameters for a stage: Triton's, or none when interpreting."""
    if interpret:
        return None
    return pl_triton.CompilerParams(num_warps=stage.num_warps, num_stages=stage.num_stages)
