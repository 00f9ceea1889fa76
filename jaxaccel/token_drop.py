"""Token dropping (Hou et al. 2022, "Token Dropping for Efficient BERT Pretraining"; the survey's
"removing masked tokens"), for a causal language model.

During training the middle layers (``model.token_drop_layers``, default the middle half: layers
``L//4 .. L - L//4``, e.g. 3:9 of 12, at least the first and the last layer left out; a model
of fewer than 3 layers has none, and ``TrainConfig.validate_techniques`` then asks for the layers
by name; the shallow stages of progressive stacking run whole) process only ``K`` of each row's ``T`` tokens; the layers before and after
them process all. The kept tokens are gathered once before the first middle
layer into ``[B, K, D]``, with their positions' rotary angles and their segment ids, run through
the middle layers, and scattered back after the last; a dropped token's hidden state skips the
middle layers unchanged (Hou et al.'s "carried past"). Inside the middle layers the kept tokens
attend causally to the earlier kept tokens of their own document: the positions are sorted
ascending, so their order is the sequence's, and RoPE takes their original positions. The loss
is on every token. Evaluation (no key) runs every layer on every token. Only the gathered rows
move, each within its own batch row, so under a mesh (rows split over ``data`` x ``fsdp``)
nothing leaves its device.

Static shapes: ``K = kept_tokens(T, token_keep)`` is ``round(keep * T)`` rounded to a multiple
of ``MULTIPLE`` (8: whole sublanes and MMA tiles on GPUs), at least 8 and at most T (sequences
shorter than 8 tokens keep ``round(keep * T)``, at least 1). It depends only on the batch's
shape, so nothing recompiles; ``K = T`` drops nothing and runs the plain model.

Which tokens (``model.token_drop_score``): padding (segment id 0) is dropped first, always.
Among the real tokens, ``K`` are drawn without replacement each step, from the step's key folded
with ``SELECT_KEY`` (each microbatch and step draws its own):

- ``random``: uniformly;
- ``loss``: with weights Hou et al.'s cumulative loss, the running loss of each vocabulary id
  as a target, a buffer ``token_loss`` (float32 [vocab_size], ``params["token_drop"]
  ["token_loss"]``, see ``jaxaccel.buffers``): a position is kept with a weight of its target
  id's running loss (Gumbel top-k), so the hard predictions get the full depth more often. The
  loss function puts the batch's per-id loss sums and counts into ``aux["buffer_stats"]``
  (``loss_stats``, summed over microbatches) and the step updates the buffer after the
  optimizer's update (``update_buffer``): an exponential moving average with decay ``DECAY``
  (0.9) per step, for the ids the batch held as targets. It starts at ``log(vocab_size)`` (a
  uniform prediction's loss) for every id, so ids not seen yet count as hard.

  Hou et al. keep the highest-loss tokens outright. Here that made the easy tokens skip the
  middle layers at every step, and evaluation, where every token runs every layer, met states
  training never produced: validation loss 40 % above the plain model's at keep 0.5 (8x128
  model, 150 steps on the CPU), against +3 % drawn by weight and -0.4 % drawn uniformly. Drawn by
  weight, every token still runs the middle layers on some steps.

What it saves: the middle layers' matmuls run on K/T of the tokens and their attention scores
on (K/T)^2 of the score matrix; ``model.flops_per_token`` counts that (``flops_share``), so the
run summary's FLOPs and MFU are the work done.

With stochastic depth the middle layers' rows are skipped as elsewhere, on the gathered tokens
(both run together). Pipeline strategies refuse it (``TrainConfig.validate_techniques``).
"""

import math

import jax
import jax.numpy as jnp
import optax

from jaxaccel.errors import ConfigError
from jaxaccel.sharding import constrain, take_rows

SCORES = ("random", "loss")
MULTIPLE = 8          # K, the kept tokens per row, is a multiple of this
DECAY = 0.9           # the running loss per id: new = DECAY * old + (1 - DECAY) * batch mean
SELECT_KEY = 0x70D    # folded into the step's model key for the choice of tokens
MIN_LOSS = 1e-6       # the smallest weight a running loss gives its tokens (log of it is finite)
PARENT, BUFFER = "token_drop", "token_loss"   # params[PARENT][BUFFER]: the running loss per id
STATS = "buffer_stats"                         # train.BUFFER_STATS, the aux entry it is read from
ACTIVATION_AXES = ("batch", "seq", "embed")
TOKEN_AXES = ("batch", "seq")


def validate(cfg):
    """ConfigError, one line, for a bad ``token_keep``, ``token_drop_layers`` or
    ``token_drop_score`` of the ModelConfig ``cfg``."""
    keep = cfg.token_keep
    if not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
        raise ConfigError(f"token_keep must be in (0, 1] (the share of tokens the middle layers "
                          f"keep; 1 = off), got {keep}", field="model.token_keep")
    if cfg.token_drop_score not in SCORES:
        raise ConfigError(f"unknown token_drop_score {cfg.token_drop_score!r}; choose one of "
                          f"{', '.join(SCORES)}", field="model.token_drop_score")
    layer_range(cfg)


def layer_range(cfg) -> tuple[int, int]:
    """``(start, end)``: layers start .. end - 1 see only the kept tokens. ``token_drop_layers``
    parsed and checked, or the middle half, ``max(1, L // 4) .. L - max(1, L // 4)``: empty for
    fewer than 3 layers (the first and last see every token), so that progressive stacking's
    shallow stages run whole."""
    L, text = cfg.n_layers, cfg.token_drop_layers
    if text is None:
        start = max(1, L // 4)
        return start, max(start, L - start)
    first, sep, last = str(text).partition(":")
    try:
        start, end = int(first), int(last)
    except ValueError:
        start = end = None
    if not sep or start is None or not 0 <= start < end <= L:
        raise ConfigError(f"token_drop_layers must be START:END with 0 <= START < END <= "
                          f"n_layers={L} (e.g. {max(1, L // 4)}:{L - max(1, L // 4)}), got "
                          f"{text!r}", field="model.token_drop_layers")
    return start, end


def kept_tokens(seq_len: int, keep: float) -> int:
    """K, the tokens per row the middle layers compute at ``keep`` for rows of ``seq_len``."""
    if keep >= 1.0:
        return seq_len
    if seq_len < MULTIPLE:
        return max(1, round(keep * seq_len))
    return min(seq_len, max(MULTIPLE, round(keep * seq_len / MULTIPLE) * MULTIPLE))


def has_buffer(cfg) -> bool:
    """Whether a model of ``cfg`` holds the running loss per id (the ``loss`` score)."""
    return cfg.token_keep < 1.0 and cfg.token_drop_score == "loss"


def initial_loss(vocab_size: int):
    """The buffer's first value: every id at a uniform prediction's loss, log(vocab_size)."""
    return jnp.full((vocab_size,), math.log(vocab_size), jnp.float32)


def dropped_span(cfg, first_layer: int, layers: int, seq_len: int):
    """The local layers ``(lo, hi)`` of a stack holding layers ``first_layer ..
    first_layer + layers - 1`` that run on the kept tokens, or None when none does (off, K = T,
    or none of those layers in the range)."""
    if cfg.token_keep >= 1.0 or kept_tokens(seq_len, cfg.token_keep) >= seq_len:
        return None
    start, end = layer_range(cfg)
    lo, hi = max(start - first_layer, 0), min(end - first_layer, layers)
    return (lo, hi) if lo < hi else None


def select(key, segment_ids_BT, kept: int, targets_BT=None, token_loss_V=None):
    """The kept positions [B, kept], ascending in each row: ``kept`` real tokens drawn without
    replacement (padding only when a row has fewer), uniformly, or with ``token_loss_V`` with
    weights the running loss of each token's target id (Gumbel top-k: the largest of
    ``log weight + Gumbel noise`` from ``key``)."""
    score_BT = jax.random.gumbel(key, segment_ids_BT.shape, jnp.float32)
    if token_loss_V is not None:
        loss_BT = take_rows(jax.lax.stop_gradient(token_loss_V).astype(jnp.float32),
                            targets_BT, TOKEN_AXES)
        score_BT = score_BT + jnp.log(jnp.maximum(loss_BT, MIN_LOSS))
    score_BT = jnp.where(segment_ids_BT > 0, score_BT, -jnp.inf)
    iota_BT = jax.lax.broadcasted_iota(jnp.int32, segment_ids_BT.shape, 1)
    score_BT, iota_BT = (constrain(a, TOKEN_AXES) for a in (score_BT, iota_BT))
    # The positions in ascending order of score (both operands split by rows).
    order_BT = jax.lax.sort((score_BT, iota_BT), dimension=1, num_keys=1)[-1]
    return jnp.sort(order_BT[:, -kept:], axis=-1).astype(jnp.int32)


def gather(a_BT, index_BK):
    """``a_BT[b, index_BK[b, k]]`` for an array [B, T, ...]: the kept tokens' values. Mapped
    over the rows, so the row is a batch dimension of the gather: partitioned with the rows."""
    return jax.vmap(lambda a_T, index_K: a_T[index_K])(a_BT, index_BK)


def scatter(x_BTD, index_BK, y_BKD):
    """``x_BTD`` with the kept tokens' rows replaced by ``y_BKD``; the others unchanged (a
    scatter mapped over the rows, as ``gather``)."""
    x_BTD = jax.vmap(lambda x_TD, index_K, y_KD: x_TD.at[index_K].set(y_KD))(
        x_BTD, index_BK, y_BKD.astype(x_BTD.dtype))
    return constrain(x_BTD, ACTIVATION_AXES)


def run_dropped(run, x_BTD, row_args, key, cfg, targets_BT=None, token_loss_V=None):
    """``run(x_BKD, row_args_K)`` (the middle layers) on the kept tokens of ``x_BTD``, the
    dropped ones passed through. ``row_args`` are per-token arrays [B, T, ...] (rotary sines and
    cosines, segment ids: the last one)."""
    segment_ids_BT = row_args[-1]
    kept = kept_tokens(x_BTD.shape[1], cfg.token_keep)
    if token_loss_V is not None and targets_BT is None:
        raise ValueError("token_drop_score=loss scores tokens by their targets; pass the "
                         "batch's targets to the model")
    index_BK = select(jax.random.fold_in(key, SELECT_KEY), segment_ids_BT, kept, targets_BT,
                      token_loss_V)
    x_BKD = constrain(gather(x_BTD, index_BK), ACTIVATION_AXES)
    y_BKD = run(x_BKD, tuple(gather(a, index_BK) for a in row_args))
    return scatter(x_BTD, index_BK, y_BKD)


def flops_share(cfg, seq_len: int) -> float:
    """K / T: the share of the tokens the middle layers compute (their attention scores' share
    is its square); 1 without token dropping."""
    return kept_tokens(seq_len, cfg.token_keep) / seq_len


def dropped_layers(cfg) -> int:
    """How many layers run on the kept tokens (0 without token dropping)."""
    if cfg.token_keep >= 1.0:
        return 0
    start, end = layer_range(cfg)
    return end - start


def loss_stats(params, logits_BTV, batch):
    """The additive statistics the running loss per id is updated from, for ``aux
    ["buffer_stats"]``: ``{"token_loss_sum", "token_count"}``, float32 [vocab_size], the batch's
    per-target-id sums of the token losses and counts of the real tokens. None when ``params``
    hold no ``token_loss`` buffer."""
    if not hasattr(params, "keys") or PARENT not in params:
        return None
    vocab = params[PARENT][BUFFER].shape[0]
    token_loss_BT = optax.softmax_cross_entropy_with_integer_labels(
        jax.lax.stop_gradient(logits_BTV).astype(jnp.float32), batch["targets"])
    real_BT = (batch["weights"] > 0).astype(jnp.float32)
    return {"token_loss_sum": _per_id_sum(token_loss_BT * real_BT, batch["targets"], vocab),
            "token_count": _per_id_sum(real_BT, batch["targets"], vocab)}


def _per_id_sum(values_BT, ids_BT, vocab: int):
    """float32 [vocab]: the sum of ``values_BT`` by id, whole on every device (under Explicit
    mesh axes the scatter is told so: it cannot infer it from batch-split ids)."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types
    out = {"out_sharding": jax.sharding.PartitionSpec()} if explicit else {}
    return jnp.zeros((vocab,), jnp.float32).at[ids_BT].add(values_BT, **out)


def update_buffer(params, stats, cfg):
    """``params`` with the running loss per id moved towards the step's mean loss of each id it
    saw as a target (``stats["buffer_stats"]``, from ``loss_stats``); ids not seen, and a step
    whose losses are not finite, leave it unchanged."""
    seen = stats[STATS]
    old_V = params[PARENT][BUFFER]
    count_V = seen["token_count"]
    mean_V = seen["token_loss_sum"] / jnp.maximum(count_V, 1.0)
    update_V = (count_V > 0) & jnp.isfinite(mean_V)
    new_V = jnp.where(update_V, DECAY * old_V + (1.0 - DECAY) * mean_V, old_V)
    return {**params, PARENT: {**params[PARENT], BUFFER: new_V.astype(old_V.dtype)}}
