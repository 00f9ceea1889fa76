"""Export a trained run's model to safetensors with a config file, checked by reading it back.

Two layouts:

- ``native``: every leaf of the parameter dict (LoRA merged, float32) under its dotted path
  (``blocks.0.attn.wq.kernel``; with ``scan_layers`` ``blocks.attn.wq.kernel`` with the layer
  axis first), buffers included (``fp8_amax``, ``nm_mask``, ``token_loss``: state the forward
  reads but training does not differentiate), and ``config.json`` = the ModelConfig's fields,
  the step and the tokenizer. ``jaxaccel.model`` reads it back as it is.
- ``llama``: Hugging Face's ``LlamaForCausalLM`` layout (``model.layers.{i}.self_attn.q_proj
  .weight`` ... as torch Linear weights [out, in]) and its ``config.json``, when the model is
  a Llama: RoPE (ours rotates the two halves of each head, as HF's ``rotate_half`` does, so no
  permutation), RMSNorm before each branch (epsilon 1e-6) and at the end, SwiGLU (``w_gate`` is
  ``gate_proj``, ``w_in`` ``up_proj``, ``w_out`` ``down_proj``), an untied head, and none of
  the options Llama lacks (branch gates, adapters, FP8 matmuls, N:M masks; ``blocker`` names
  the one in the way).

After writing, ``check`` reads the files back: every tensor must equal what was meant bitwise,
and a forward pass computed from the files alone (the llama layout: an independent NumPy
implementation of HF's Llama forward; native: ``model.make_apply`` on the read parameters) must
give our model's logits on a short sequence to float32 tolerance. Files are written under a
temporary name and renamed, so a crash never leaves a half file under the final name.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccel.errors import ConfigError
from jaxaccel.model import make_apply
from jaxaccel.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer

FORMATS = ("auto", "native", "llama")
RMS_EPS = 1e-6          # flax nnx.RMSNorm's default epsilon, which the model's norms use
WEIGHTS = "model.safetensors"


@dataclasses.dataclass
class Exported:
    """What ``export`` wrote and what its read-back check measured."""

    out_dir: str
    format: str
    step: int
    tensors: int
    bytes: int
    max_logit_diff: float


def blocker(cfg) -> str | None:
    """Why the model ``cfg`` (LoRA already merged) has no Llama layout; None if it has one."""
    reasons = [
        (cfg.mlp != "swiglu", f"its MLP is {cfg.mlp}, Llama's is SwiGLU"),
        (cfg.tie_embeddings, "its output head is tied to the embedding"),
        (not cfg.block_norms, f"init {cfg.init} has no norms before the branches"),
        (cfg.init in ("rezero", "skipinit"), f"init {cfg.init} gates the branches"),
        (cfg.adapter_dim > 0, "it has adapters"),
        (cfg.fp8, "its matmuls are FP8 quantise-dequantise"),
        (cfg.sparsity != "none", f"its weights carry {cfg.sparsity} masks"),
    ]
    return next((why for blocked, why in reasons if blocked), None)


def flatten(params) -> dict[str, np.ndarray]:
    """The leaves of a nested parameter dict by dotted path, as NumPy arrays."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        flat[name] = np.asarray(leaf)
    return flat


def unflatten(flat: dict[str, np.ndarray], like):
    """``flatten``'s inverse into the structure of ``like``."""
    names = list(flatten(like))
    return jax.tree.unflatten(jax.tree.structure(like), [flat[name] for name in names])


def layer_params(cfg, params) -> list[dict]:
    """The blocks' parameters, one dict per layer (scanned layers unstacked)."""
    blocks = params["blocks"]
    if cfg.scan_layers:
        return [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(cfg.n_layers)]
    return [blocks[i] for i in range(cfg.n_layers)]


def llama_tensors(cfg, params) -> dict[str, np.ndarray]:
    """The Hugging Face Llama tensors of our parameters (torch Linear weights are [out, in])."""
    def weight(kernel):
        return np.ascontiguousarray(np.asarray(kernel, np.float32).T)

    out = {"model.embed_tokens.weight": np.asarray(params["embed"]["embedding"], np.float32),
           "model.norm.weight": np.asarray(params["final_norm"]["scale"], np.float32),
           "lm_head.weight": weight(params["head"]["kernel"])}
    names = {"attn": {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"},
             "mlp": {"w_gate": "gate_proj", "w_in": "up_proj", "w_out": "down_proj"}}
    for i, layer in enumerate(layer_params(cfg, params)):
        prefix = f"model.layers.{i}"
        for part, ours_to_hf in names.items():
            hf_part = "self_attn" if part == "attn" else "mlp"
            for ours, hf in ours_to_hf.items():
                out[f"{prefix}.{hf_part}.{hf}.weight"] = weight(layer[part][ours]["kernel"])
        out[f"{prefix}.input_layernorm.weight"] = np.asarray(layer["attn_norm"]["scale"],
                                                             np.float32)
        out[f"{prefix}.post_attention_layernorm.weight"] = np.asarray(
            layer["mlp_norm"]["scale"], np.float32)
    return out


def llama_config(cfg) -> dict:
    """HF ``LlamaConfig`` fields of the model."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": RMS_EPS, "rope_theta": cfg.rope_base, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float32", "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


def tokenizer_record() -> dict:
    tok = ByteTokenizer()
    return {"name": "bytes", "vocab_size": tok.vocab_size,
            "padded_vocab_size": tok.padded_vocab_size, "pad_id": PAD_ID, "bos_id": BOS_ID,
            "eos_id": EOS_ID, "byte_offset": 3, "note": "byte b is id b + 3"}


def llama_forward(tensors: dict[str, np.ndarray], config: dict, ids_T: np.ndarray) -> np.ndarray:
    """Logits [T, V] of one sequence from HF Llama tensors and config alone, in float64 NumPy:
    the computation of HF's ``LlamaForCausalLM`` (rotate_half RoPE, grouped-query causal
    attention, SwiGLU MLP), written independently of ``jaxaccel.model``."""
    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    H, K, E = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    T = len(ids_T)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config["rms_norm_eps"]) * w

    inv_freq = config["rope_theta"] ** (-np.arange(0, E, 2) / E)
    angles = np.arange(T)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))

    def rope(x_HTE):
        half = np.concatenate([-x_HTE[..., E // 2:], x_HTE[..., :E // 2]], -1)
        return x_HTE * cos + half * sin

    x = t["model.embed_tokens.weight"][ids_T]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = rope((h @ t[p + "self_attn.q_proj.weight"].T).reshape(T, H, E).transpose(1, 0, 2))
        k = rope((h @ t[p + "self_attn.k_proj.weight"].T).reshape(T, K, E).transpose(1, 0, 2))
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(T, K, E).transpose(1, 0, 2)
        k, v = np.repeat(k, H // K, 0), np.repeat(v, H // K, 0)
        scores = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(E), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(T, H * E)
        x = x + attn @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def our_logits(cfg, params, ids_T) -> np.ndarray:
    """Our model's float32 logits [T, V] of one sequence (evaluation mode)."""
    T = len(ids_T)
    batch = {"inputs": jnp.asarray(ids_T)[None], "positions": jnp.arange(T)[None],
             "segment_ids": jnp.ones((1, T), jnp.int32)}
    return np.asarray(jax.jit(make_apply(cfg))(params, batch)[0])


def check_out_dir(out_dir: str, overwrite: bool):
    """ConfigError, before any work, for an out_dir that holds files (without ``overwrite``)
    or cannot be written."""
    from jaxaccel.config import check_writable

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"out {out_dir} is a file; pass a folder", field="out")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConfigError(f"out {out_dir} is not empty; pass an empty or new folder, or "
                          f"--overwrite to replace its model files", field="out")
    check_writable("out", out_dir, may_create=True)


def write_json(path: str, value: dict):
    with open(path, "w") as f:
        f.write(json.dumps(value, indent=2) + "\n")


def write_atomically(path: str, write):
    """``write(temporary path)``, then rename it to ``path``."""
    partial = path + ".partial"
    write(partial)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o666 & ~umask)
    os.replace(partial, path)


def export(run_dir: str, out_dir: str, format: str = "auto", *, overwrite: bool = False,
           check_tokens: int = 24) -> Exported:
    """Write the model of ``run_dir``'s latest checkpoint to ``out_dir`` in ``format`` (auto:
    llama when the model has that layout, else native), then check it (module docstring)."""
    from safetensors.numpy import load_file, save_file

    from jaxaccel.generate import load_run

    if format not in FORMATS:
        raise ConfigError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}",
                          field="format")
    check_out_dir(out_dir, overwrite)
    cfg, params, step = load_run(run_dir)
    why = blocker(cfg)
    if format == "llama" and why:
        raise ConfigError(f"the model has no Hugging Face Llama layout: {why}; export with "
                          f"--format native", field="format")
    chosen = format if format != "auto" else ("native" if why else "llama")
    if chosen == "llama":
        tensors, config = llama_tensors(cfg, params), llama_config(cfg)
        config["jaxaccel"] = {"step": step, "tokenizer": tokenizer_record()}
    else:
        tensors = flatten(params)
        config = {"format": "jaxaccel", "step": step, "model": dataclasses.asdict(cfg),
                  "tokenizer": tokenizer_record()}
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, WEIGHTS)
    write_atomically(weights, lambda p: save_file(tensors, p, metadata={"format": chosen}))
    write_atomically(os.path.join(out_dir, "config.json"), lambda p: write_json(p, config))

    # Read back: the tensors bitwise, then the logits of a forward pass from the files alone.
    read = load_file(weights)
    config_read = json.load(open(os.path.join(out_dir, "config.json")))
    wrong = sorted(set(tensors) ^ set(read)) + [
        name for name in tensors if name in read and not np.array_equal(tensors[name],
                                                                      read[name])]
    if wrong:
        raise RuntimeError(f"export check failed: {len(wrong)} tensors of {weights} differ "
                           f"when read back (first: {wrong[0]})")
    ids_T = np.random.default_rng(0).integers(3, min(cfg.vocab_size, 259),
                                              min(check_tokens, cfg.max_seq_len))
    expected = our_logits(cfg, params, ids_T)
    if chosen == "llama":
        got = llama_forward(read, config_read, ids_T)
    else:
        from jaxaccel.model import ModelConfig
        got = our_logits(ModelConfig(**config_read["model"]), unflatten(read, params), ids_T)
    diff = float(np.max(np.abs(got - expected)))
    if not diff <= 1e-4 * max(1.0, float(np.max(np.abs(expected)))):
        raise RuntimeError(f"export check failed: logits from the files in {out_dir} differ "
                           f"from the model's by up to {diff:.3g}")
    return Exported(out_dir=out_dir, format=chosen, step=step, tensors=len(tensors),
                    bytes=os.path.getsize(weights), max_logit_diff=diff)
