"""Token dropping (Hou et al. 2022, "Token Dropping for Efficient BERT Pretraining"; the survey's
"removing masked tokens"), for a causal language model whose blocks are an ``nn.Stack``.

``apply`` installs ``TokenDrop``, a block transform: in training the middle layers
(``--token-drop-layers``, default ``L//4 .. L - L//4``) compute only
``K = kept_tokens(T, token_keep)`` of each row's T tokens (``keep * T`` rounded to a multiple
of ``MULTIPLE``: static, nothing recompiles). The kept tokens and their per-token arguments
(rotary angles, segment ids) are gathered in sequence order, run through the middle layers and
scattered back; the others skip them unchanged. The loss is on every token; evaluation runs
every token through every layer. Rows never leave their device. A shallow stage of progressive
stacking drops tokens in the middle half of its own depth (none under 3 layers), or in the
named layers it has: a stage without any runs whole.

Padding is dropped first; ``K`` real tokens are drawn without replacement each step
(``--token-drop-score``): ``random`` uniformly, ``loss`` weighted by ``TokenLoss``, a running
loss per target id (Hou et al.'s cumulative loss; starts at ``log(vocab_size)``, moved by
``update`` from ``loss_stats`` with decay ``DECAY``). Hou et al. keep the highest-loss tokens
outright; here that left easy tokens untrained in the middle layers: validation loss 40 % above
the plain model's at keep 0.5 (8x128 model, 150 steps on the CPU), against +3 % drawn by weight
and -0.4 % drawn uniformly.

The middle layers' matmuls shrink by K/T (attention scores by (K/T)^2), as the run's FLOP count
and MFU see. Stochastic depth combines with it; pipeline strategies refuse it (``check``).
"""

import math

import jax
import jax.numpy as jnp
import optax

from jaxaccel.model import nn
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import (TOKEN_DROP_SCORES as SCORES,     # declared without jax
                               TokenDropSettings)
from jaxaccel.core.sharding import constrain, refuse_pipeline, take_rows

MULTIPLE = 8          # K, the kept tokens per row, is a multiple of this
DECAY = 0.9           # the running loss per id: new = DECAY * old + (1 - DECAY) * batch mean
SELECT_KEY = 0x70D    # folded into the step's model key for the choice of tokens
MIN_LOSS = 1e-6       # the smallest weight a running loss gives its tokens (log of it is finite)
ACTIVATION_AXES = ("batch", "seq", "embed")
TOKEN_AXES = ("batch", "seq")


def layer_range(text: str | None, n_layers: int | None) -> tuple[int, int]:
    """``(start, end)`` of the layers that see only the kept tokens: ``text`` (START:END) checked
    against ``n_layers`` when given, or the middle half, ``max(1, L // 4) .. L - max(1, L // 4)``
    (empty for fewer than 3 layers)."""
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
    field = "token_drop.keep"

    def __init__(self, settings: TokenDropSettings, layers: tuple[int, int], vocab_size: int):
        self.keep, self.score = settings.keep, settings.score
        self.start, self.end = layers
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
        if stats is None:       # a step built without the loss's per-id statistics
            raise ConfigError(
                "token dropping scored by loss updates its running loss per id from the loss's "
                "statistics, and the step computed none: pass stats=nn.loss_stats(model) to "
                "train.lm_train_step (or train.lm_loss), as with update_buffers=nn.updater(model)")
        old_V = self.token_loss[...]
        count_V = stats["token_count"]
        mean_V = stats["token_loss_sum"] / jnp.maximum(count_V, 1.0)
        update_V = (count_V > 0) & jnp.isfinite(mean_V)
        new_V = jnp.where(update_V, DECAY * old_V + (1.0 - DECAY) * mean_V, old_V)
        self.token_loss[...] = new_V.astype(old_V.dtype)


def check(cfg) -> None:
    """The layers' form (their range needs the model's depth: ``apply``); no pipeline stages."""
    if cfg.token_drop.layers is not None:
        layer_range(cfg.token_drop.layers, None)
    if cfg.token_drop.keep < 1.0:
        refuse_pipeline(cfg.mesh.strategy, "token dropping", "token_drop.keep")


def apply(model, settings: TokenDropSettings, vocab_size: int,
          full_layers: int | None = None) -> None:
    """Install token dropping on the model's stack (nothing when ``keep`` is 1). ``full_layers``:
    the depth of the whole model when the stack is a shallow stage of progressive stacking."""
    if settings.keep >= 1.0:
        return
    _, stack = nn.the_stack(model, "token dropping", "token_drop.keep")
    depth, whole = len(stack), full_layers or len(stack)
    if settings.layers is None:         # the middle half of this stack's own depth
        start, end = layer_range(None, depth)
    else:                               # checked against the whole model, cut to this stack
        start, end = layer_range(settings.layers, whole)
        end = min(end, depth)
    if start >= end and whole == depth:
        raise ConfigError(
            f"token_keep={settings.keep} would drop no tokens: the default layers (the middle "
            f"half) of {depth} layers are none; name them with --token-drop-layers "
            f"START:END or use at least 3 layers", field="token_drop.layers")
    stack.add(TokenDrop(settings, (start, end), vocab_size))    # a stage without any runs whole


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
    """The kept positions [B, kept], ascending: ``kept`` real tokens (padding only when a row has
    fewer) drawn without replacement, uniformly or weighted by ``token_loss_V`` of each token's
    target id (Gumbel top-k: the largest ``log weight + Gumbel noise``, from ``key``)."""
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
    """``a_BT[b, index_BK[b, k]]`` for [B, T, ...], mapped over rows (partitioned with them)."""
    return jax.vmap(lambda a_T, index_K: a_T[index_K])(a_BT, index_BK)


def scatter(x_BTD, index_BK, y_BKD):
    """``x_BTD`` with the kept tokens' rows replaced by ``y_BKD``, mapped over rows."""
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




def transform(model, cfg, ctx) -> None:
    apply(model, cfg.token_drop, cfg.model.vocab_size, ctx.full_layers)


def report(cfg, ctx) -> dict | None:
    keep = cfg.token_drop.keep
    return {"keep": keep, "score": cfg.token_drop.score} if keep < 1 else None


def describe(report: dict) -> str:
    return f"token keep {report['keep']:g} ({report['score']})"
