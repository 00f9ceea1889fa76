"""Rematerialization by name: which activations a transformer block keeps for the backward pass.

Activations, not weights, fill the memory of transformer training. ``jax.checkpoint`` trades
memory for recomputation: a checkpointed block keeps only what its policy saves and recomputes
the rest during the backward pass. The model tags its intermediate tensors with
``checkpoint_name`` (the names below), so each policy is one line:

- ``none``: no remat, every activation is kept;
- ``full``: only the block's input is kept, the whole block is recomputed;
- ``dots``: matmul outputs without batch dimensions are kept (the projections, not the
  attention scores), XLA's ``dots_with_no_batch_dims_saveable``;
- ``attention``: the q/k/v projections and the attention output are kept, the MLP is recomputed;
- ``mlp``: the MLP's inner matmul outputs are kept, attention is recomputed;
- ``offload``: what ``attention`` keeps, but moved to pinned host memory and fetched back for the
  backward pass (``save_and_offload_only_these_names``). The CPU backend of jax 0.11 accepts
  the policy and computes the same numbers; there, host and device memory are the same RAM, so
  it saves nothing and its figures equal ``attention``'s up to the copies.
"""

import jax

from jaxaccel.errors import ConfigError

# Names the model gives its intermediate tensors (see jaxaccel.model).
QUERY = "query"               # q after the rotary embedding, [B, T, H, E]
KEY = "key"                   # k after the rotary embedding, [B, T, K, E]
VALUE = "value"               # v, [B, T, K, E]
ATTENTION_OUT = "attention_out"   # attention's output before the output projection, [B, T, H, E]
MLP_IN = "mlp_in"             # x W_in, [B, T, F]
MLP_GATE = "mlp_gate"         # x W_gate (SwiGLU only), [B, T, F]

ATTENTION_NAMES = (QUERY, KEY, VALUE, ATTENTION_OUT)
MLP_NAMES = (MLP_IN, MLP_GATE)

_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention": jax.checkpoint_policies.save_only_these_names(*ATTENTION_NAMES),
    "mlp": jax.checkpoint_policies.save_only_these_names(*MLP_NAMES),
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=ATTENTION_NAMES,
        offload_src="device", offload_dst="pinned_host"),
}
REMAT_POLICIES = tuple(_POLICIES)


def check_policy(name: str) -> str:
    """``name`` if it is a policy, else a ConfigError listing the valid ones."""
    if name not in _POLICIES:
        raise ConfigError(f"unknown remat policy {name!r}; choose one of "
                          f"{', '.join(REMAT_POLICIES)}", field="model.remat")
    return name


def remat(fn, name: str, *, prevent_cse: bool = True):
    """``fn`` checkpointed under the named policy (``fn`` itself for ``none``).

    ``fn`` must be a pure function of arrays. Inside ``lax.scan`` pass ``prevent_cse=False``:
    the loop already keeps XLA from merging the recomputation with the forward pass, and the
    barrier would only cost speed.
    """
    if check_policy(name) == "none":
        return fn
    return jax.checkpoint(fn, policy=_POLICIES[name], prevent_cse=prevent_cse)
