"""FP8 matmuls with delayed scaling (``--precision fp8``), for the linear layers of any model.

Hopper's tensor cores multiply float8 at twice bfloat16's rate. The layers ``--fp8-targets``
names (default: every linear layer in the model's ``nn.Stack``) compute ``x @ w`` with both
operands in ``float8_e4m3fn`` (3 mantissa bits,
largest 448) and the backward pass's output gradient in ``float8_e5m2`` (2 mantissa bits,
largest 57,344: range rather than precision), accumulating in float32. Everything numerically
sensitive stays out of FP8 by default: the embedding and the output head, norms, softmax, rotary
angles and the loss run in the policy's bfloat16/float32, and the master weights are float32.

float8 has too little range for raw tensors, so each is scaled per tensor before the cast: a
tensor ``t`` is stored as ``cast(clip(t * s))`` and read back as ``cast(...) / s``. The scale
comes from the tensor's largest magnitude (amax): ``s = 2^floor(log2(max_format / amax))``, the
largest power of two that keeps the tensor in range (powers of two scale without rounding).
Computing a tensor's amax before casting it costs a pass over it, so, as Transformer Engine does,
the scale is *delayed*: it comes from the largest amax seen in the last ``HISTORY`` steps, and the
amax of this step's tensor is recorded for the next. Values beyond the range saturate at the
format's largest value (never inf or NaN); until a tensor has a history (the first step) its own
amax is used.

``apply`` wraps each targeted ``nnx.Linear`` in ``Fp8`` (module surgery, ``jaxaccel.surgery``),
whose history ``History`` [3, HISTORY] (rows: input, weight, output gradient; column 0 the newest)
is an ``nn.Observation`` buffer: stacked with a scanned stack, sharded (replicated), checkpointed
and restored with the weights, never trained. Around the layer's call the wrapper hands the layer
a ``dot_general`` that quantises both operands (the layer's own dtype promotion, bias and sharding
stay as they are). The step reads the new amaxes as the cotangent of the history: ``matmul``'s
backward pass returns them in column 0 instead of a gradient, ``grads.value_and_grad(observed=
nn.Observation)`` takes them out of the gradients (the maximum over microbatches), and
``Fp8.update`` shifts them into the history after the optimizer's update.

The matmul is written as quantise, dequantise, ``dot`` (the "QDQ" form): XLA's GPU compiler
rewrites ``dot(dequantise(f8), dequantise(f8))`` into one cuBLASLt FP8 GEMM with the scales as
operands on sm89+ GPUs; elsewhere (the CPU) the same program runs emulated, with FP8's rounding
and saturation but at the compute dtype's speed. We wrote this rather than use flax's
``Fp8DotGeneralOp`` (whose amax histories are variables updated through the optimizer, with a
special "overwrite with gradient" rule): a buffer the step updates keeps the optimizer and what
trains unchanged.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxaccel import nn, surgery
from jaxaccel.settings import setting
from jaxaccel.sharding import constrain, einsum, refuse_pipeline

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HISTORY = 16             # steps of amax history a scale looks back over
INPUT, WEIGHT, GRAD = 0, 1, 2


@dataclasses.dataclass
class Fp8Settings:
    targets: str = setting("blocks", "with --precision fp8, the layers whose matmuls run in "
                                     "float8: " + surgery.TARGETS_HELP, flag="fp8_targets")


def format_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def amax(x) -> jax.Array:
    """The largest magnitude of ``x``, in float32."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_for(history_amax, current_amax, dtype) -> jax.Array:
    """The power-of-two scale that maps the larger of the history's amaxes (or, with no history,
    ``current_amax``) inside ``dtype``'s range; 1 for an all-zero tensor."""
    seen = jnp.max(history_amax).astype(jnp.float32)
    reference = jnp.where(seen > 0, seen, current_amax)
    exponent = jnp.floor(jnp.log2(format_max(dtype) / reference))
    return jnp.where(reference > 0, jnp.exp2(jnp.clip(exponent, -126.0, 126.0)), 1.0)


def quantize(x, scale, dtype):
    """``x * scale`` saturated to ``dtype``'s range and cast to it."""
    limit = format_max(dtype)
    scaled = x.astype(jnp.float32) * scale
    return jnp.clip(scaled, -limit, limit).astype(dtype)


def dequantize(q, scale, dtype):
    """``q`` back in ``dtype``, divided by its scale: a convert and a multiply by the (exact,
    power-of-two) inverse scale, the form XLA folds into an FP8 GEMM's operand."""
    return q.astype(dtype) * (1.0 / scale).astype(dtype)


def qdq(x, scale, fp8_dtype):
    """``x`` rounded through float8 and back to its own dtype: FP8's rounding and saturation."""
    return dequantize(quantize(x, scale, fp8_dtype), scale, x.dtype)


def matmul(x, w, history, axes=(None, None)):
    """``x [B, T, K] @ w [K, N]`` with both operands through float8 e4m3, scaled by ``history``
    ([3, HISTORY] amaxes of input, weight, output gradient); the output in ``x``'s dtype.
    Differentiating it gives the e5m2 backward pass for x and w, and for ``history`` the
    observed amaxes in column 0 (zeros elsewhere), not a gradient (module docstring). ``axes``
    are the kernel's logical axes: each product is laid out by them under a mesh
    (``sharding.einsum``)."""
    return _matmul(x, w.astype(x.dtype), history, tuple(axes))


def _contract(subscripts, a, b, out_axes):
    """A product of two dequantised operands, accumulated in float32, in ``a``'s dtype."""
    return einsum(subscripts, a, b, out_axes,
                  preferred_element_type=jnp.float32).astype(a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x, w, history, axes):
    return _forward(x, w, history, axes)[0]


def _forward(x, w, history, axes):
    x_amax, w_amax = amax(x), amax(w)
    x_q = qdq(x, scale_for(history[INPUT], x_amax, E4M3), E4M3)
    w_q = qdq(w, scale_for(history[WEIGHT], w_amax, E4M3), E4M3)
    y = _contract("btk,kn->btn", x_q, w_q, ("batch", "seq", axes[1]))
    return y, (x_q, w_q, history, x_amax, w_amax)


def _matmul_bwd(axes, residuals, g):
    x_q, w_q, history, x_amax, w_amax = residuals
    g_amax = amax(g)
    g_q = qdq(g, scale_for(history[GRAD], g_amax, E5M2), E5M2)
    dx = _contract("btn,kn->btk", g_q, w_q, ("batch", "seq", axes[0]))
    dw = _contract("btk,btn->kn", x_q, g_q, axes)
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

    def __init__(self, base):
        super().__init__(base)
        self.history = History(new_history(), out_sharding=(None, None), eager_sharding=False)

    def __call__(self, x, *args, **kwargs):
        history, axes = self.history[...], surgery.kernel_axes(self)

        def fp8_dot(inner):
            def dot(x, kernel, *_, **__):
                return matmul(x, constrain(kernel, axes), history, axes)
            return dot

        with surgery.dot(self.linear(), fp8_dot):
            return self.base(x, *args, **kwargs)

    def update(self, step, stats, observed):
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
    """How FP8 matmuls run on ``device`` (default: the first): a note for the run's output;
    ConfigError on a GPU without FP8 tensor cores, where emulation would only be slower than
    bf16. Off GPUs (the CPU) FP8 runs emulated: the same numerics, no speed-up."""
    from jaxaccel.errors import ConfigError
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
    """How many FP8 GEMMs XLA emitted in the compiled step (``CompiledFn.executables``): on a
    GPU, whether the QDQ matmuls became FP8 tensor-core GEMMs (0: they run in the compute
    dtype); None off GPUs, where FP8 is emulated by design."""
    if jax.devices()[0].platform != "gpu" or not executables:
        return None
    return max(executable.as_text().count(FP8_GEMM) for executable in executables)
