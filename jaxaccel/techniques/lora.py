"""Parameter-efficient fine-tuning of any NNX model: LoRA and bottleneck adapters.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") learns the update of
a frozen trained weight W as ``(alpha / r) A B``, A [d_in, r] Gaussian (std d_in^-1/2), B
[r, d_out] zero: ``apply_lora`` wraps the ``--lora-targets`` layers in ``LoRA`` (``nnx.LoRAParam``
factors), ``merge`` folds them (and flax's ``nnx.LoRA``) back into W, same logits. Adapters
(Houlsby et al. 2019, "Parameter-Efficient Transfer Learning for NLP"): ``apply_adapters`` adds
``h + up(gelu(down(h)))`` (``nn.Tuned``, ``up`` zero; not mergeable) after each
``--adapter-targets`` layer. A model holding ``LoRAParam`` or ``Tuned`` variables trains only
those (``nn.trainable``). Draws are keyed by layer path, so any order of techniques agrees.
"""

import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxaccel.model import nn
from jaxaccel.techniques import surgery
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import AdapterSettings, LoRASettings     # declared without jax
from jaxaccel.core.sharding import constrain, matmul, refuse_pipeline


def _key(key, path):
    return jax.random.fold_in(key, zlib.crc32(surgery.path_text(path).encode()))


class LoRA(surgery.Wrapper):
    """``base(x) + (alpha / rank) (x A) B``, A and B flax's ``nnx.LoRAParam``."""

    def __init__(self, base, rank: int, alpha: float, key):
        super().__init__(base)
        d_in, d_out = self.kernel.shape[-2:]
        if rank > min(d_in, d_out):
            raise ConfigError(f"lora_rank={rank} exceeds the width {min(d_in, d_out)} of a "
                              f"targeted layer; choose a rank of at most its smaller dimension",
                              field="lora.rank")
        in_axis, out_axis = surgery.kernel_axes(base)
        self.scale = alpha / rank
        self.out_axes = ("batch", "seq", out_axis)
        self.lora_a = nnx.LoRAParam(
            nnx.initializers.normal(stddev=d_in ** -0.5)(key, (d_in, rank)),
            out_sharding=(in_axis, "lora"), eager_sharding=False)
        self.lora_b = nnx.LoRAParam(jnp.zeros((rank, d_out)), out_sharding=("lora", out_axis),
                                    eager_sharding=False)

    def __call__(self, x, *args, **kwargs):
        y = self.base(x, *args, **kwargs)
        low = x @ self.lora_a[...].astype(x.dtype)
        update = matmul(low, self.lora_b[...].astype(x.dtype), self.out_axes[-x.ndim:])
        return y + (self.scale * update).astype(y.dtype)

    def fold(self) -> None:
        _fold(self.kernel, self, self.scale)


class Adapter(surgery.Wrapper):
    """``h + up(gelu(down(h)))`` on the wrapped layer's output ``h``; ``up`` starts at zero."""

    def __init__(self, base, dim: int, key):
        super().__init__(base)
        d = self.kernel.shape[-1]
        out_axis = surgery.kernel_axes(base)[1]
        self.axes = (out_axis, "adapter")
        self.adapter_down = nn.Tuned(nnx.initializers.normal(stddev=0.02)(key, (d, dim)),
                                     out_sharding=(out_axis, "adapter"), eager_sharding=False)
        self.adapter_up = nn.Tuned(jnp.zeros((dim, d)), out_sharding=("adapter", out_axis),
                                   eager_sharding=False)

    def __call__(self, x, *args, **kwargs):
        h = self.base(x, *args, **kwargs)
        rows = ("batch", "seq")[:h.ndim - 1]
        down = constrain(self.adapter_down[...].astype(h.dtype), self.axes)
        up = constrain(self.adapter_up[...].astype(h.dtype), self.axes[::-1])
        inner = matmul(h, down, (*rows, "adapter"))
        return h + matmul(jax.nn.gelu(inner), up, (*rows, self.axes[0]))


def check(cfg) -> None:
    """What LoRA and adapters need (a trained run's weights) and cannot combine with: pipeline
    stages and progressive stacking (which grows a model trained from scratch)."""
    for on, name, field in ((cfg.lora.rank > 0, "LoRA", "lora.rank"),
                            (cfg.adapters.dim > 0, "adapters", "adapters.dim")):
        if not on:
            continue
        refuse_pipeline(cfg.mesh.strategy, name, field)
        if cfg.stacking.stages > 1:
            raise ConfigError("progressive_stack grows a model being trained from scratch, "
                              "not a LoRA/adapter fine-tune; leave one out",
                              field="stacking.stages")
        if not cfg.run.init_from and not cfg.run.resume:
            raise ConfigError("LoRA and adapters tune a trained model; pass the run directory "
                              "whose weights they start from", field="run.init_from")


def apply_lora(model, settings: LoRASettings, key) -> int:
    """Wrap the targeted linear layers of ``model`` in ``LoRA``; how many (0 when off)."""
    if not settings.rank:
        return 0
    targets = settings.targets or surgery.default_targets(model, "lora", "blocks", "lora.targets")
    return surgery.wrap(model, targets, lambda path, layer: LoRA(
        layer, settings.rank, settings.alpha, _key(key, path)), field="lora.targets")


def apply_adapters(model, settings: AdapterSettings, key) -> int:
    """Put an ``Adapter`` on the output of each targeted layer; how many (0 when off)."""
    if not settings.dim:
        return 0
    targets = settings.targets or surgery.default_targets(model, "adapters", None,
                                                          "adapters.targets")
    adapter_key = jax.random.fold_in(key, 0xADA)
    return surgery.wrap(model, targets, lambda path, layer: Adapter(
        layer, settings.dim, _key(adapter_key, path)), field="adapters.targets")


def _fold(kernel, lora, scale=1.0) -> None:
    """Add ``scale * lora_a @ lora_b`` of ``lora`` to ``kernel``, in float32."""
    a, b = (jnp.asarray(v[...], jnp.float32) for v in (lora.lora_a, lora.lora_b))
    w = kernel[...]
    kernel[...] = (w.astype(jnp.float32) + scale * (a @ b)).astype(w.dtype)


def merge(model) -> int:
    """Fold every LoRA update into its weight, in place: ours (``LoRA``) and flax's
    ``nnx.LoRA(base_module=...)``; how many. A LoRA under a wrapper that changes the product
    (FP8, N:M masks) stays: folded, it would be quantised or masked as it never trained."""
    under = {id(surgery.innermost(w)) for _, w in surgery.wrappers(model, surgery.Wrapper)
             if w.changes_product}
    ours = [(p, n) for p, n in nnx.iter_graph(model)
            if isinstance(n, LoRA) and id(n.linear()) not in under]
    for path, layer in ours:
        layer.fold()
        surgery.replace(model, path, layer.base)
    flax = [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.LoRA)]
    for path, layer in flax:
        base = getattr(layer, "base_module", None)
        if base is None or not hasattr(base, "kernel"):
            raise ConfigError(f"{surgery.path_text(path)} is an nnx.LoRA without a base layer: "
                              f"it has no weight to merge into")
        _fold(base.kernel, layer)
        surgery.replace(model, path, base)
    return len(ours) + len(flax)


WRAPPERS = (Adapter, LoRA)


def transform_lora(model, cfg, ctx) -> None:
    apply_lora(model, cfg.lora, ctx.tune_key)


def transform_adapters(model, cfg, ctx) -> None:
    apply_adapters(model, cfg.adapters, ctx.tune_key)


def report_lora(cfg, ctx) -> dict | None:
    """LoRA's and the adapters' settings together (either makes a fine-tune)."""
    if not (cfg.lora.rank or cfg.adapters.dim):
        return None
    return {"rank": cfg.lora.rank, "adapter_dim": cfg.adapters.dim, "init_from": cfg.run.init_from}


def llama_blocker_adapters(cfg) -> tuple[str, str] | None:
    if cfg.adapters.dim > 0:
        return f"adapter_dim={cfg.adapters.dim} (Llama has no adapters)", "adapter_dim=0"
    return None


def exported_settings(cfg, model) -> dict:
    """LoRA's rank in an exported model's settings: 0 once ``merge`` folded it into the
    weights, kept where FP8 or N:M masks change the product and its factors stay."""
    return {"lora.rank": cfg.lora.rank if surgery.wrappers(model, LoRA) else 0}
