"""Two GPU questions in one short device call (about 100 s on an H200):

1. ``init``: the sharded initialisation of GPT-2 small compiled cold, with and without JAX's GPU
   threefry kernel, each in a fresh process (compile seconds, and a checksum of one weight).
2. ``fp8``: what XLA makes of ``fp8.matmul`` (float8 operands into the dot) and of
   quantise-dequantise forms at
   [16, 1024, 768] x [768, 3072], forward and backward: the custom calls, whether any cuBLASLt
   FP8 GEMM or float8 type is left, and the time of each; the optimized HLO of each form goes
   to $OUT.

    PYTHONPATH=. python3 tools/gpu_probe.py [fp8] [init]     # on the device machine
    OUT=/tmp/p PYTHONPATH=. .venv/bin/python tools/gpu_probe.py fp8   # here: toy sizes, CPU
"""
import json, os, re, subprocess, sys, time
OUT = os.environ.get("OUT", "/tmp/probe_out")
os.makedirs(OUT, exist_ok=True)

INIT = r'''
import time, sys, jax, numpy as np
from jax.sharding import Mesh
from jax._src import config as jc
from jaxaccel.run import config as C
from jaxaccel.techniques import registry as techniques
from jaxaccel.step.optim import build_optimizer
from jaxaccel.step.state import state_maker
cfg = C.parse(["--model","small","--seq-len","1024","--batch-size","16","--precision",sys.argv[2]])
opt, _, _ = build_optimizer(cfg.optimizer, batch_rows=16, total_steps=100)
mesh = Mesh(np.array(jax.devices()[:1]).reshape(1,1,1,1), ("stage","data","fsdp","tensor"))
make_state, abstract, sh = state_maker(techniques.variables(cfg, None), opt, 0, cfg.make_loss_scale(), mesh, cfg.policy(), None)
t = time.time()
with jc.threefry_gpu_kernel_lowering(sys.argv[1] == "kernel"):
    lowered = jax.jit(make_state, out_shardings=sh).lower(jax.random.PRNGKey(0))
    t1 = time.time(); c = lowered.compile(); t2 = time.time()
    s = c(jax.random.PRNGKey(0)); jax.block_until_ready(s); t3 = time.time()
leaf = jax.tree.leaves(s.params)[3]
print(f"INIT {sys.argv[1]} {sys.argv[2]}: lower {t1-t:.1f} s compile {t2-t1:.1f} s run {t3-t2:.2f} s checksum {float(abs(leaf.astype('float32')).sum()):.6f}")
'''

FP8 = r'''
import time, jax, jax.numpy as jnp, re
from jaxaccel.techniques import fp8
E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
import os; B, T, K, N = (16, 1024, 768, 3072) if jax.devices()[0].platform == "gpu" else (2, 32, 64, 128)
kx, kw, kg = jax.random.split(jax.random.PRNGKey(1), 3)
x = jax.random.normal(kx, (B, T, K), jnp.bfloat16); w = (jax.random.normal(kw, (K, N), jnp.float32) * 0.02)
g = jax.random.normal(kg, (B, T, N), jnp.bfloat16)
h = fp8.new_history()

def ours(x, w, h):
    return fp8.matmul(x, w, h)

def plain_qdq(x, w, h):   # textbook QDQ: f8 converts times scalar, dot in bf16 out
    sx = fp8.scale_for(h[0], fp8.amax(x), E4); sw = fp8.scale_for(h[1], fp8.amax(w), E4)
    xq = fp8.quantize(x, sx, E4).astype(jnp.bfloat16) * (1 / sx).astype(jnp.bfloat16)
    wq = fp8.quantize(w, sw, E4).astype(jnp.bfloat16) * (1 / sw).astype(jnp.bfloat16)
    return jnp.einsum("btk,kn->btn", xq, wq)

def f32_qdq(x, w, h):     # dequantise in float32, f32 output then bf16
    sx = fp8.scale_for(h[0], fp8.amax(x), E4); sw = fp8.scale_for(h[1], fp8.amax(w), E4)
    xq = fp8.quantize(x, sx, E4).astype(jnp.float32) / sx
    wq = fp8.quantize(w, sw, E4).astype(jnp.float32) / sw
    return jnp.einsum("btk,kn->btn", xq, wq).astype(jnp.bfloat16)

def bf16(x, w, h):
    return jnp.einsum("btk,kn->btn", x, w.astype(jnp.bfloat16))

def timeit(f, *a):
    f(*a); jax.block_until_ready(f(*a))
    ts = []
    for _ in range(5):
        t = time.perf_counter(); r = None
        for _ in range(20): r = f(*a)
        jax.block_until_ready(r); ts.append((time.perf_counter() - t) / 20 * 1e3)
    return sorted(ts)[2]

for name, fn in [("bf16", bf16), ("ours", ours), ("plain_qdq", plain_qdq), ("f32_qdq", f32_qdq)]:
    fwd = jax.jit(fn)
    def loss(x, w, h, fn=fn): return jnp.sum(fn(x, w, h).astype(jnp.float32) * g)
    both = jax.jit(jax.grad(loss, argnums=(0, 1)))
    cf = fwd.lower(x, w, h).compile().as_text(); cb = both.lower(x, w, h).compile().as_text()
    if name in ("ours", "plain_qdq"):
        open(f"{OUTDIR}/hlo_{name}_fwdbwd.txt", "w").write(cb)
    calls = lambda t: sorted(set(re.findall(r'custom_call_target="([^"]+)"', t)))
    f8 = lambda t: t.count("f8e4m3") + t.count("f8e5m2")
    print(f"FP8 {name}: fwd {timeit(fwd, x, w, h):.3f} ms, fwd+bwd {timeit(both, x, w, h):.3f} ms; "
          f"fwd calls {calls(cf)}; bwd calls {calls(cb)}; cublas f8 gemms fwd {cf.count(fp8.FP8_GEMM)} fwdbwd {cb.count(fp8.FP8_GEMM)}; triton {cb.count('__triton')}; f8 mentions {f8(cb)}")
'''

def run(code, *args, limit=150):
    t = time.time()
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       timeout=limit, env={**os.environ, "OUTDIR": OUT})
    lines = [l for l in p.stdout.splitlines() if l.startswith(("INIT", "FP8"))]
    tail = "" if p.returncode == 0 else p.stderr[-1500:]
    print("\n".join(lines) or f"rc {p.returncode}", f"({time.time()-t:.0f} s)", tail, flush=True)

FP8 = "import os; OUTDIR = os.environ['OUTDIR']\n" + FP8
which = sys.argv[1:] or ["init", "fp8"]
if "fp8" in which:
    try: run(FP8, limit=90)
    except subprocess.TimeoutExpired: print("fp8 probe timed out")
if "init" in which:
    for mode in ("kernel", "default"):
        try: run(INIT, mode, "bf16", limit=70)
        except subprocess.TimeoutExpired: print(f"init {mode} timed out")
