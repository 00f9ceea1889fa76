"""Flash attention in Pallas: forward and backward, causal, grouped-query, packed segments.

``attention.xla_attention`` without the [T, T] scores: a program per query tile walks the key
tiles with a base-2 online softmax (scale folded with log2(e)) in float32. The backward
recomputes probabilities from the saved log-sum-exp: a program per key tile sums dK and dV over
its group's query heads and query tiles (no atomics: deterministic), one per query tile sums dQ.

``tile_schedule`` skips wholly masked tiles (causal, disjoint segment-id ranges); each program
loops over one contiguous run, so skipping is exact for non-decreasing segment ids (packed
batches), conservative otherwise; tiles needing no mask run a mask-free loop. Any length: the
sequence is padded to whole tiles, the head dim to a power of two. Parameters: ``tuning``.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxaccel.core.errors import ConfigError
from jaxaccel.model.kernels import tuning

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
_START_MAX = -1e30    # running-max start: finite, so a row that sees no key keeps p = 0, not NaN
_EMPTY_LSE = 1e30     # log-sum-exp of such a row: exp2(score - it) is 0 in the backward


def _mosaic():
    """``flash_mosaic``, imported when a Hopper stage first needs it: jax's Mosaic GPU modules
    take about 0.7 s to import, a cost every process paid before."""
    from jaxaccel.model.kernels import flash_mosaic
    return flash_mosaic


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one call: shapes, padding, options, backend parameters."""

    seq_len: int
    seq_pad: int
    head_dim_pad: int
    groups: int
    causal: bool
    segments: bool
    scale: float
    params: tuning.FlashParams
    interpret: bool

    @property
    def scale_log2(self) -> float:
        return self.scale * math.log2(math.e)


def flash_attention(q, k, v, *, causal=False, segment_ids=None, sm_scale=None, block_q=None,
                    block_k=None, params=None, interpret=None):
    """Attention of [B, T, H, E] queries over [B, T, K, E] keys/values (K divides H), in Pallas.

    Args:
      causal: a token attends only to itself and earlier tokens.
      segment_ids: int32 [B, T] or None; a token attends only within its own segment.
      sm_scale: softmax scale, default 1/sqrt(E).
      block_q, block_k: tile rows (powers of two >= 16) for every pass; default: ``tuning``'s.
      params: a whole ``tuning.FlashParams`` instead of the table's (``--tune`` sweeps these).
      interpret: run in the Pallas interpreter; None: on every backend but the GPU.
    Returns:
      [B, T, H, E] in q's dtype. Differentiable in q, k and v.
    """
    _check_inputs(q, k, v, segment_ids, block_q, block_k)
    if params is not None:
        tuning.check_params(params)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    _, T, H, E = q.shape
    params = tuning.flash_params(E, T, interpret=interpret, block_q=block_q, block_k=block_k,
                                 params=params)
    tile = max(max(s.block_q, s.block_k) for s in params.stages())
    head_dim_pad = max(tuning.MIN_BLOCK, pl.next_power_of_2(E))
    for name, stage in zip(tuning.PASSES, params.stages()):
        if stage.backend == "mosaic_gpu":
            tile = max(tile, _mosaic().program_rows(name, stage))
            head_dim_pad = max(head_dim_pad, min(_mosaic().HEAD_DIMS))   # 128-byte rows
    plan = _Plan(
        seq_len=T, seq_pad=-(-T // tile) * tile, head_dim_pad=head_dim_pad,
        groups=H // k.shape[2], causal=causal, segments=segment_ids is not None,
        scale=E ** -0.5 if sm_scale is None else float(sm_scale), params=params,
        interpret=bool(interpret))
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
    return _flash(q, k, v, segment_ids, plan)


def check_shapes(q, k, v, *, name="attention", same_length=False):
    """ConfigError unless q is [B, T, H, E] and k, v are [B, S, K, E] with K dividing H (and
    S == T when ``same_length``); ``name`` is the function the message names."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ConfigError(f"{name} expects [batch, seq, heads, head_dim] arrays, got q{q.shape} "
                          f"k{k.shape} v{v.shape}; reshape to that layout")
    if (k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]
            or (same_length and q.shape[1] != k.shape[1])):
        agree = "batch, sequence length and head_dim" if same_length else "batch and head_dim"
        raise ConfigError(f"{name} shapes disagree: q{q.shape} k{k.shape} v{v.shape}; k and v "
                          f"must match each other and q in {agree}")
    if q.shape[2] % k.shape[2]:
        raise ConfigError(f"{k.shape[2]} key/value heads do not divide {q.shape[2]} query heads; "
                          "choose n_kv_heads dividing n_heads", field="gpt.n_kv_heads")


def _check_inputs(q, k, v, segment_ids, block_q, block_k):
    """ConfigError, one line, for inputs the kernel does not take."""
    check_shapes(q, k, v, name="flash_attention", same_length=True)
    if not 1 <= q.shape[3] <= MAX_HEAD_DIM:
        raise ConfigError(
            f"flash_attention takes head_dim up to {MAX_HEAD_DIM}, got {q.shape[3]}; use "
            "implementation='xla' or more, narrower heads", field="gpt.attention")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in DTYPES]:
        raise ConfigError(f"flash_attention takes q, k and v of one dtype among float32, bfloat16 "
                          f"and float16, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one")
    if segment_ids is not None and (
            segment_ids.shape != q.shape[:2] or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ConfigError(
            f"segment_ids must be integers of shape [batch, seq] = {q.shape[:2]}, got "
            f"{segment_ids.dtype}{tuple(segment_ids.shape)}; pass the Batch's int32 segment_ids")
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if block is not None and (block < tuning.MIN_BLOCK or block & (block - 1)):
            raise ConfigError(f"{name}={block} is not a power of two >= {tuning.MIN_BLOCK}; pass "
                              "one such as 32, 64 or 128 (or None for the tuned default)")


# ---- which tiles to visit ----------------------------------------------------------------------

def _tile_min_max(segment_ids_BT, T: int, block: int):
    """Smallest and largest segment id of each tile of ``block`` real positions: [B, tiles] each."""
    n = -(-T // block)
    ids_BT = jnp.pad(segment_ids_BT, ((0, 0), (0, n * block - T)), mode="edge")
    ids_by_tile = ids_BT.reshape(ids_BT.shape[0], n, block)
    return ids_by_tile.min(-1), ids_by_tile.max(-1)


def tile_schedule(T: int, block_q: int, block_k: int, *, causal: bool, segment_ids=None):
    """Boolean [B or 1, I, J] over query tiles I = ceil(T/block_q) and key tiles J =
    ceil(T/block_k): False only where no pair of the two tiles may attend (the key tile starts
    after the query tile's last query when causal, or their segment-id ranges are disjoint)."""
    q_last_I = jnp.minimum((jnp.arange(-(-T // block_q)) + 1) * block_q, T) - 1
    k_first_J = jnp.arange(-(-T // block_k)) * block_k
    meets_BIJ = jnp.ones((1, q_last_I.size, k_first_J.size), bool)
    if causal:
        meets_BIJ &= k_first_J[None, None, :] <= q_last_I[None, :, None]
    if segment_ids is not None:
        q_min_BI, q_max_BI = _tile_min_max(segment_ids, T, block_q)
        k_min_BJ, k_max_BJ = _tile_min_max(segment_ids, T, block_k)
        meets_BIJ = meets_BIJ & ((q_min_BI[:, :, None] <= k_max_BJ[:, None, :])
                                 & (k_min_BJ[:, None, :] <= q_max_BI[:, :, None]))
    return meets_BIJ


def _mask_free(plan: _Plan, block_q: int, block_k: int, *, tail: bool):
    """Boolean [1, I, J]: query tile i with key tile j needs no mask (``tail``: padded keys do)."""
    n_q, n_k = -(-plan.seq_len // block_q), -(-plan.seq_len // block_k)
    q_first = jnp.arange(n_q)[:, None] * block_q
    k_end = (jnp.arange(n_k)[None, :] + 1) * block_k
    free_IJ = jnp.full((n_q, n_k), not plan.segments)
    if plan.causal:
        free_IJ &= k_end - 1 <= q_first
    if tail:
        free_IJ &= k_end <= plan.seq_len
    return free_IJ[None]


def _runs(segment_ids, plan: _Plan, stage: tuning.Stage, batch: int, *, keys: bool):
    """Per query tile (forward, dQ) or, with ``keys``, key tile (dK/dV): int32 [B, tiles] first,
    split, end of the run of tiles it visits (none for padding tiles), mask-free ones in
    [first, split) for queries, in [split, end) for keys (padded keys need no mask there)."""
    bq, bk = stage.block_q, stage.block_k
    meets = tile_schedule(plan.seq_len, bq, bk, causal=plan.causal, segment_ids=segment_ids)
    free = _mask_free(plan, bq, bk, tail=not keys)
    if keys:
        meets, free = jnp.swapaxes(meets, 1, 2), jnp.swapaxes(free, 1, 2)
    meets = jnp.broadcast_to(meets, (batch,) + meets.shape[1:])
    any_ = meets.any(-1)
    first = jnp.where(any_, jnp.argmax(meets, -1), 0)
    end = jnp.where(any_, meets.shape[-1] - jnp.argmax(meets[..., ::-1], -1), 0)
    n_free = (meets & free).sum(-1)
    split = end - n_free if keys else first + n_free
    pad = ((0, 0), (0, plan.seq_pad // (bk if keys else bq) - meets.shape[1]))
    return tuple(jnp.pad(x.astype(jnp.int32), pad) for x in (first, split, end))


# ---- the kernels -------------------------------------------------------------------------------

def _dot(a, b, *, trans_b=False):
    """a @ b (or a @ b.T) accumulated in float32; exact float32 products for float32 inputs."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _masked(s, q_pos, k_pos, seg_q, seg_k, plan: _Plan, *, tail: bool):
    """Scores, -inf where a query may not attend to a key (``tail``: nor to keys past the end)."""
    conditions = []
    if plan.causal:
        conditions.append(q_pos >= k_pos)
    if tail and plan.seq_pad > plan.seq_len:
        conditions.append(k_pos < plan.seq_len)
    if plan.segments:
        conditions.append(seg_q == seg_k)
    if not conditions:
        return s
    return jnp.where(functools.reduce(jnp.logical_and, conditions), s, -jnp.inf)


def _key_tile_scores(q, q_pos, seg_q, k_ref, v_ref, seg_k_ref, j, bk, plan: _Plan, masked):
    """A query tile's base-2 scores against key tile ``j`` (masked if ``masked``), keys, values."""
    keys = pl.ds(j * bk, bk)
    k, v = k_ref[keys, :], v_ref[keys, :]
    s = _dot(q, k, trans_b=True) * plan.scale_log2
    if masked:
        seg_k = seg_k_ref[keys] if plan.segments else None
        s = _masked(s, q_pos[:, None], (j * bk + jnp.arange(bk))[None, :],
                    None if seg_q is None else seg_q[:, None],
                    None if seg_k is None else seg_k[None, :], plan, tail=True)
    return s, k, v


def _forward_kernel(first_ref, split_ref, end_ref, q_ref, k_ref, v_ref, *refs, plan, stage):
    """One query tile of one head: online softmax over its run of key tiles."""
    seg_q_ref, seg_k_ref, o_ref, lse_ref = refs if plan.segments else (None, None, *refs)
    bq, bk = stage.block_q, stage.block_k
    q = q_ref[...]
    q_pos = pl.program_id(2) * bq + jnp.arange(bq)
    seg_q = seg_q_ref[...] if plan.segments else None

    def visit(j, carry, masked):
        max_prev, sum_prev, acc_prev = carry
        s, _, v = _key_tile_scores(q, q_pos, seg_q, k_ref, v_ref, seg_k_ref, j, bk, plan, masked)
        max_new = jnp.maximum(max_prev, s.max(axis=1))
        rescale = jnp.exp2(max_prev - max_new)
        p = jnp.exp2(s - max_new[:, None])
        acc_new = rescale[:, None] * acc_prev + _dot(p.astype(v.dtype), v)
        return max_new, rescale * sum_prev + p.sum(axis=1), acc_new

    carry = (jnp.full((bq,), _START_MAX, jnp.float32), jnp.zeros((bq,), jnp.float32),
             jnp.zeros((bq, plan.head_dim_pad), jnp.float32))
    first, split, end = first_ref[...], split_ref[...], end_ref[...]
    carry = lax.fori_loop(first, split, functools.partial(visit, masked=False), carry)
    row_max, row_sum, acc = lax.fori_loop(split, end, functools.partial(visit, masked=True), carry)
    seen = row_sum > 0
    safe_sum = jnp.where(seen, row_sum, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / safe_sum[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, row_max + jnp.log2(safe_sum), _EMPTY_LSE)


def _dq_kernel(first_ref, split_ref, end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               *refs, plan, stage):
    """dQ of one query tile of one head, summed over its run of key tiles."""
    seg_q_ref, seg_k_ref, dq_ref = refs if plan.segments else (None, None, *refs)
    bq, bk = stage.block_q, stage.block_k
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos = pl.program_id(2) * bq + jnp.arange(bq)
    seg_q = seg_q_ref[...] if plan.segments else None

    def visit(j, dq, masked):
        s, k, v = _key_tile_scores(q, q_pos, seg_q, k_ref, v_ref, seg_k_ref, j, bk, plan, masked)
        p = jnp.exp2(s - lse[:, None])
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = jnp.zeros((bq, plan.head_dim_pad), jnp.float32)
    first, split, end = first_ref[...], split_ref[...], end_ref[...]
    dq = lax.fori_loop(first, split, functools.partial(visit, masked=False), dq)
    dq = lax.fori_loop(split, end, functools.partial(visit, masked=True), dq)
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _dkv_kernel(first_ref, split_ref, end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                *refs, plan, stage):
    """dK, dV of one key tile of a key/value head, summed over its group's heads and query run."""
    seg_q_ref, seg_k_ref, dk_ref, dv_ref = refs if plan.segments else (None, None, *refs)
    bq, bk = stage.block_q, stage.block_k
    k, v = k_ref[...], v_ref[...]
    k_pos = pl.program_id(2) * bk + jnp.arange(bk)
    seg_k = seg_k_ref[...] if plan.segments else None
    first, split, end = first_ref[...], split_ref[...], end_ref[...]

    def head(g, carry):
        def visit(i, carry, masked):
            dk, dv = carry
            rows = pl.ds(i * bq, bq)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, delta = lse_ref[g, rows], delta_ref[g, rows]
            # st, pt, dst: scores, probabilities, scores' gradient, transposed (rows are keys).
            st = _dot(k, q, trans_b=True) * plan.scale_log2
            if masked:
                seg_q = seg_q_ref[rows] if plan.segments else None
                st = _masked(st, (i * bq + jnp.arange(bq))[None, :], k_pos[:, None],
                              None if seg_q is None else seg_q[None, :],
                              None if seg_k is None else seg_k[:, None], plan, tail=False)
            pt = jnp.exp2(st - lse[None, :])
            dv = dv + _dot(pt.astype(do.dtype), do)
            dst = pt * (_dot(v, do, trans_b=True) - delta[None, :])
            return dk + _dot(dst.astype(q.dtype), q), dv

        carry = lax.fori_loop(first, split, functools.partial(visit, masked=True), carry)
        return lax.fori_loop(split, end, functools.partial(visit, masked=False), carry)

    zeros = jnp.zeros((bk, plan.head_dim_pad), jnp.float32)
    dk, dv = lax.fori_loop(0, plan.groups, head, (zeros, zeros))
    dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ---- pallas_call wiring ------------------------------------------------------------------------

def _pad(x_BTHE, plan: _Plan):
    """Zeros after the sequence and after the head dim: whole tiles, power-of-two features."""
    return jnp.pad(x_BTHE, ((0, 0), (0, plan.seq_pad - x_BTHE.shape[1]), (0, 0),
                            (0, plan.head_dim_pad - x_BTHE.shape[3])))


def _pad_seq(x, plan: _Plan):
    """Zeros after the sequence, the last axis of ``x`` ([B, T] or [B, H, T]); None stays None."""
    if x is None:
        return None
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, plan.seq_pad - x.shape[-1])])


def _call(kernel, plan, stage, grid, in_specs, out_specs, out_shape, name):
    return pl.pallas_call(
        functools.partial(kernel, plan=plan, stage=stage), grid=grid, in_specs=in_specs,
        out_specs=out_specs, out_shape=out_shape, interpret=plan.interpret,
        compiler_params=tuning.compiler_params(stage, interpret=plan.interpret), name=name)


def _segment_args(segment_ids, plan, block, *, tile_of_queries: bool):
    """Segment-id operands and specs (queries', keys'): own tile on one side, row on the other."""
    if not plan.segments:
        return [], []
    seg_BT = _pad_seq(segment_ids, plan)
    tile_spec = pl.BlockSpec((None, block), lambda b, h, i: (b, i))
    row_spec = pl.BlockSpec((None, plan.seq_pad), lambda b, h, i: (b, 0))
    return [seg_BT, seg_BT], [tile_spec, row_spec] if tile_of_queries else [row_spec, tile_spec]


def _forward(q, k, v, segment_ids, plan: _Plan):
    """Output [B, T, H, E] and the base-2 log-sum-exp [B, H, T_pad] (float32)."""
    B, T, H, E = q.shape
    stage = _on_triton_unless_mosaic(plan.params.forward, plan, q.dtype)
    runs = _runs(segment_ids, plan, stage, B, keys=False)
    qp, kp, vp = (_pad(x, plan) for x in (q, k, v))
    if stage.backend == "mosaic_gpu":
        out, lse = _mosaic().forward(
            qp, kp, vp, _pad_seq(segment_ids, plan), _mosaic().schedule(*runs), plan, stage,
            empty_lse=_EMPTY_LSE, start_max=_START_MAX)
        return out[:, :T, :, :E], lse
    bq, G, Ep = stage.block_q, plan.groups, plan.head_dim_pad
    q_spec = pl.BlockSpec((None, bq, None, Ep), lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, plan.seq_pad, None, Ep), lambda b, h, i: (b, 0, h // G, 0))
    run_spec = pl.BlockSpec((None, None), lambda b, h, i: (b, i))
    seg_args, seg_specs = _segment_args(segment_ids, plan, bq, tile_of_queries=True)
    out, lse = _call(
        _forward_kernel, plan, stage, (B, H, plan.seq_pad // bq),
        [run_spec] * 3 + [q_spec, kv_spec, kv_spec] + seg_specs,
        [q_spec, pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))],
        [jax.ShapeDtypeStruct((B, plan.seq_pad, H, Ep), q.dtype),
         jax.ShapeDtypeStruct((B, H, plan.seq_pad), jnp.float32)], "flash_attention_forward",
    )(*runs, qp, kp, vp, *seg_args)
    return out[:, :T, :, :E], lse


def _backward(q, k, v, segment_ids, out, lse, d_out, plan: _Plan):
    """dq, dk, dv from the saved output and log-sum-exp, each pass on its stage's backend."""
    B, T, H, E = q.shape
    delta_BHT = _pad_seq(jnp.einsum("bthe,bthe->bht", out.astype(jnp.float32),
                                    d_out.astype(jnp.float32)), plan)
    qp, kp, vp, dop = (_pad(x, plan) for x in (q, k, v, d_out))
    dq = _dq(qp, kp, vp, dop, lse, delta_BHT, segment_ids, plan)
    dk, dv = _dkv(qp, kp, vp, dop, lse, delta_BHT, segment_ids, plan)
    return dq[:, :T, :, :E], dk[:, :T, :, :E], dv[:, :T, :, :E]


def _on_triton_unless_mosaic(stage: tuning.Stage, plan: _Plan, dtype) -> tuning.Stage:
    """The stage, moved to Triton where the Mosaic GPU kernels cannot run it."""
    if stage.backend != "mosaic_gpu" or (
            _mosaic().supports(dtype, plan.head_dim_pad)
            and (plan.interpret or tuning.is_hopper(tuning.device_kind()))):
        return stage
    return dataclasses.replace(stage, backend="triton", num_warps=None)


def _dq(qp, kp, vp, dop, lse, delta_BHT, segment_ids, plan: _Plan):
    B, _, H, Ep = qp.shape
    stage = _on_triton_unless_mosaic(plan.params.dq, plan, qp.dtype)
    runs = _runs(segment_ids, plan, stage, B, keys=False)
    if stage.backend == "mosaic_gpu":
        return _mosaic().dq(qp, kp, vp, dop, lse, delta_BHT, _pad_seq(segment_ids, plan),
                            _mosaic().schedule(*runs), plan, stage)
    G, bq = plan.groups, stage.block_q
    q_spec = pl.BlockSpec((None, bq, None, Ep), lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, plan.seq_pad, None, Ep), lambda b, h, i: (b, 0, h // G, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    run_spec = pl.BlockSpec((None, None), lambda b, h, i: (b, i))
    seg_args, seg_specs = _segment_args(segment_ids, plan, bq, tile_of_queries=True)
    return _call(
        _dq_kernel, plan, stage, (B, H, plan.seq_pad // bq),
        [run_spec] * 3 + [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec] + seg_specs,
        q_spec, jax.ShapeDtypeStruct(qp.shape, qp.dtype), "flash_attention_dq",
    )(*runs, qp, kp, vp, dop, lse, delta_BHT, *seg_args)


def _dkv(qp, kp, vp, dop, lse, delta_BHT, segment_ids, plan: _Plan):
    B, _, K, Ep = kp.shape
    stage = _on_triton_unless_mosaic(plan.params.dkv, plan, kp.dtype)
    runs = _runs(segment_ids, plan, stage, B, keys=True)
    if stage.backend == "mosaic_gpu":
        return _mosaic().dkv(qp, kp, vp, dop, lse, delta_BHT, _pad_seq(segment_ids, plan),
                             _mosaic().schedule(*runs), plan, stage)
    G, bk = plan.groups, stage.block_k
    run_spec = pl.BlockSpec((None, None), lambda b, h, i: (b, i))
    group_spec = pl.BlockSpec((None, plan.seq_pad, G, Ep), lambda b, h, j: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, bk, None, Ep), lambda b, h, j: (b, j, h, 0))
    row_spec = pl.BlockSpec((None, G, plan.seq_pad), lambda b, h, j: (b, h, 0))
    seg_args, seg_specs = _segment_args(segment_ids, plan, bk, tile_of_queries=False)
    return _call(
        _dkv_kernel, plan, stage, (B, K, plan.seq_pad // bk),
        [run_spec] * 3 + [group_spec, kv_spec, kv_spec, group_spec, row_spec, row_spec] + seg_specs,
        [kv_spec, kv_spec], [jax.ShapeDtypeStruct(kp.shape, kp.dtype)] * 2, "flash_attention_dkv",
    )(*runs, qp, kp, vp, dop, lse, delta_BHT, *seg_args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segment_ids, plan):
    return _forward(q, k, v, segment_ids, plan)[0]


def _flash_fwd(q, k, v, segment_ids, plan):
    out, lse = _forward(q, k, v, segment_ids, plan)
    return out, (q, k, v, segment_ids, out, lse)


def _flash_bwd(plan, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    return (*_backward(q, k, v, segment_ids, out, lse, d_out, plan), None)


_flash.defvjp(_flash_fwd, _flash_bwd)
