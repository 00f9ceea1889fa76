"""The Pallas flash attention kernel, run in the Pallas interpreter, against float64 NumPy.

Small blocks (16, 32) give several tiles at short lengths. The interpreter fills every output
buffer with NaN before the kernel runs (checked below), so a comparison with the reference also
proves that the kernel wrote every element it returns.
"""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental import pallas as pl

from jaxaccel.techniques import registry as techniques
from jaxaccel.model.attention import dot_product_attention, resolve_implementation
from jaxaccel.run.config import build, parse
from jaxaccel.core.errors import ConfigError
from jaxaccel.model.kernels import flash, flash_attention, tile_schedule, tuning
from jaxaccel.model.contract import make_apply
from jaxaccel.step.state import init_state
from jaxaccel.step.train import lm_train_step
from tests.reference import reference_attention


def segments(rng, B, T, layout):
    """int32 [B, T]: 'packed' documents 1, 2, ... (one of one token wherever there is room)
    then padding 0, or an 'arbitrary' unsorted layout of ids 0-3, or None."""
    if layout is None:
        return None
    if layout == "arbitrary":
        return rng.integers(0, 4, (B, T)).astype(np.int32)
    ids = np.zeros((B, T), np.int32)
    for b in range(B):
        real = int(rng.integers(max(1, T // 2), T + 1))
        cuts = set(rng.choice(np.arange(1, real), size=min(real - 1, 3), replace=False)) \
            if real > 1 else set()
        if real > 2:
            one = int(rng.integers(1, real - 1))
            cuts |= {one, one + 1}                     # token `one` is a document of its own
        cuts = np.array(sorted(cuts), int)
        ids[b, :real] = 1 + np.searchsorted(cuts, np.arange(real), side="right")
    return ids


def inputs(rng, B, T, H, K, E, dtype):
    """Fresh standard-normal q, k, v and output cotangent, rounded to ``dtype``."""
    arrays = [rng.standard_normal((B, T, n, E)) for n in (H, K, K, H)]
    return [jnp.asarray(x, dtype) for x in arrays]


def rel_err(x, ref):
    """Largest error over the largest reference value, at least 1 (the inputs' scale): a gradient
    that is exactly zero (dq and dk where each token sees only itself) is compared absolutely."""
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref)) / max(np.max(np.abs(ref)), 1.0))


def forward_backward(segment_ids, causal, **options):
    """``(q, k, v, d_out) -> (out, (dq, dk, dv))``, jitted: inputs of one shape compile once."""
    def fn(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(
            q, k, v, causal=causal, segment_ids=segment_ids, **options), q, k, v)
        return out, vjp(d_out)
    return jax.jit(fn)


def run(q, k, v, d_out, segment_ids, causal, **options):
    return forward_backward(segment_ids, causal, **options)(q, k, v, d_out)


# (B, T, H, K, E, causal, segment layout, block_q, block_k): T = 1, odd, not a multiple of any
# block; GQA ratios 1, 2, 3, 4; head dims 32, 64, 128 and an odd 48.
CASES = [
    (2, 1, 2, 2, 32, True, "packed", 16, 16),
    (2, 37, 4, 2, 32, True, "packed", 16, 16),
    (3, 50, 4, 1, 64, False, "packed", 16, 32),
    (1, 64, 2, 2, 128, True, None, 32, 16),
    (1, 33, 4, 4, 128, False, "packed", 32, 32),
    (2, 29, 4, 2, 64, True, "arbitrary", 16, 16),
    (1, 70, 4, 1, 32, False, "arbitrary", 16, 32),
    (2, 17, 2, 1, 128, True, "packed", 16, 16),
    (1, 23, 6, 2, 48, True, "packed", 16, 16),
]


@pytest.mark.parametrize("B,T,H,K,E,causal,layout,block_q,block_k", CASES)
def test_float32_forward_and_gradients_match_float64(B, T, H, K, E, causal, layout, block_q,
                                                     block_k):
    rng = np.random.default_rng([B, T, H, K, E, causal])
    q, k, v, d_out = inputs(rng, B, T, H, K, E, jnp.float32)
    seg = segments(rng, B, T, layout)
    out, grads = run(q, k, v, d_out, seg, causal, block_q=block_q, block_k=block_k)
    ref_out, ref_grads = reference_attention(q, k, v, seg, causal, d_out)
    assert out.shape == q.shape and out.dtype == jnp.float32
    assert rel_err(out, ref_out) < 1e-5
    for name, g, ref_g, x in zip("qkv", grads, ref_grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert rel_err(g, ref_g) < 1e-5, f"d{name}"


@pytest.mark.parametrize("dtype,T,K,E,causal,layout", [
    (jnp.bfloat16, 41, 2, 64, True, "packed"),
    (jnp.bfloat16, 32, 1, 128, False, None),
    (jnp.float16, 27, 2, 32, True, "arbitrary"),
])
def test_half_precision_inputs_stay_close_to_float64(dtype, T, K, E, causal, layout):
    rng = np.random.default_rng([T, K, E])
    q, k, v, d_out = inputs(rng, 2, T, 4, K, E, dtype)
    seg = segments(rng, 2, T, layout)
    out, grads = run(q, k, v, d_out, seg, causal, block_q=16, block_k=16)
    # The reference computes from the inputs rounded to dtype.
    ref_out, ref_grads = reference_attention(q, k, v, seg, causal, d_out)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert rel_err(out, ref_out) < 1e-2
    for g, ref_g in zip(grads, ref_grads):
        assert rel_err(g, ref_g) < 2e-2


@pytest.mark.parametrize("dtype,T,E,causal,layout", [
    (jnp.bfloat16, 130, 64, True, "packed"),      # 2 programs a pass; segments skip tiles
    (jnp.float16, 50, 128, False, "arbitrary"),   # one consumer's rows all past the end
])
def test_mosaic_gpu_passes_match_float64(dtype, T, E, causal, layout):
    """The three Mosaic GPU passes in its interpreter (three warpgroups, TMA copies into a
    ring, barriers, wgmma), two query heads sharing a key/value head. Run op by op: under an
    outer jit the interpreter's warpgroup threads, blocked at barriers inside callbacks, can
    starve XLA's CPU threads on a 2-core machine and hang."""
    rng = np.random.default_rng([T, E, 9])
    q, k, v, d_out = inputs(rng, 1, T, 2, 1, E, dtype)
    seg = segments(rng, 1, T, layout)
    stage = tuning.Stage(64, 64, None, 2, backend="mosaic_gpu")
    params = tuning.FlashParams(forward=stage, dkv=stage, dq=stage)
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(
        q, k, v, causal=causal, segment_ids=seg, params=params), q, k, v)
    grads = vjp(d_out)
    ref_out, ref_grads = reference_attention(q, k, v, seg, causal, d_out)
    assert out.dtype == dtype and rel_err(out, ref_out) < 1e-2
    for g, ref_g in zip(grads, ref_grads):
        assert g.dtype == dtype and rel_err(g, ref_g) < 2e-2
    # float32 inputs, which the Mosaic kernels do not take, run the Triton passes.
    q32, k32, v32 = (x[:, :20].astype(jnp.float32) for x in (q, k, v))
    got = flash_attention(q32, k32, v32, causal=causal, params=params)
    assert rel_err(got, reference_attention(q32, k32, v32, None, causal)) < 1e-5


def test_mosaic_gpu_passes_lower_for_an_h100_without_a_gpu():
    """The Mosaic GPU lowering of all three passes with swizzled tiles, for an abstract H100;
    compiling it to machine code and running it need the GPU. An older GPU gets Triton."""
    q = jax.ShapeDtypeStruct((2, 1000, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32)
    queries = tuning.Stage(64, 128, None, 2, backend="mosaic_gpu")
    params = tuning.FlashParams(forward=queries, dq=queries,
                                dkv=tuning.Stage(128, 64, None, 2, backend="mosaic_gpu"))

    def fwd_bwd(q, k, v, seg, d_out):
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(
            q, k, v, causal=True, segment_ids=seg, params=params, interpret=False), q, k, v)
        return out, vjp(d_out)

    for kind, mosaic in (("NVIDIA H100 80GB HBM3", 3), ("NVIDIA A100-SXM4-80GB", 0)):
        device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
            warnings.simplefilter("ignore", DeprecationWarning)
            text = jax.jit(fwd_bwd).trace(q, kv, kv, seg, q).lower(
                lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu_v2") == mosaic
        assert text.count("__gpu$xla.gpu.triton") == 3 - mosaic
    with pytest.raises(ConfigError, match="a mosaic_gpu dkv stage takes block_k 64 or 128"):
        flash_attention(jnp.zeros((1, 8, 1, 64)), jnp.zeros((1, 8, 1, 64)),
                        jnp.zeros((1, 8, 1, 64)), params=params.replace(
                            dkv=tuning.Stage(64, 32, backend="mosaic_gpu")))


def test_default_blocks_and_explicit_scale():
    rng = np.random.default_rng(7)
    q, k, v, d_out = inputs(rng, 1, 75, 2, 2, 32, jnp.float32)
    out, grads = run(q, k, v, d_out, None, True, sm_scale=32 ** -0.5)
    ref_out, ref_grads = reference_attention(q, k, v, None, True, d_out)
    assert rel_err(out, ref_out) < 1e-5
    assert all(rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))
    doubled = flash_attention(q, k, v, causal=True, sm_scale=2 * 32 ** -0.5)
    ref_doubled = reference_attention(np.sqrt(2) * np.asarray(q), np.sqrt(2) * np.asarray(k), v,
                                      None, True)
    assert rel_err(doubled, ref_doubled) < 1e-5


def test_the_interpreter_poisons_outputs_and_the_kernel_writes_them_all():
    def half_writer(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    x = jnp.ones((32, 16), jnp.float32)
    spec = pl.BlockSpec((16, 16), lambda i: (i, 0))
    control = pl.pallas_call(half_writer, grid=(2,), in_specs=[spec], out_specs=spec,
                             out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
    assert np.all(np.asarray(control[:16]) == 1) and np.all(np.isnan(np.asarray(control[16:])))

    # The kernel writes every element it returns: the float32 cases above compare each one with
    # the reference, this layout at T = 37 among them (a NaN the interpreter left would fail
    # them). Here: the forward's log-sum-exp is written at the padded length too.
    rng = np.random.default_rng(8)
    q, k, v, _ = inputs(rng, 2, 21, 4, 2, 32, jnp.float32)
    seg = segments(rng, 2, 21, "packed")
    plan_args = dict(causal=True, segment_ids=seg, block_q=16, block_k=16)
    lse = _padded_lse(q, k, v, **plan_args)
    assert lse.shape == (2, 4, 32) and not np.isnan(np.asarray(lse)).any()


def _padded_lse(q, k, v, **options):
    """The forward's log-sum-exp at the padded length (every program's rows)."""
    captured = {}
    original = flash._forward

    def spy(*args):
        out, lse = original(*args)
        captured["lse"] = lse
        return out, lse

    flash._forward = spy
    try:
        jax.vjp(lambda q: flash_attention(q, k, v, **options), q)
    finally:
        flash._forward = original
    return captured["lse"]


def test_tile_schedule_skips_above_the_diagonal_and_across_segments():
    causal = tile_schedule(64, 16, 16, causal=True)
    assert causal.shape == (1, 4, 4) and int(causal.sum()) == 10      # 4 * 5 / 2
    assert int(tile_schedule(64, 16, 32, causal=True).sum()) == 6
    two_docs = np.repeat(np.array([[1, 2]], np.int32), 32, axis=1)    # tiles 0-1 | tiles 2-3
    assert int(tile_schedule(64, 16, 16, causal=False, segment_ids=two_docs).sum()) == 8
    assert int(tile_schedule(64, 16, 16, causal=True, segment_ids=two_docs).sum()) == 6
    # Ranges overlap for arbitrary layouts: nothing is skipped that might be needed.
    mixed = np.tile(np.array([[1, 2]], np.int32), (1, 32))
    assert bool(tile_schedule(64, 16, 16, causal=False, segment_ids=mixed).all())


def _nan_rows(x, rows):
    x = np.array(x)
    x[:, rows] = np.nan
    return jnp.asarray(x)


def test_skipped_tiles_are_never_read():
    """NaN in tiles the schedule skips must not reach the rows that skip them: a visited tile,
    even wholly masked, would spread it (0 * NaN in the value product)."""
    rng = np.random.default_rng(9)
    T, opts = 64, dict(block_q=16, block_k=16)
    q, k, v, d_out = inputs(rng, 1, T, 2, 1, 32, jnp.float32)
    # Causal: keys 48.. are read only by the last query tile; queries 0..15 only by key tile 0.
    causal = forward_backward(None, True, **opts)
    out, (dq, _, _) = causal(q, _nan_rows(k, slice(48, T)), _nan_rows(v, slice(48, T)), d_out)
    ref_out, (ref_dq, _, _) = reference_attention(q, k, v, None, True, d_out)
    assert rel_err(out[:, :48], ref_out[:, :48]) < 1e-5
    assert rel_err(dq[:, :48], ref_dq[:, :48]) < 1e-5
    _, (_, dk, dv) = causal(_nan_rows(q, slice(0, 16)), k, v, _nan_rows(d_out, slice(0, 16)))
    _, (_, ref_dk, ref_dv) = reference_attention(q, k, v, None, True, d_out)
    assert rel_err(dk[:, 16:], ref_dk[:, 16:]) < 1e-5
    assert rel_err(dv[:, 16:], ref_dv[:, 16:]) < 1e-5
    # Segments: document 1 fills tiles 0-1, document 2 tiles 2-3 (not causal).
    seg = np.repeat(np.array([[1, 2]], np.int32), 32, axis=1)
    first = slice(0, 32)
    two_documents = forward_backward(seg, False, **opts)
    out, (dq, _, _) = two_documents(q, _nan_rows(k, first), _nan_rows(v, first), d_out)
    ref_out, (ref_dq, _, _) = reference_attention(q, k, v, seg, False, d_out)
    assert rel_err(out[:, 32:], ref_out[:, 32:]) < 1e-5
    assert rel_err(dq[:, 32:], ref_dq[:, 32:]) < 1e-5
    _, (_, dk, dv) = two_documents(_nan_rows(q, first), k, v, _nan_rows(d_out, first))
    _, (_, ref_dk, ref_dv) = reference_attention(q, k, v, seg, False, d_out)
    assert rel_err(dk[:, 32:], ref_dk[:, 32:]) < 1e-5
    assert rel_err(dv[:, 32:], ref_dv[:, 32:]) < 1e-5


def test_gradients_are_deterministic():
    """Four query tiles and two query heads on each key/value head add into every dK and dV.
    The shapes and options of the causal program above: the compilation cache serves it."""
    rng = np.random.default_rng(10)
    q, k, v, d_out = inputs(rng, 1, 64, 2, 1, 32, jnp.float32)
    fn = forward_backward(None, True, block_q=16, block_k=16)     # one program, run twice
    first = fn(q, k, v, d_out)[1]
    second = fn(q, k, v, d_out)[1]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_bad_inputs_raise_one_line_config_errors():
    q = jnp.ones((1, 8, 4, 32))
    kv = jnp.ones((1, 8, 2, 32))
    bad = [
        (dict(q=q[0]), "expects \\[batch, seq, heads, head_dim\\]"),
        (dict(k=jnp.ones((1, 6, 2, 32)), v=jnp.ones((1, 6, 2, 32))), "sequence length"),
        (dict(k=jnp.ones((1, 8, 3, 32)), v=jnp.ones((1, 8, 3, 32))), "do not divide"),
        (dict(q=jnp.ones((1, 8, 4, 320)), k=jnp.ones((1, 8, 2, 320)),
              v=jnp.ones((1, 8, 2, 320))), "head_dim up to 256"),
        (dict(v=kv.astype(jnp.bfloat16)), "of one dtype"),
        (dict(q=q.astype(jnp.int32), k=kv.astype(jnp.int32), v=kv.astype(jnp.int32)),
         "of one dtype"),
        (dict(segment_ids=jnp.ones((1, 7), jnp.int32)), "segment_ids must be"),
        (dict(block_q=24), "power of two"),
        (dict(block_k=8), "power of two"),
    ]
    for overrides, match in bad:
        args = {"q": q, "k": kv, "v": kv, **overrides}
        with pytest.raises(ConfigError, match=match) as info:
            flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        assert "\n" not in str(info.value) and ";" in str(info.value)


def test_kernels_lower_to_triton_for_an_h100_without_a_gpu():
    """The Triton lowering (Pallas jaxpr -> Triton IR) of all three passes, for a GPU target;
    compiling that IR to machine code needs the GPU and is not checked here."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    for E, causal, with_segments, dtype in [(128, True, True, jnp.bfloat16),
                                            (64, False, False, jnp.float32)]:
        q = jax.ShapeDtypeStruct((2, 1000, 8, E), dtype)
        kv = jax.ShapeDtypeStruct((2, 1000, 2, E), dtype)
        seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32) if with_segments else None

        def fwd_bwd(q, k, v, seg, d_out):
            out, vjp = jax.vjp(lambda q, k, v: flash_attention(
                q, k, v, causal=causal, segment_ids=seg, interpret=False), q, k, v)
            return out, vjp(d_out)

        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
            warnings.simplefilter("ignore", DeprecationWarning)   # Triton backend deprecation
            text = jax.jit(fwd_bwd).trace(q, kv, kv, seg, q).lower(
                lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 3


def test_dot_product_attention_pallas_and_auto():
    """Through the one attention entry point, against the float64 reference every
    implementation is tested with."""
    rng = np.random.default_rng(11)
    q, k, v, _ = inputs(rng, 2, 19, 4, 2, 32, jnp.float32)
    seg = segments(rng, 2, 19, "packed")
    pallas = dot_product_attention(q, k, v, segment_ids=seg, implementation="pallas")
    assert rel_err(pallas, reference_attention(q, k, v, seg, True)) < 1e-5
    assert resolve_implementation("auto") == ("pallas" if jax.default_backend() == "gpu"
                                              else "xla")
    assert parse(["--attention", "pallas"]).gpt.attention == "pallas"


def test_model_trains_the_same_with_pallas_as_with_xla():
    tokens = np.random.default_rng(12).integers(3, 64, (2, 25)).astype(np.int32)
    seg = np.array([[1] * 10 + [2] * 9 + [3] * 5, [1] * 3 + [2] * 17 + [0] * 4], np.int32)
    positions = np.zeros_like(seg)
    for t in range(1, 24):
        positions[:, t] = np.where(seg[:, t] == seg[:, t - 1], positions[:, t - 1] + 1, 0)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
             "positions": positions, "weights": (seg > 0).astype(np.float32)}
    losses = {}
    for impl in ("xla", "pallas"):
        cfg = build(values={"gpt.d_model": 64, "gpt.n_layers": 1, "gpt.n_heads": 2,
                            "gpt.n_kv_heads": 1, "model.max_seq_len": 24, "gpt.attention": impl})
        optimizer = optax.adam(1e-2)
        graphdef, params = nnx.split(techniques.build(cfg, jax.random.PRNGKey(0)))
        state = init_state(params, optimizer, seed=0, trainable=nnx.Param)
        step = jax.jit(lm_train_step(make_apply(graphdef), optimizer, trainable=nnx.Param))
        losses[impl] = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses[impl].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=1e-5)
    assert losses["xla"][2] < losses["xla"][0]


def test_tuned_table_per_device_with_fallbacks_and_one_line_errors(tmp_path, monkeypatch):
    from jaxaccel.model.kernels import tuning

    path = tmp_path / "tuned.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    h100, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
    assert tuning.flash_params(64, 4096, interpret=False, kind=h100) == tuning.TRITON[64]
    stage = tuning.Stage(64, 64, 4, 2)
    mine = tuning.FlashParams(forward=stage, dkv=stage, dq=stage)
    tuning.write_entry(path, h100, {64: mine}, {"date": "2026-11-25"})
    assert tuning.flash_params(48, 4096, interpret=False, kind=h100) == mine
    assert tuning.flash_params(128, 4096, interpret=False, kind=h100) == tuning.TRITON[128]
    assert tuning.flash_params(64, 4096, interpret=False, kind=a100) == tuning.TRITON[64]
    assert tuning.flash_params(64, 20, interpret=False, kind=h100).forward.block_q == 32
    assert tuning.flash_params(64, 4096, interpret=True, kind="cpu") == tuning.INTERPRET
    # A second device joins the table; the first keeps its rows.
    tuning.write_entry(path, a100, {128: mine}, {"date": "2026-11-25"})
    assert tuning.tuned_rows(h100) == {64: mine} and tuning.tuned_rows(a100) == {128: mine}
    good = json.loads(path.read_text())
    bad_block = json.loads(path.read_text())
    bad_block["devices"][h100]["head_dims"]["64"]["dq"]["block_q"] = 24
    bad_backend = json.loads(path.read_text())
    bad_backend["devices"][h100]["head_dims"]["64"]["dkv"]["backend"] = "cuda"
    for text, match in [("{", "cannot be read"),
                        (json.dumps({**good, "format": 2}), "not a flash tuning table"),
                        (json.dumps(bad_block), "dq block 24 is not a power of two"),
                        (json.dumps(bad_backend), "dkv backend 'cuda' is not one of")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=match) as info:
            tuning.flash_params(64, 4096, interpret=False, kind=h100)
        assert "\n" not in str(info.value) and "--tune" in str(info.value)
    # A block override a Mosaic GPU stage cannot take (own rows other than 64 or 128) puts
    # that pass on Triton.
    m = tuning.Stage(64, 64, None, 2, backend="mosaic_gpu")
    got = tuning.flash_params(64, 4096, interpret=False, block_q=32,
                              params=tuning.FlashParams(forward=m, dkv=m, dq=m))
    assert [s.backend for s in got.stages()] == ["triton", "mosaic_gpu", "triton"]
    q = jnp.zeros((1, 32, 2, 16), jnp.float32)
    odd = tuning.FlashParams(forward=tuning.Stage(24, 32), dkv=stage, dq=stage)
    with pytest.raises(ConfigError, match="forward block 24"):
        flash_attention(q, q, q, params=odd)
