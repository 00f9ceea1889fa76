"""The float64 NumPy attention every attention implementation is tested against."""

import numpy as np


def reference_attention(q, k, v, segment_ids=None, causal=True, d_out=None):
    """Softmax attention by the book, in float64, for [B, T, H, E] queries and [B, S, K, E]
    keys/values, S == T (K divides H; query head h reads key/value head h // G).

    Returns the [B, T, H, E] output; with a cotangent ``d_out`` of that shape, the output and
    its gradients (dq, dk, dv).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, E = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    k_BSHE, v_BSHE = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    scale = E ** -0.5
    allowed_BHTS = np.ones((B, 1, T, S), bool)
    if causal:
        allowed_BHTS &= np.tril(np.ones((T, S), bool))
    if segment_ids is not None:
        allowed_BHTS &= (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    s_BHTS = np.where(allowed_BHTS, np.einsum("bthe,bshe->bhts", q, k_BSHE) * scale, -np.inf)
    p_BHTS = np.exp(s_BHTS - s_BHTS.max(-1, keepdims=True))
    p_BHTS /= p_BHTS.sum(-1, keepdims=True)
    out_BTHE = np.einsum("bhts,bshe->bthe", p_BHTS, v_BSHE)
    if d_out is None:
        return out_BTHE
    d_out_BTHE = np.asarray(d_out, np.float64)
    dp_BHTS = np.einsum("bthe,bshe->bhts", d_out_BTHE, v_BSHE)
    ds_BHTS = p_BHTS * (dp_BHTS - (dp_BHTS * p_BHTS).sum(-1, keepdims=True))
    dq_BTHE = np.einsum("bhts,bshe->bthe", ds_BHTS, k_BSHE) * scale
    dk_BSHE = np.einsum("bhts,bthe->bshe", ds_BHTS, q) * scale
    dv_BSHE = np.einsum("bhts,bthe->bshe", p_BHTS, d_out_BTHE)
    # Each key/value head sums the gradients of its G query heads.
    dk_BSKE, dv_BSKE = (x.reshape(B, S, K, G, E).sum(3) for x in (dk_BSHE, dv_BSHE))
    return out_BTHE, (dq_BTHE, dk_BSKE, dv_BSKE)
