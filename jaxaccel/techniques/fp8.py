"""FP8 matmuls with delayed scaling (``--precision fp8``), for the linear layers of any model.

The ``--fp8-targets`` layers (default: every linear layer in the ``nn.Stack``) compute ``x @ w``
with both operands in ``float8_e4m3fn`` (3 mantissa bits, largest 448), the output gradient in
``float8_e5m2`` (2 mantissa bits, largest 57,344), accumulating in float32; Hopper multiplies
float8 at twice bfloat16's rate. Embedding, head, norms, softmax and loss keep the policy's
dtypes; master weights are float32.

Each tensor is cast as ``clip(t * s)``, ``s = 2^floor(log2(max_format / amax))``, and read back
divided by s. As in Transformer Engine the scale is *delayed*: from the largest amax of the last
``HISTORY`` steps (on the first, the tensor's own); values beyond range saturate, never inf.
``Fp8`` (``apply``, ``jaxaccel.techniques.surgery``) keeps them in ``History`` [3, HISTORY] (input,
weight, output gradient; column 0 newest), an ``nn.Observation`` buffer: ``matmul``'s backward pass
returns the step's amaxes as its cotangent, ``grads.value_and_grad`` takes them out of the
gradients and ``Fp8.update`` shifts them in. Unlike flax's ``Fp8DotGeneralOp`` (histories updated
through the optimizer) this leaves the optimizer unchanged. The ``dot`` takes the float8 operands
themselves and divides its float32 product by both scales: on sm89+ GPUs XLA makes it a cuBLASLt
FP8 GEMM with the scales as alpha (seen on an H200). The textbook quantise-dequantise form left
XLA:GPU to find the GEMM: on an H200 it folded the float32 -> float8 -> bfloat16 round trip away
and ran bfloat16 (BENCHMARKS.md). Off GPUs the float8 product runs emulated: FP8's rounding, not
its speed.
"""

import functools

import jax
import jax.numpy as jnp

from jaxaccel.model import nn
from jaxaccel.techniques import surgery
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sections import Fp8Settings     # declared without jax
from jaxaccel.core.sharding import constrain, einsum, refuse_pipeline

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HISTORY = 16             # steps of amax history a scale looks back over
INPUT, WEIGHT, GRAD = 0, 1, 2


def amax(x) -> jax.Array:
    """The largest magnitude of ``x``, in float32."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_for(history_amax, current_amax, dtype) -> jax.Array:
    """The power-of-two scale that maps the larger of the history's amaxes (or, with no history,
    ``current_amax``) inside ``dtype``'s range; 1 for an all-zero tensor."""
    seen = jnp.max(history_amax).astype(jnp.float32)
    reference = jnp.where(seen > 0, seen, current_amax)
    exponent = jnp.floor(jnp.log2(float(jnp.finfo(dtype).max) / reference))
    return jnp.where(reference > 0, jnp.exp2(jnp.clip(exponent, -126.0, 126.0)), 1.0)


def quantize(x, scale, dtype):
    """``x * scale`` saturated to ``dtype``'s range and cast to it."""
    limit = float(jnp.finfo(dtype).max)
    scaled = x.astype(jnp.float32) * scale
    return jnp.clip(scaled, -limit, limit).astype(dtype)


def matmul(x, w, history, axes=(None, None)):
    """``x [B, T, K] @ w [K, N]`` through float8 e4m3, scaled by ``history`` [3, HISTORY]; in
    ``x``'s dtype. Its backward pass is e5m2, and ``history``'s cotangent is the observed amaxes
    in column 0 (zeros elsewhere). ``axes``: the kernel's logical axes (``sharding.einsum``)."""
    return _matmul(x, w.astype(x.dtype), history, tuple(axes))


def _contract(subscripts, a, a_scale, b, b_scale, out_axes, dtype):
    """The product of two float8 operands, accumulated in float32 on the FP8 tensor cores, then
    divided by both scales (powers of two: exact); in ``dtype``."""
    product = einsum(subscripts, a, b, out_axes, preferred_element_type=jnp.float32)
    return (product * (1.0 / (a_scale * b_scale))).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x, w, history, axes):
    return _forward(x, w, history, axes)[0]


def _forward(x, w, history, axes):
    x_amax, w_amax = amax(x), amax(w)
    x_scale = scale_for(history[INPUT], x_amax, E4M3)
    w_scale = scale_for(history[WEIGHT], w_amax, E4M3)
    x_q, w_q = quantize(x, x_scale, E4M3), quantize(w, w_scale, E4M3)
    y = _contract("btk,kn->btn", x_q, x_scale, w_q, w_scale, ("batch", "seq", axes[1]), x.dtype)
    return y, (x_q, x_scale, w_q, w_scale, history, x_amax, w_amax)


def _matmul_bwd(axes, residuals, g):
    x_q, x_scale, w_q, w_scale, history, x_amax, w_amax = residuals
    g_amax = amax(g)
    g_scale = scale_for(history[GRAD], g_amax, E5M2)
    g_q = quantize(g, g_scale, E5M2)
    dx = _contract("btn,kn->btk", g_q, g_scale, w_q, w_scale, ("batch", "seq", axes[0]), g.dtype)
    dw = _contract("btk,btn->kn", x_q, x_scale, g_q, g_scale, axes, g.dtype)
    observed = jnp.zeros(history.shape, jnp.float32).at[:, 0].set(
        jnp.stack([x_amax, w_amax, g_amax]))
    return dx, dw, observed.astype(history.dtype)


_matmul.defvjp(_forward, _matmul_bwd)


def new_history() -> jax.Array:
    """A layer's empty history (zeros: no amax seen yet)."""
    return jnp.zeros((3, HISTORY), jnp.float32)


def record(history, observed):
    """``history`` [..., 3, HISTORY] shifted one step older, with ``observed``'s column 0 (the
    step's amaxes, the cotangent ``matmul`` returns) as the newest."""
    shifted = jnp.roll(history, 1, axis=-1)
    return shifted.at[..., 0].set(observed[..., 0].astype(history.dtype))


class History(nn.Observation):
    """An FP8 layer's amax history [3, HISTORY] (module docstring)."""


class Fp8(surgery.Wrapper, nn.Updated):
    """The wrapped layer's product through float8 with delayed scaling."""

    changes_product = True

    def __init__(self, base):
        super().__init__(base)
        self.history = History(new_history(), out_sharding=(None, None), eager_sharding=False)

    def __call__(self, x, *args, **kwargs):
        history, axes = self.history[...], surgery.kernel_axes(self)

        def fp8_dot(inner):
            return lambda x, kernel, *_, **__: matmul(x, constrain(kernel, axes), history, axes)

        with surgery.dot(self.linear(), fp8_dot):
            return self.base(x, *args, **kwargs)

    def update(self, step, stats, observed):
        if observed is None:    # a gradient function told to observe nothing
            raise ConfigError(
                "FP8's amax histories are updated from the amaxes the backward pass observes, "
                "and the step observed none: build its gradient function with "
                "observed=nn.Observation (grads.value_and_grad's default for a state holding "
                "histories)")
        self.history[...] = record(self.history[...], observed["history"][...])


def check(cfg) -> None:
    """What the fp8 policy cannot combine with: pipeline stages."""
    if cfg.policy().fp8:
        refuse_pipeline(cfg.mesh.strategy, "the fp8 policy", "precision.policy")


def apply(model, settings: Fp8Settings) -> int:
    """Wrap the targeted linear layers of ``model`` in ``Fp8``; how many."""
    return surgery.wrap(model, settings.targets, lambda path, layer: Fp8(layer),
                        field="fp8.targets")


def check_device(device=None) -> str:
    """How FP8 matmuls run on ``device`` (default: the first), a note for the run's output;
    ConfigError on a GPU without FP8 tensor cores (emulation there is only slower than bf16)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return f"emulated on {device.platform}: FP8's rounding, not its speed"
    capability = str(getattr(device, "compute_capability", "0"))
    if float(capability) < 8.9:
        raise ConfigError(f"{device.device_kind} (compute capability {capability}) has no FP8 "
                          f"tensor cores (Ada 8.9 or Hopper 9.0 needed); use --precision bf16",
                          field="precision.policy")
    return f"FP8 tensor cores of the {device.device_kind}"


FP8_GEMM = "__cublas$lt$matmul$f8"     # XLA:GPU's custom call for a cuBLASLt FP8 GEMM


def fp8_gemms(executables) -> int | None:
    """How many cuBLASLt FP8 GEMMs XLA emitted in the compiled step (``CompiledFn.executables``):
    0 when the matmuls run in a wider dtype; None off GPUs, where FP8 is emulated."""
    if jax.devices()[0].platform != "gpu" or not executables:
        return None
    return max(executable.as_text().count(FP8_GEMM) for executable in executables)


WRAPPERS = (Fp8,)


def transform(model, cfg, ctx) -> None:
    if cfg.policy().fp8:
        apply(model, cfg.fp8)


def report(cfg, ctx) -> dict | None:
    if not cfg.policy().fp8:
        return None
    return {"note": ctx.run.get("fp8_note"), "gemms": fp8_gemms(ctx.run.get("executables") or [])}


def device_note(cfg) -> str | None:
    return check_device() if cfg.policy().fp8 else None


def llama_blocker(cfg) -> tuple[str, str] | None:
    if cfg.policy().fp8:
        return ("precision.policy=fp8 quantises its matmuls (Llama's are plain)",
                "another precision.policy")
    return None
