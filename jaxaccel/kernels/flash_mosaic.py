"""The flash attention forward pass on Hopper's Mosaic GPU backend: TMA copies and wgmma.

The same function and outputs as the Triton forward of ``jaxaccel.kernels.flash`` (the output and
the base-2 log-sum-exp [B, H, T_pad], empty rows 0 and ``_EMPTY_LSE``), so the backward passes run
on either. One program holds ``2 * block_q`` query rows of one head and runs three warpgroups:

- two consumers, each with ``block_q`` rows (64 or 128), compute the scores of their rows against
  a key tile (``wgmma`` from shared memory, float32 accumulators in registers), the online
  softmax in base 2, and the probabilities times the value tile (``wgmma`` with the
  probabilities from registers);
- a producer copies key and value tiles from global to shared memory by TMA into a ring of
  ``num_stages`` slots, each slot reused when both consumers have arrived at its barrier (and
  waits for the last tile of each slot before the program ends).

The tiles visited come from the same tile schedule as the Triton kernel (``flash._runs``): the
producer copies the union of the two consumers' runs of key tiles; a consumer computes only its own
run (its mask-free tiles first, then the masked ones) and passes over the others' tiles at their
barriers. Grouped-query heads read their key/value head; segment ids are read from global memory
per tile. The sequence is padded outside to whole programs, the head dim to 64 or 128.

Off the GPU the kernel runs in Mosaic GPU's interpreter (``plgpu.InterpretGPUParams``), with
plain shared-memory layouts and the probabilities passed to the second wgmma through shared
memory (the interpreter's wgmma reads its left operand only from there); on the GPU the tiles are
swizzled for wgmma and the probabilities stay in registers.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

HEAD_DIMS = (64, 128)          # padded head dims the kernel takes (128-byte swizzle rows)
DTYPES = (jnp.bfloat16, jnp.float16)
BLOCK_Q = (64, 128)            # rows per consumer warpgroup
CONSUMERS = 2


def supports(dtype, head_dim_pad: int) -> bool:
    """Whether the Mosaic forward takes these inputs (else the Triton forward runs)."""
    return jnp.dtype(dtype) in [jnp.dtype(d) for d in DTYPES] and head_dim_pad in HEAD_DIMS


def program_rows(stage) -> int:
    """Query rows per program: what the sequence is padded to a multiple of."""
    return CONSUMERS * stage.block_q


def schedule(first, split, end):
    """int32 [B, programs, 2 + 3 * CONSUMERS] from the per-query-tile runs [B, tiles]: the union
    [lo, hi) of the program's consumers' runs, then each consumer's (first, split, end), an empty
    run placed at lo so that every loop bound stays inside the union."""
    B, n = first.shape
    runs = jnp.stack([first, split, end], -1).reshape(B, n // CONSUMERS, CONSUMERS, 3)
    empty = runs[..., 2] <= runs[..., 0]
    big = jnp.iinfo(jnp.int32).max
    lo = jnp.min(jnp.where(empty, big, runs[..., 0]), -1)
    hi = jnp.max(jnp.where(empty, 0, runs[..., 2]), -1)
    lo = jnp.where(hi > 0, lo, 0)
    hi = jnp.maximum(hi, lo)
    runs = jnp.where(empty[..., None], lo[..., None, None], runs)
    return jnp.concatenate([lo[..., None], hi[..., None],
                            runs.reshape(B, n // CONSUMERS, 3 * CONSUMERS)], -1).astype(jnp.int32)


def forward(q, k, v, segment_ids, sched, plan, stage, *, empty_lse: float, start_max: float):
    """Output [B, T_pad, H, E_pad] and log-sum-exp [B, H, T_pad] of padded inputs; ``sched`` from
    ``schedule``. ``plan`` is the flash kernel's (lengths, groups, causal, scale, interpret)."""
    B, T_pad, H, E = q.shape
    bq, bk, slots = stage.block_q, stage.block_k, stage.num_stages or 2
    dtype = q.dtype
    n_programs = T_pad // (CONSUMERS * bq)
    interpret = plan.interpret
    if interpret:
        transforms = ()
    else:   # 128-byte swizzled rows of 64 half-precision elements, 8 rows a tile
        transforms = (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
                      plgpu.SwizzleTransform(128))

    def body(sched_ref, q_ref, k_ref, v_ref, *refs):
        if plan.segments:
            seg_ref, out_ref, lse_ref, scratch = refs[0], refs[1], refs[2], refs[3:]
        else:
            seg_ref, (out_ref, lse_ref), scratch = None, refs[:2], refs[2:]
        (sched_smem, q_smem, k_smem, v_smem, lse_smem, p_smem, sched_bar, q_bar, k_ready,
         v_ready, k_free, v_free) = scratch
        h, p, b = lax.axis_index("heads"), lax.axis_index("q"), lax.axis_index("batch")
        wg = lax.axis_index("wg")

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.copy_gmem_to_smem(sched_ref.at[b, p], sched_smem, sched_bar)

        plgpu.barrier_wait(sched_bar)
        lo, hi = sched_smem[0], sched_smem[1]

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            _consumer(wg, h, b, p, lo, hi, sched_smem, q_ref, seg_ref, out_ref, lse_ref,
                      q_smem.at[wg], k_smem, v_smem, lse_smem.at[wg],
                      None if p_smem is None else p_smem.at[wg], q_bar.at[wg], k_ready,
                      v_ready, k_free, v_free)

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.set_max_registers(40, action="decrease")   # 2 x 128 x 232 + 128 x 40 <= 64 K
            _producer(h // plan.groups, b, lo, hi, k_ref, v_ref, k_smem, v_smem, k_ready,
                      v_ready, k_free, v_free)

    def _consumer(c, h, b, p, lo, hi, sched_smem, q_ref, seg_ref, out_ref, lse_ref, q_tile,
                  k_smem, v_smem, lse_tile, p_tile, q_bar, k_ready, v_ready, k_free, v_free):
        q0 = (p * CONSUMERS + c) * bq
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_tile, q_bar)
        first = sched_smem[2 + 3 * c]
        split = sched_smem[3 + 3 * c]
        end = sched_smem[4 + 3 * c]
        row = plgpu.Layout.WGMMA.reduce(1)
        seg_q = None
        if plan.segments:
            seg_q = plgpu.load(seg_ref.at[b, pl.ds(q0, bq)], layout=row, optimized=False)
        plgpu.barrier_wait(q_bar)

        def pass_over(j, carry):
            slot = lax.rem(j - lo, slots)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            return carry

        def visit(j, carry, masked):
            row_max, row_sum, acc = carry
            slot = lax.rem(j - lo, slots)
            plgpu.barrier_wait(k_ready.at[slot])

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].T)
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * plan.scale_log2
            if masked:
                s = jnp.where(_mask(j, q0, b, seg_q, seg_ref), s, -jnp.inf)
            new_max = jnp.maximum(row_max, s.max(axis=1))
            rescale = jnp.exp2(row_max - new_max)
            probs = jnp.exp2(s - lax.broadcast_in_dim(new_max, s.shape, [0]))
            row_sum = row_sum * rescale + probs.sum(axis=1)
            plgpu.barrier_wait(v_ready.at[slot])

            probs_in = probs.astype(dtype)
            if p_tile is not None:        # the interpreter's wgmma reads A from shared memory
                p_tile[...] = probs_in
                plgpu.commit_smem()
                probs_in = p_tile

            def values(acc_ref):
                plgpu.wgmma(acc_ref, probs_in, v_smem.at[slot])
                return acc_ref[...]

            pv = pl.run_scoped(values, plgpu.ACC((bq, E), jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0]) + pv
            return new_max, row_sum, acc

        carry = (plgpu.layout_cast(jnp.full((bq,), start_max, jnp.float32), row),
                 plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row),
                 plgpu.layout_cast(jnp.zeros((bq, E), jnp.float32), plgpu.Layout.WGMMA))
        lax.fori_loop(lo, first, pass_over, 0)
        carry = lax.fori_loop(first, split, lambda j, c: visit(j, c, False), carry)
        row_max, row_sum, acc = lax.fori_loop(split, end, lambda j, c: visit(j, c, True), carry)
        lax.fori_loop(end, hi, pass_over, 0)

        seen = row_sum > 0
        safe_sum = jnp.where(seen, row_sum, 1.0)
        out = acc / lax.broadcast_in_dim(safe_sum, acc.shape, [0])
        out = jnp.where(lax.broadcast_in_dim(seen, acc.shape, [0]), out, 0.0)
        q_tile[...] = out.astype(dtype)
        lse_tile[...] = jnp.where(seen, row_max + jnp.log2(safe_sum), empty_lse)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, out_ref.at[b, pl.ds(q0, bq), h])
        plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[b, h, pl.ds(q0, bq)])
        plgpu.wait_smem_to_gmem(0)

    def _mask(j, q0, b, seg_q, seg_ref):
        """Boolean [bq, bk] in the scores' layout: the query may attend to the key."""
        shape, layout = (bq, bk), plgpu.Layout.WGMMA
        k_pos = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout) + j * bk
        ok = k_pos < plan.seq_len
        if plan.causal:
            q_pos = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout) + q0
            ok = ok & (q_pos >= k_pos)
        if plan.segments:
            seg_k = plgpu.load(seg_ref.at[b, pl.ds(j * bk, bk)],
                               layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            ok = ok & (lax.broadcast_in_dim(seg_q, shape, [0])
                       == lax.broadcast_in_dim(seg_k, shape, [1]))
        return ok

    def _producer(kv_head, b, lo, hi, k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free,
                  v_free):
        def load(j, wait):
            slot = lax.rem(j - lo, slots)
            keys = (b, pl.ds(j * bk, bk), kv_head)
            if wait:
                plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
            if wait:
                plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])

        def drain(j, carry):     # the last tile of each slot: freed before the program ends
            slot = lax.rem(j - lo, slots)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            return carry

        filled = jnp.minimum(hi, lo + slots)
        lax.fori_loop(lo, filled, lambda j, c: (load(j, False), c)[1], 0)
        lax.fori_loop(filled, hi, lambda j, c: (load(j, True), c)[1], 0)
        lax.fori_loop(jnp.maximum(lo, hi - slots), hi, drain, 0)

    smem = [
        plgpu.SMEM((2 + 3 * CONSUMERS,), jnp.int32),
        plgpu.SMEM((CONSUMERS, bq, E), dtype, transforms=transforms),
        plgpu.SMEM((slots, bk, E), dtype, transforms=transforms),
        plgpu.SMEM((slots, bk, E), dtype, transforms=transforms),
        plgpu.SMEM((CONSUMERS, bq), jnp.float32),
        plgpu.SMEM((CONSUMERS, bq, bk), dtype) if interpret else None,
        plgpu.Barrier(),
        plgpu.Barrier(num_barriers=CONSUMERS),
        plgpu.Barrier(num_barriers=slots),
        plgpu.Barrier(num_barriers=slots),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=slots),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=slots),
    ]
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((B, T_pad, H, E), dtype),
                  jax.ShapeDtypeStruct((B, H, T_pad), jnp.float32)),
        scratch_types=smem, grid=(H, n_programs, B), grid_names=("heads", "q", "batch"),
        num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    args = (sched, q, k, v) + ((segment_ids,) if plan.segments else ())
    return kernel(*args)

