"""One attention function, several implementations of the same mathematics.

Layout: q is [B, T, H, E]; k and v are [B, S, K, E] with K dividing H (grouped-query attention;
K == 1 is multi-query). A query attends to a key only if both carry the same segment id and,
when ``causal``, the key is not later. Padding (segment 0) attends only to padding: no row is
ever fully masked, so no NaNs appear.

``pallas`` is the flash kernel of ``jaxaccel.model.kernels`` (interpreted off the GPU, slowly).
``auto`` (``resolve_implementation``) picks xla off NVIDIA GPUs; on them pallas for packed rows
(it skips the tiles two segments never share, where cuDNN gets a dense [B, 1, T, S] mask: jax
0.11.2's public API takes only per-row ``query_seq_lengths`` / ``key_value_seq_lengths``) and
for rows of up to ``AUTO_PALLAS_MAX_T`` tokens, cuDNN above. The models pass no segment ids when
each row holds one document from column 0 (``model.make_apply``): the causal mask is then exact.
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from jaxaccel.core.errors import ConfigError
from jaxaccel.model.kernels import check_shapes, flash_attention
# declared without jax
from jaxaccel.core.sections import ATTENTION_IMPLEMENTATIONS as IMPLEMENTATIONS
from jaxaccel.core.sharding import per_shard


def attention_mask(T: int, S: int, *, causal: bool, segment_ids_q=None, segment_ids_kv=None):
    """Boolean [B or 1, 1, T, S] mask: True where query t may attend to key s (key segment ids
    default to the queries')."""
    mask_TS = jnp.ones((T, S), dtype=bool)
    if causal:
        mask_TS = jnp.tril(mask_TS, k=S - T)
    mask_BHTS = mask_TS[None, None]
    if segment_ids_q is not None:
        kv = segment_ids_q if segment_ids_kv is None else segment_ids_kv
        same_BTS = segment_ids_q[:, :, None] == kv[:, None, :]
        mask_BHTS = mask_BHTS & same_BTS[:, None]
    return mask_BHTS


def xla_attention(q_BTHE, k_BSKE, v_BSKE, *, segment_ids=None, causal=True, sm_scale=None):
    """Reference implementation in plain jnp: scores and softmax in float32, output in q's dtype."""
    (B, T, H, E), (S, K) = q_BTHE.shape, k_BSKE.shape[1:3]
    scale = E ** -0.5 if sm_scale is None else sm_scale
    q_BTKGE = q_BTHE.reshape(B, T, K, H // K, E)
    scores_BKGTS = jnp.einsum(
        "btkge,bske->bkgts", q_BTKGE, k_BSKE, preferred_element_type=jnp.float32) * scale
    mask_BHTS = attention_mask(T, S, causal=causal, segment_ids_q=segment_ids)
    scores_BKGTS = jnp.where(mask_BHTS[:, :, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    out_BTKGE = jnp.einsum("bkgts,bske->btkge", probs_BKGTS.astype(v_BSKE.dtype), v_BSKE,
                           preferred_element_type=jnp.float32)
    return out_BTKGE.reshape(B, T, H, E).astype(q_BTHE.dtype)


def cudnn_attention(q_BTHE, k_BSKE, v_BSKE, *, segment_ids=None, causal=True, sm_scale=None):
    """cuDNN flash attention through ``jax.nn.dot_product_attention`` (NVIDIA GPUs only): float32
    runs in bfloat16 (cuDNN takes 16-bit floats only), segments as a dense mask."""
    if jax.default_backend() != "gpu":
        raise ConfigError(
            f"attention implementation 'cudnn' needs an NVIDIA GPU, but the backend is "
            f"'{jax.default_backend()}'; use the xla implementation", field="gpt.attention")
    out_dtype = q_BTHE.dtype
    if out_dtype == jnp.float32:
        q_BTHE, k_BSKE, v_BSKE = (x.astype(jnp.bfloat16) for x in (q_BTHE, k_BSKE, v_BSKE))
    mask_BHTS = None if segment_ids is None else attention_mask(
        q_BTHE.shape[1], k_BSKE.shape[1], causal=False, segment_ids_q=segment_ids)
    out_BTHE = jax.nn.dot_product_attention(
        q_BTHE, k_BSKE, v_BSKE, mask=mask_BHTS, scale=sm_scale, is_causal=causal,
        implementation="cudnn")
    return out_BTHE.astype(out_dtype)


def pallas_attention(q_BTHE, k_BSKE, v_BSKE, *, segment_ids=None, causal=True, sm_scale=None):
    """Flash attention in Pallas (``jaxaccel.model.kernels``) for equally long queries and keys;
    under a mesh each device runs it on its own rows and heads
    (``jaxaccel.core.sharding.per_shard``)."""
    def kernel(q_BTHE, k_BSKE, v_BSKE, segment_ids):
        return flash_attention(q_BTHE, k_BSKE, v_BSKE, causal=causal, segment_ids=segment_ids,
                               sm_scale=sm_scale)

    q_axes = ("batch", "seq", "heads", "head_dim")
    kv_axes = ("batch", "seq", "kv_heads", "head_dim")
    segment_axes = None if segment_ids is None else ("batch", "seq")
    return per_shard(kernel, (q_axes, kv_axes, kv_axes, segment_axes), q_axes)(
        q_BTHE, k_BSKE, v_BSKE, segment_ids)


# ``auto``'s switch to cuDNN for rows without segment ids. Forward + backward on one H100 80GB
# (jax 0.11.2, bf16, 16 heads, B*T = 16,384, causal; issue 19, 2026-11-22): ours ran at 1.13x
# (D=64) and 1.23x (D=128) cuDNN's TFLOP/s at T = 1024, 0.90x and 0.61x at T = 4096, 0.70x and
# 0.60x at T = 16,384. T = 2048 was not measured.
AUTO_PALLAS_MAX_T = 1024


def resolve_implementation(implementation: str, seq_len: int | None = None,
                           segments: bool = False, head_dim: int = 64) -> str:
    """The implementation ``auto`` means for this call (module docstring); other names
    unchanged. cuDNN needs a head dim that is a multiple of 8, at most 128 before Hopper (jax
    0.11.2's ``check_is_flash_attention``); other head dims keep our kernel."""
    if implementation != "auto":
        return implementation
    capability = (float(getattr(jax.devices()[0], "compute_capability", 0) or 0)
                  if jax.default_backend() == "gpu" else 0.0)
    if capability < 8.0 or head_dim > 256:
        return "xla"    # cuDNN and our kernel need sm80 or newer, and neither takes such heads
    if segments or seq_len is None or seq_len <= AUTO_PALLAS_MAX_T or head_dim % 8 or (
            head_dim > 128 and capability < 9.0):
        return "pallas"
    return "cudnn"


def dot_product_attention(q, k, v, *, segment_ids=None, causal=True, implementation="xla",
                          sm_scale=None):
    """Attention over [B, T, H, E] queries and [B, S, K, E] keys/values, K dividing H.

    Args:
      segment_ids: int32 [B, T] or None; tokens attend only within their own segment.
      causal: a token attends only to itself and earlier tokens.
      implementation: one of ``IMPLEMENTATIONS``.
      sm_scale: softmax scale, default 1/sqrt(E).
    Returns:
      [B, T, H, E] in q's dtype.
    """
    check_shapes(q, k, v)
    implementation = resolve_implementation("xla" if _COUNTING.get() else implementation,
                                            q.shape[1], segment_ids is not None, q.shape[-1])
    run = {"xla": xla_attention, "cudnn": cudnn_attention, "pallas": pallas_attention}
    if implementation in run:
        return run[implementation](q, k, v, segment_ids=segment_ids, causal=causal,
                                   sm_scale=sm_scale)
    raise ConfigError(f"unknown attention implementation {implementation!r}; choose one of "
                      f"{', '.join(IMPLEMENTATIONS)}", field="gpt.attention")


_COUNTING = contextvars.ContextVar("jaxaccel_attention_counting", default=False)


@contextlib.contextmanager
def as_xla():
    """Inside, every implementation traces as ``xla``: the full T x S einsums whose FLOPs
    ``jaxaccel.step.trace.matmul_flops`` counts for MFU, and exports' reference logits (any
    device)."""
    token = _COUNTING.set(True)
    try:
        yield
    finally:
        _COUNTING.reset(token)
