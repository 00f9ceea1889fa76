"""Token dropping (Hou et al. 2022, "Token Dropping for Efficient BERT Pretraining"; the survey's
"removing masked tokens"), for a causal language model.

It acts on any model whose blocks are an ``nn.Stack`` (``apply`` installs ``TokenDrop``, a block
transform that runs a span of the stack's layers). During training the middle layers
(``--token-drop-layers``, default the middle half: layers ``L//4 .. L - L//4``, e.g. 3:9 of 12,
at least the first and the last layer left out; a model of fewer than 3 layers has none and must
name them; the shallow stages of progressive stacking run whole) process only ``K`` of each
row's ``T`` tokens; the layers before and after them process all. The kept tokens are gathered
once before the first middle layer into ``[B, K, D]``, with every per-token argument the model
passes its stack (jaxaccel's GPT: rotary angles; and the batch's segment ids), run through the
middle layers, and scattered back after the last; a dropped token's hidden state skips the
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

Which tokens (``--token-drop-score``): padding (segment id 0) is dropped first, always.
Among the real tokens, ``K`` are drawn without replacement each step, from the step's key folded
with ``SELECT_KEY`` (each microbatch and step draws its own):

- ``random``: uniformly;
- ``loss``: with weights Hou et al.'s cumulative loss, the running loss of each vocabulary id
  as a target, a buffer ``TokenLoss`` (float32 [vocab_size], an ``nn.Buffer`` of the
  transform): a position is kept with a weight of its target
  id's running loss (Gumbel top-k), so the hard predictions get the full depth more often. The
  loss function asks the transform for the batch's per-id loss sums and counts
  (``TokenDrop.loss_stats``, summed over microbatches) and the step updates the buffer after the
  optimizer's update (``TokenDrop.update``): an exponential moving average with decay ``DECAY``
  (0.9) per step, for the ids the batch held as targets. It starts at ``log(vocab_size)`` (a
  uniform prediction's loss) for every id, so ids not seen yet count as hard.

  Hou et al. keep the highest-loss tokens outright. Here that made the easy tokens skip the
  middle layers at every step, and evaluation, where every token runs every layer, met states
  training never produced: validation loss 40 % above the plain model's at keep 0.5 (8x128
  model, 150 steps on the CPU), against +3 % drawn by weight and -0.4 % drawn uniformly. Drawn by
  weight, every token still runs the middle layers on some steps.

What it saves: the middle layers' matmuls run on K/T of the tokens and their attention scores
on (K/T)^2 of the score matrix; the run's FLOP count (``jaxaccel.trace.training_flops``, which counts
the matmuls the step computes) sees that, so the run summary's FLOPs and MFU are the work done.

With stochastic depth the middle layers' rows are skipped as elsewhere, on the gathered tokens
(both run together). Pipeline strategies refuse it (``check``).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from jaxaccel import nn
from jaxaccel.errors import ConfigError
from jaxaccel.settings import setting
from jaxaccel.sharding import constrain, refuse_pipeline, take_rows

SCORES = ("random", "loss")
MULTIPLE = 8          # K, the kept tokens per row, is a multiple of this
DECAY = 0.9           # the running loss per id: new = DECAY * old + (1 - DECAY) * batch mean
SELECT_KEY = 0x70D    # folded into the step's model key for the choice of tokens
MIN_LOSS = 1e-6       # the smallest weight a running loss gives its tokens (log of it is finite)
ACTIVATION_AXES = ("batch", "seq", "embed")
TOKEN_AXES = ("batch", "seq")


@dataclasses.dataclass
class TokenDropSettings:
    keep: float = setting(1.0, "token dropping: share of each row's tokens the token_drop_layers "
                               "compute in training, K = keep x seq_len rounded to a multiple of "
                               "8; the others skip those layers unchanged, evaluation runs every "
                               "token (1 = off)", flag="token_keep", above=0, at_most=1)
    layers: str | None = setting(None, "token dropping: layers START:END (0-based, END excluded) "
                                       "that see only the kept tokens (default: the middle half, "
                                       "e.g. 3:9 of 12; a model of fewer than 3 layers must name "
                                       "them)", flag="token_drop_layers")
    score: str = setting("random", "token dropping: how the middle layers' tokens are drawn each "
                                   "step: random (uniformly), or loss (weighted by the running "
                                   "loss of the token's target id); padding is dropped first",
                         flag="token_drop_score", choices=SCORES)


def layer_range(text: str | None, n_layers: int | None) -> tuple[int, int]:
    """``(start, end)``: layers start .. end - 1 see only the kept tokens. ``text`` (START:END)
    parsed and checked (against ``n_layers`` when given), or the middle half, ``max(1, L // 4)
    .. L - max(1, L // 4)``: empty for fewer than 3 layers (the first and last see every
    token)."""
    L = n_layers if n_layers is not None else float("inf")
    if text is None:
        start = max(1, L // 4)
        return start, max(start, L - start)
    first, sep, last = str(text).partition(":")
    try:
        start, end = int(first), int(last)
    except ValueError:
        start = end = None
    if not sep or start is None or not 0 <= start < end <= L:
        bound = "" if n_layers is None else (
            f" <= n_layers={L} (e.g. {max(1, L // 4)}:{L - max(1, L // 4)})")
        raise ConfigError(f"token_drop_layers must be START:END with 0 <= START < END{bound}, "
                          f"got {text!r}", field="token_drop.layers")
    return start, end


class TokenLoss(nn.Buffer):
    """The running loss per vocabulary id as a target (the ``loss`` score)."""


class TokenDrop(nn.BlockTransform, nn.Updated):
    """The middle layers of the stack on each row's kept tokens, in training."""

    order = 20

    def __init__(self, settings: TokenDropSettings, n_layers: int, vocab_size: int):
        self.keep, self.score = settings.keep, settings.score
        self.start, self.end = layer_range(settings.layers, n_layers)
        if self.score == "loss":
            self.token_loss = TokenLoss(initial_loss(vocab_size), out_sharding=("vocab",),
                                        eager_sharding=False)

    def span(self, first: int, count: int, total: int, seq_len: int, training: bool):
        if not training or kept_tokens(seq_len, self.keep) >= seq_len:
            return None
        lo, hi = max(self.start - first, 0), min(self.end - first, count)
        return (lo, hi) if lo < hi else None

    def run_span(self, run, x_BTD, token_args: dict):
        step = nn.current()
        segment_ids_BT = token_args.get("segment_ids")
        if segment_ids_BT is None:
            segment_ids_BT = step.batch["segment_ids"]
        token_loss_V = targets_BT = None
        if self.score == "loss":
            token_loss_V, targets_BT = self.token_loss[...], step.batch["targets"]
        index_BK = select(jax.random.fold_in(step.key, SELECT_KEY), segment_ids_BT,
                          kept_tokens(x_BTD.shape[1], self.keep), targets_BT, token_loss_V)
        kept_args = {name: None if a is None else gather(a, index_BK)
                     for name, a in token_args.items()}
        if "segment_ids" in token_args:     # the kept tokens attend within their own document
            kept_args["segment_ids"] = gather(segment_ids_BT, index_BK)
        x_BKD = constrain(gather(x_BTD, index_BK), ACTIVATION_AXES)
        return scatter(x_BTD, index_BK, run(x_BKD, kept_args))

    def loss_stats(self, logits_BTV, batch):
        """The batch's per-target-id sums of the token losses and counts of the real tokens
        (float32 [vocab_size] each), from which ``update`` moves the running loss."""
        if self.score != "loss":
            return None
        vocab = self.token_loss.shape[0]
        token_loss_BT = optax.softmax_cross_entropy_with_integer_labels(
            jax.lax.stop_gradient(logits_BTV).astype(jnp.float32), batch["targets"])
        real_BT = (batch["weights"] > 0).astype(jnp.float32)
        return {"token_loss_sum": _per_id_sum(token_loss_BT * real_BT, batch["targets"], vocab),
                "token_count": _per_id_sum(real_BT, batch["targets"], vocab)}

    def update(self, step, stats, observed):
        """The running loss per id moved towards the step's mean loss of each id it saw as a
        target; ids not seen, and a step whose losses are not finite, leave it unchanged."""
        if self.score != "loss":
            return
        old_V = self.token_loss[...]
        count_V = stats["token_count"]
        mean_V = stats["token_loss_sum"] / jnp.maximum(count_V, 1.0)
        update_V = (count_V > 0) & jnp.isfinite(mean_V)
        new_V = jnp.where(update_V, DECAY * old_V + (1.0 - DECAY) * mean_V, old_V)
        self.token_loss[...] = new_V.astype(old_V.dtype)


def check(cfg) -> None:
    """The layers' form (their range needs the model's depth: ``apply``), and what token
    dropping cannot combine with: pipeline stages."""
    if cfg.token_drop.layers is not None:
        layer_range(cfg.token_drop.layers, None)
    if cfg.token_drop.keep < 1.0:
        refuse_pipeline(cfg.mesh.strategy, "token dropping", "token_drop.keep")


def apply(model, settings: TokenDropSettings, vocab_size: int) -> None:
    """Install token dropping on the model's stack (nothing when ``keep`` is 1)."""
    if settings.keep >= 1.0:
        return
    _, stack = nn.the_stack(model, "token dropping", "token_drop.keep")
    start, end = layer_range(settings.layers, len(stack))
    if start >= end:
        raise ConfigError(
            f"token_keep={settings.keep} would drop no tokens: the default layers (the middle "
            f"half) of {len(stack)} layers are none; name them with --token-drop-layers "
            f"START:END or use at least 3 layers", field="token_drop.layers")
    stack.add(TokenDrop(settings, len(stack), vocab_size))


def kept_tokens(seq_len: int, keep: float) -> int:
    """K, the tokens per row the middle layers compute at ``keep`` for rows of ``seq_len``."""
    if keep >= 1.0:
        return seq_len
    if seq_len < MULTIPLE:
        return max(1, round(keep * seq_len))
    return min(seq_len, max(MULTIPLE, round(keep * seq_len / MULTIPLE) * MULTIPLE))


def initial_loss(vocab_size: int):
    """The buffer's first value: every id at a uniform prediction's loss, log(vocab_size)."""
    return jnp.full((vocab_size,), math.log(vocab_size), jnp.float32)


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


def _per_id_sum(values_BT, ids_BT, vocab: int):
    """float32 [vocab]: the sum of ``values_BT`` by id, whole on every device (under Explicit
    mesh axes the scatter is told so: it cannot infer it from batch-split ids)."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types
    out = {"out_sharding": jax.sharding.PartitionSpec()} if explicit else {}
    return jnp.zeros((vocab,), jnp.float32).at[ids_BT].add(values_BT, **out)


