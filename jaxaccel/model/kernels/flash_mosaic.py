"""Flash attention's three passes on Hopper's Mosaic GPU backend: TMA copies and wgmma.

Same inputs and outputs as the Triton passes of ``jaxaccel.model.kernels.flash``, so each pass runs
on either backend. A program owns ``2 x rows`` rows (queries, or keys and values for dK/dV): two
consumer warpgroups each load ``rows`` (64 or 128) once; a producer streams the other side's tiles
(for dK/dV, of each query head of the group in turn) by TMA into a ring of ``num_stages``
shared-memory slots, reusing a slot once both consumers arrived at its barrier. It streams the
union of the consumers' runs (``flash._runs``); each consumer computes its own run and passes over
the others. Products are ``wgmma`` into float32 registers, the second one's left operand from
registers; in Mosaic GPU's interpreter (off the GPU) that operand passes through unswizzled shared
memory, the only place the interpreter's wgmma reads it from.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

HEAD_DIMS = (64, 128)          # padded head dims the kernels take (128-byte swizzled rows)
DTYPES = (jnp.bfloat16, jnp.float16)
ROWS = (64, 128)               # rows of a consumer warpgroup
CONSUMERS = 2
ROW = plgpu.Layout.WGMMA.reduce(1)      # a vector along the rows of a [rows, streamed] tile
COLUMN = plgpu.Layout.WGMMA.reduce(0)   # a vector along its columns


def supports(dtype, head_dim_pad: int) -> bool:
    """Whether the Mosaic kernels take these inputs (else the Triton passes run)."""
    return jnp.dtype(dtype) in [jnp.dtype(d) for d in DTYPES] and head_dim_pad in HEAD_DIMS


def own_rows(name: str, stage) -> int:
    """Rows of one consumer in pass ``name``: keys for dK/dV, queries otherwise."""
    return stage.block_k if name == "dkv" else stage.block_q


def program_rows(name: str, stage) -> int:
    """Rows of one program: what the sequence is padded to a multiple of."""
    return CONSUMERS * own_rows(name, stage)


def schedule(first, split, end):
    """int32 [B, programs, 2 + 3 * CONSUMERS] from per-tile runs [B, tiles]: the union [lo, hi)
    of the consumers' runs, then each one's (first, split, end), an empty run placed at lo."""
    B, n = first.shape
    runs = jnp.stack([first, split, end], -1).reshape(B, n // CONSUMERS, CONSUMERS, 3)
    empty = runs[..., 2] <= runs[..., 0]
    lo = jnp.min(jnp.where(empty, jnp.iinfo(jnp.int32).max, runs[..., 0]), -1)
    hi = jnp.max(jnp.where(empty, 0, runs[..., 2]), -1)
    lo = jnp.where(hi > 0, lo, 0)
    hi = jnp.maximum(hi, lo)
    runs = jnp.where(empty[..., None], lo[..., None, None], runs)
    return jnp.concatenate([lo[..., None], hi[..., None],
                            runs.reshape(B, n // CONSUMERS, 3 * CONSUMERS)], -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What every pass's kernel needs to know, static."""

    plan: object          # flash._Plan
    rows: int             # a consumer's own rows
    streamed: int         # rows of a streamed tile
    slots: int
    dtype: object
    head_dim: int
    heads_per_program: int  # query heads a program walks (the group, for dK/dV)

    @property
    def transforms(self):
        if self.plan.interpret:
            return ()
        item = jnp.dtype(self.dtype).itemsize   # 128-byte swizzled rows, 8 rows a tile
        return (plgpu.TilingTransform((8, 128 // item)), plgpu.SwizzleTransform(128))

    def tile(self, rows: int, count: int = 1):
        return plgpu.SMEM((count, rows, self.head_dim), self.dtype, transforms=self.transforms)


def _operand(x, staging, dtype):
    """A register tile as wgmma's left operand (through ``staging`` in the interpreter)."""
    x = x.astype(dtype)
    if staging is None:
        return x
    staging[...] = x
    plgpu.commit_smem()
    return staging


def _product(a, b, shape):
    """a @ b by wgmma into a fresh float32 accumulator of ``shape``; its value."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _mask(shape: _Shape, own_first, other_first, b, seg_own, seg_ref, *, keys_own: bool):
    """Boolean [rows, streamed] in the scores' layout (rows: keys if ``keys_own``), None: all."""
    plan, tile = shape.plan, (shape.rows, shape.streamed)
    own = plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=plgpu.Layout.WGMMA) + own_first
    other = plgpu.broadcasted_iota(jnp.int32, tile, 1, layout=plgpu.Layout.WGMMA) + other_first
    q_pos, k_pos = (other, own) if keys_own else (own, other)
    ok = None if keys_own else k_pos < plan.seq_len    # dK/dV drops keys past the end
    if plan.causal:
        ok = (q_pos >= k_pos) if ok is None else ok & (q_pos >= k_pos)
    if plan.segments:
        seg_other = plgpu.load(seg_ref.at[b, pl.ds(other_first, shape.streamed)],
                               layout=COLUMN, optimized=False)
        same = (lax.broadcast_in_dim(seg_own, tile, [0])
                == lax.broadcast_in_dim(seg_other, tile, [1]))
        ok = same if ok is None else ok & same
    return ok


def _masked(s, ok):
    return s if ok is None else jnp.where(ok, s, -jnp.inf)


def _run(shape: _Shape, grid_heads: int, n_programs: int, batch: int, out_type, own_index,
         streamed_index, consumer, n_own: int, n_streamed: int, n_extra: int):
    """The kernel of every pass. Operands: the schedule, ``n_own`` arrays the consumers own,
    ``n_streamed`` streamed, ``n_extra`` more, segment ids if any; ``own_index(h, b, r0)`` and
    ``streamed_index(h, b, g, i)`` index their tiles; ``consumer(...)`` runs one consumer."""
    plan = shape.plan

    def body(sched_ref, *refs):
        r = _Refs.of(plan, out_type, n_own, n_streamed, n_extra, sched_ref, refs)
        h, p, b = lax.axis_index("heads"), lax.axis_index("p"), lax.axis_index("batch")
        wg = lax.axis_index("wg")

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.copy_gmem_to_smem(r.sched.at[b, p], r.sched_smem, r.sched_bar)

        plgpu.barrier_wait(r.sched_bar)
        lo, hi = r.sched_smem[0], r.sched_smem[1]
        n = hi - lo

        @pl.when(wg < CONSUMERS)
        def _():
            _consume(shape, r, own_index, consumer, wg, h, p, b, lo, hi, n)

        @pl.when(wg == CONSUMERS)
        def _():
            _produce(shape, r, streamed_index, h, b, lo, n)

    return plgpu.kernel(
        body, out_type=out_type, scratch_types=_scratch_types(shape, n_own, n_streamed),
        grid=(grid_heads, n_programs, batch),
        grid_names=("heads", "p", "batch"), num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=None if plan.interpret else plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if plan.interpret else None)


def _scratch_types(shape: _Shape, n_own: int, n_streamed: int) -> list:
    """The kernel's shared memory and barriers, in ``_Refs``' scratch order."""
    return [
        plgpu.SMEM((2 + 3 * CONSUMERS,), jnp.int32),
        [shape.tile(shape.rows, CONSUMERS) for _ in range(n_own)],
        [shape.tile(shape.streamed, shape.slots) for _ in range(n_streamed)],
        plgpu.SMEM((CONSUMERS, shape.rows), jnp.float32),
        plgpu.SMEM((CONSUMERS, shape.rows, shape.streamed), shape.dtype)
        if shape.plan.interpret else None,
        plgpu.Barrier(),
        plgpu.Barrier(num_barriers=(n_own, CONSUMERS)),
        plgpu.Barrier(num_barriers=(n_streamed, shape.slots)),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=(n_streamed, shape.slots)),
    ]


@dataclasses.dataclass
class _Refs:
    """The kernel body's operands and scratch (``_scratch_types``), by name."""

    sched: object
    own: tuple
    streamed: tuple
    extra: tuple
    seg: object               # the segment ids, or None
    out: tuple
    sched_smem: object
    own_smem: list
    ring: list                # per streamed operand: its ``slots`` tiles
    vectors: object
    staging: object           # wgmma's left operand in the interpreter, else None
    sched_bar: object
    own_bar: object
    ready: object
    free: object

    @classmethod
    def of(cls, plan, out_type, n_own: int, n_streamed: int, n_extra: int, sched_ref, refs):
        """``body``'s arguments by name: the operands in ``_run``'s order, the outputs, the
        scratch."""
        own_refs, refs = refs[:n_own], refs[n_own:]
        stream_refs, refs = refs[:n_streamed], refs[n_streamed:]
        extra_refs, refs = refs[:n_extra], refs[n_extra:]
        seg_ref, refs = (refs[0], refs[1:]) if plan.segments else (None, refs)
        n_out = len(jax.tree.leaves(out_type))
        out_refs, scratch = refs[:n_out], refs[n_out:]
        return cls(sched_ref, own_refs, stream_refs, extra_refs, seg_ref, out_refs, *scratch)


def _consume(shape: _Shape, r: _Refs, own_index, consumer, wg, h, p, b, lo, hi, n):
    """Consumer warpgroup ``wg``: load its own rows, then ``consumer`` over the streamed tiles."""
    n_own, n_streamed = len(r.own), len(r.streamed)
    plgpu.set_max_registers(232, action="increase")
    c = wg
    r0 = (p * CONSUMERS + c) * shape.rows
    tiles = [smem.at[c] for smem in r.own_smem]
    for k, (ref, index) in enumerate(zip(r.own, own_index(h, b, r0))):
        plgpu.copy_gmem_to_smem(ref.at[index], tiles[k], r.own_bar.at[k, c])
    runs = [r.sched_smem[2 + 3 * c + k] for k in range(3)]
    seg_own = None
    if shape.plan.segments:
        seg_own = plgpu.load(r.seg.at[b, pl.ds(r0, shape.rows)], layout=ROW,
                             optimized=False)
    for k in range(n_own):
        plgpu.barrier_wait(r.own_bar.at[k, c])

    def wait_tile(step):
        slot = lax.rem(step, shape.slots)
        for k in range(n_streamed):
            plgpu.barrier_wait(r.ready.at[k, slot])
        return slot, [t.at[slot] for t in r.ring]

    def release(slot):
        for k in range(n_streamed):
            plgpu.barrier_arrive(r.free.at[k, slot])

    consumer(h=h, b=b, r0=r0, lo=lo, hi=hi, n=n, runs=runs, tiles=tiles,
             wait_tile=wait_tile, release=release, seg_own=seg_own, seg_ref=r.seg,
             staging=None if r.staging is None else r.staging.at[c], vector=r.vectors.at[c],
             out_refs=r.out, extra_refs=r.extra)


def _produce(shape: _Shape, r: _Refs, streamed_index, h, b, lo, n):
    """The producer warpgroup: the union's tiles of each head in turn into the ring, a slot
    refilled once both consumers freed it; then waits for the last ones to be freed."""
    n_streamed = len(r.streamed)
    plgpu.set_max_registers(40, action="decrease")   # 2 x 128 x 232 + 128 x 40 <= 64 K
    per_head = jnp.maximum(n, 1)

    def load(step, wait):
        slot = lax.rem(step, shape.slots)
        g, i = step // per_head, lo + lax.rem(step, per_head)
        for k, (ref, index) in enumerate(zip(r.streamed, streamed_index(h, b, g, i))):
            if wait:
                plgpu.barrier_wait(r.free.at[k, slot])
            plgpu.copy_gmem_to_smem(ref.at[index], r.ring[k].at[slot], r.ready.at[k, slot])

    def drain(step, carry):
        slot = lax.rem(step, shape.slots)
        for k in range(n_streamed):
            plgpu.barrier_wait(r.free.at[k, slot])
        return carry

    steps = shape.heads_per_program * n
    filled = jnp.minimum(steps, shape.slots)
    lax.fori_loop(0, filled, lambda s, c: (load(s, False), c)[1], 0)
    lax.fori_loop(filled, steps, lambda s, c: (load(s, True), c)[1], 0)
    lax.fori_loop(jnp.maximum(0, steps - shape.slots), steps, drain, 0)


def _loops(lo, hi, runs, visit, pass_over, carry, *, free_first: bool, step0=0):
    """Visit the own run's tiles, pass over the union's others; ``step0``: the first ring step."""
    first, split, end = runs
    masked_first = not free_first
    carry = lax.fori_loop(lo, first, lambda i, c: pass_over(step0 + i - lo, c), carry)
    carry = lax.fori_loop(first, split, lambda i, c: visit(i, step0 + i - lo, c, masked_first),
                          carry)
    carry = lax.fori_loop(split, end, lambda i, c: visit(i, step0 + i - lo, c, not masked_first),
                          carry)
    return lax.fori_loop(end, hi, lambda i, c: pass_over(step0 + i - lo, c), carry)


def forward(q, k, v, segment_ids, sched, plan, stage, *, empty_lse: float, start_max: float):
    """Output [B, T_pad, H, E_pad] and log-sum-exp [B, H, T_pad] of padded inputs."""
    B, T_pad, H, E = q.shape
    shape = _Shape(plan, stage.block_q, stage.block_k, stage.num_stages or 2, q.dtype, E, 1)
    bq, bk = shape.rows, shape.streamed

    def own_index(h, b, r0):
        return [(b, pl.ds(r0, bq), h)]

    def streamed_index(h, b, g, j):
        keys = (b, pl.ds(j * bk, bk), h // plan.groups)
        return [keys, keys]

    def consumer(h, b, r0, lo, hi, n, runs, tiles, wait_tile, release, seg_own, seg_ref,
                 staging, vector, out_refs, extra_refs):
        (q_tile,) = tiles
        out_ref, lse_ref = out_refs

        def pass_over(step, carry):
            release(wait_tile(step)[0])
            return carry

        def visit(j, step, carry, masked):
            row_max, row_sum, acc = carry
            slot, (k_tile, v_tile) = wait_tile(step)
            s = _product(q_tile, k_tile.T, (bq, bk)) * plan.scale_log2
            if masked:
                s = _masked(s, _mask(shape, r0, j * bk, b, seg_own, seg_ref, keys_own=False))
            new_max = jnp.maximum(row_max, s.max(axis=1))
            rescale = jnp.exp2(row_max - new_max)
            probs = jnp.exp2(s - lax.broadcast_in_dim(new_max, s.shape, [0]))
            row_sum = row_sum * rescale + probs.sum(axis=1)
            pv = _product(_operand(probs, staging, shape.dtype), v_tile, (bq, E))
            release(slot)
            acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0]) + pv
            return new_max, row_sum, acc

        carry = (plgpu.layout_cast(jnp.full((bq,), start_max, jnp.float32), ROW),
                 plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), ROW),
                 plgpu.layout_cast(jnp.zeros((bq, E), jnp.float32), plgpu.Layout.WGMMA))
        row_max, row_sum, acc = _loops(lo, hi, runs, visit, pass_over, carry, free_first=True)
        seen = row_sum > 0
        safe_sum = jnp.where(seen, row_sum, 1.0)
        out = acc / lax.broadcast_in_dim(safe_sum, acc.shape, [0])
        q_tile[...] = jnp.where(lax.broadcast_in_dim(seen, acc.shape, [0]), out,
                                0.0).astype(shape.dtype)
        lse = jnp.where(seen, row_max + jnp.log2(safe_sum), empty_lse)
        _store(q_tile, out_ref.at[b, pl.ds(r0, bq), h])
        vector[...] = lse
        _store(vector, lse_ref.at[b, h, pl.ds(r0, bq)])

    kernel = _run(shape, H, T_pad // (CONSUMERS * bq), B,
                  (jax.ShapeDtypeStruct((B, T_pad, H, E), q.dtype),
                   jax.ShapeDtypeStruct((B, H, T_pad), jnp.float32)),
                  own_index, streamed_index, consumer, n_own=1, n_streamed=2, n_extra=0)
    return kernel(sched, q, k, v, *_segments(plan, segment_ids))


def dq(q, k, v, d_out, lse, delta, segment_ids, sched, plan, stage):
    """dQ [B, T_pad, H, E_pad] of padded inputs, summed over each query's key tiles."""
    B, T_pad, H, E = q.shape
    shape = _Shape(plan, stage.block_q, stage.block_k, stage.num_stages or 2, q.dtype, E, 1)
    bq, bk = shape.rows, shape.streamed

    def own_index(h, b, r0):
        return [(b, pl.ds(r0, bq), h)] * 2

    def streamed_index(h, b, g, j):
        return [(b, pl.ds(j * bk, bk), h // plan.groups)] * 2

    def consumer(h, b, r0, lo, hi, n, runs, tiles, wait_tile, release, seg_own, seg_ref,
                 staging, vector, out_refs, extra_refs):
        q_tile, do_tile = tiles
        (dq_ref,) = out_refs
        lse_ref, delta_ref = extra_refs
        lse = plgpu.load(lse_ref.at[b, h, pl.ds(r0, bq)], layout=ROW, optimized=False)
        dlt = plgpu.load(delta_ref.at[b, h, pl.ds(r0, bq)], layout=ROW, optimized=False)

        def pass_over(step, carry):
            release(wait_tile(step)[0])
            return carry

        def visit(j, step, acc, masked):
            slot, (k_tile, v_tile) = wait_tile(step)
            s = _product(q_tile, k_tile.T, (bq, bk)) * plan.scale_log2
            if masked:
                s = _masked(s, _mask(shape, r0, j * bk, b, seg_own, seg_ref, keys_own=False))
            probs = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            dp = _product(do_tile, v_tile.T, (bq, bk))
            ds = probs * (dp - lax.broadcast_in_dim(dlt, s.shape, [0]))
            acc = acc + _product(_operand(ds, staging, shape.dtype), k_tile, (bq, E))
            release(slot)
            return acc

        acc = plgpu.layout_cast(jnp.zeros((bq, E), jnp.float32), plgpu.Layout.WGMMA)
        acc = _loops(lo, hi, runs, visit, pass_over, acc, free_first=True)
        q_tile[...] = (acc * plan.scale).astype(shape.dtype)
        _store(q_tile, dq_ref.at[b, pl.ds(r0, bq), h])

    kernel = _run(shape, H, T_pad // (CONSUMERS * bq), B,
                  (jax.ShapeDtypeStruct((B, T_pad, H, E), q.dtype),), own_index,
                  streamed_index, consumer, n_own=2, n_streamed=2, n_extra=2)
    return kernel(sched, q, d_out, k, v, lse, delta, *_segments(plan, segment_ids))[0]


def dkv(q, k, v, d_out, lse, delta, segment_ids, sched, plan, stage):
    """dK and dV [B, T_pad, K, E_pad] of padded inputs, summed in a fixed order."""
    B, T_pad, K, E = k.shape
    G = plan.groups
    shape = _Shape(plan, stage.block_k, stage.block_q, stage.num_stages or 2, k.dtype, E, G)
    bk, bq = shape.rows, shape.streamed

    def own_index(h, b, r0):
        return [(b, pl.ds(r0, bk), h)] * 2

    def streamed_index(h, b, g, i):
        return [(b, pl.ds(i * bq, bq), h * G + g)] * 2

    def consumer(h, b, r0, lo, hi, n, runs, tiles, wait_tile, release, seg_own, seg_ref,
                 staging, vector, out_refs, extra_refs):
        k_tile, v_tile = tiles
        dk_ref, dv_ref = out_refs
        lse_ref, delta_ref = extra_refs

        def pass_over(step, carry):
            release(wait_tile(step)[0])
            return carry

        def head(g, carry):
            def visit(i, step, carry, masked):
                dk, dv = carry
                slot, (q_tile, do_tile) = wait_tile(step)
                rows = pl.ds(i * bq, bq)
                lse = plgpu.load(lse_ref.at[b, h * G + g, rows], layout=COLUMN, optimized=False)
                dlt = plgpu.load(delta_ref.at[b, h * G + g, rows], layout=COLUMN,
                                 optimized=False)
                # st, pt, dst: scores, probabilities and the scores' gradient, transposed.
                st = _product(k_tile, q_tile.T, (bk, bq)) * plan.scale_log2
                if masked:
                    st = _masked(st, _mask(shape, r0, i * bq, b, seg_own, seg_ref,
                                           keys_own=True))
                pt = jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))
                dv = dv + _product(_operand(pt, staging, shape.dtype), do_tile, (bk, E))
                dpt = _product(v_tile, do_tile.T, (bk, bq))
                dst = pt * (dpt - lax.broadcast_in_dim(dlt, st.shape, [1]))
                dk = dk + _product(_operand(dst, staging, shape.dtype), q_tile, (bk, E))
                release(slot)
                return dk, dv

            return _loops(lo, hi, runs, visit, pass_over, carry, free_first=False,
                          step0=g * n)

        zeros = plgpu.layout_cast(jnp.zeros((bk, E), jnp.float32), plgpu.Layout.WGMMA)
        dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
        k_tile[...] = (dk * plan.scale).astype(shape.dtype)
        v_tile[...] = dv.astype(shape.dtype)
        _store(k_tile, dk_ref.at[b, pl.ds(r0, bk), h])
        _store(v_tile, dv_ref.at[b, pl.ds(r0, bk), h])

    out = jax.ShapeDtypeStruct((B, T_pad, K, E), k.dtype)
    kernel = _run(shape, K, T_pad // (CONSUMERS * bk), B, (out, out), own_index,
                  streamed_index, consumer, n_own=2, n_streamed=2, n_extra=2)
    return kernel(sched, k, v, q, d_out, lse, delta, *_segments(plan, segment_ids))


def _store(tile, dst):
    """A shared-memory tile to global memory, waited for."""
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, dst)
    plgpu.wait_smem_to_gmem(0)


def _segments(plan, segment_ids):
    return (segment_ids,) if plan.segments else ()
