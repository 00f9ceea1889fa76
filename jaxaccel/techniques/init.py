"""Initialisation schemes for training without warmup or normalisation, for any model whose
blocks are an ``nn.Stack``: ``--init`` picks one, ``apply(model, settings, key)`` applies it.

- ``default``: the model as built (jaxaccel's GPT: GPT-2's N(0, 0.02), residual output
  projections N(0, 0.02 / sqrt(2 L)), pre-norm blocks).
- ``rezero`` (Bachlechner et al. 2020, "ReZero is All You Need: Fast Convergence at Large
  Depth"): ``x + alpha_l F_l(x)``, one learned scalar per block, starting at 0.
- ``skipinit`` (De & Smith 2020, "Batch Normalization Biases Residual Blocks Towards the
  Identity Function in Deep Networks"): a learned scalar per residual branch, starting at 0.
- ``tfixup`` (Huang et al. 2020, "Improving Transformer Optimization Through Better
  Initialization"), decoder rule, M = L: Xavier-uniform linear layers, embedding N(0, d^-1/2),
  the embedding and the ``--tfixup-scaled`` layers scaled by ``(9 L)^(-1/4)``.

The last three replace the blocks' norms by ``Identity`` (the final norm stays); gates multiply
the outputs of the ``--gate-targets`` layers. Draws are keyed by path without the layer index
(``canonical``), so scanned and unrolled stacks start alike.
"""

import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.model import nn
from jaxaccel.techniques import surgery
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import INIT_SCHEMES as SCHEMES, InitSettings     # declared without jax

NORMS = (nnx.RMSNorm, nnx.LayerNorm)
INIT_KEY = 0x1417     # folded into the model's key for the scheme's own draws


class Identity(nnx.Module):
    """Where a block's norm was."""

    def __call__(self, x, *args, **kwargs):
        return x


class Gated(surgery.Wrapper):
    """The wrapped layer's output times a learned scalar ``gate`` (shared within a block for
    ReZero)."""

    def __init__(self, base, gate: nnx.Param):
        super().__init__(base)
        self.gate = gate

    def __call__(self, x, *args, **kwargs):
        y = self.base(x, *args, **kwargs)
        return y * self.gate[...].astype(y.dtype)


def apply(model, settings: InitSettings, key) -> None:
    """Initialise ``model`` (freshly built) by the scheme, in place."""
    if settings.scheme == "default":
        return
    stack_path, stack = nn.the_stack(model, f"init {settings.scheme}", "init.scheme")
    for path, node in list(nnx.iter_graph(stack)):
        if isinstance(node, NORMS):
            surgery.replace(stack, path, Identity())
    if settings.scheme in ("rezero", "skipinit"):
        _gate(model, settings, stack_path)
    else:
        _tfixup(model, settings, jax.random.fold_in(key, INIT_KEY), stack_path, len(stack))


def _gate(model, settings: InitSettings, stack_path: tuple) -> None:
    spec = settings.gates or surgery.default_targets(model, "gates", None, "init.gates")
    shared = {}

    def gate_for(path):
        block = _block_index(path, stack_path)
        if block is None:
            raise ConfigError(f"{settings.scheme} gates the blocks' residual branches, but "
                              f"{surgery.path_text(path)} is outside the model's Stack; name "
                              f"layers inside it", field="init.gates")
        if settings.scheme == "skipinit":
            return _scalar()
        return shared.setdefault(block, _scalar())

    surgery.wrap(model, spec, lambda path, layer: Gated(layer, gate_for(path)),
                 field="init.gates")


def _scalar() -> nnx.Param:
    return nnx.Param(jnp.zeros((), jnp.float32), out_sharding=(), eager_sharding=False)


def _block_index(path: tuple, stack_path: tuple):
    """The layer index of a path inside an unrolled stack's ``layers``, else None."""
    head = (*stack_path, "layers")
    if path[:len(head)] == head and len(path) > len(head) and isinstance(path[len(head)], int):
        return path[len(head)]
    return None


def canonical(path: tuple, stack_path: tuple) -> tuple[str, int | None]:
    """(name without the layer index, layer index or None): ``blocks/attn/wv/kernel``, 3."""
    layer = _block_index(path, stack_path)
    if layer is None:
        return surgery.path_text(path), None
    return surgery.path_text((*stack_path, *path[len(stack_path) + 2:])), layer


def _draw(key, name: str, layer, shape, sample):
    key = jax.random.fold_in(key, zlib.crc32(name.encode()))
    return sample(jax.random.fold_in(key, 0 if layer is None else layer), shape)


def _xavier(key, shape, dtype):
    """Xavier/Glorot uniform over the last two dimensions (fan in, fan out)."""
    limit = (6.0 / (shape[-2] + shape[-1])) ** 0.5
    return jax.random.uniform(key, shape, dtype, -limit, limit)


def tfixup_scale(n_layers: int) -> float:
    """T-Fixup's decoder factor ``(9 L)^(-1/4)``."""
    return (9.0 * n_layers) ** -0.25


def _tfixup(model, settings: InitSettings, key, stack_path: tuple, n_layers: int) -> None:
    spec = settings.scaled or surgery.default_targets(model, "tfixup", "blocks", "init.scaled")
    scaled = {path for path, _ in surgery.select(model, spec, field="init.scaled")}
    scale = tfixup_scale(n_layers)
    for path, layer in surgery.linear_layers(model):
        kernel = surgery.innermost(layer).kernel
        name, index = canonical((*path, "kernel"), stack_path)
        value = _draw(key, name, index, kernel.shape, lambda k, s: _xavier(k, s, kernel.dtype))
        kernel[...] = value * scale if path in scaled else value
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Embed):
            table = node.embedding
            name, index = canonical((*path, "embedding"), stack_path)
            std = table.shape[-1] ** -0.5
            value = _draw(key, name, index, table.shape,
                          lambda k, s: std * jax.random.normal(k, s, table.dtype))
            table[...] = value * scale


def transform(model, cfg, ctx) -> None:
    apply(model, cfg.init, ctx.key)


def report(cfg, ctx) -> str | None:
    return cfg.init.scheme if cfg.init.scheme != "default" else None


def describe(scheme: str) -> str:
    return f"init {scheme}"


def llama_blocker(cfg) -> tuple[str, str] | None:
    """Why a model with this scheme has no Hugging Face Llama layout, and the fix (or None)."""
    scheme = cfg.init.scheme
    if scheme == "default":
        return None
    gates = " and gates their branches" if scheme in ("rezero", "skipinit") else ""
    return f"init={scheme} removes the blocks' RMSNorms{gates}", "init=default"
