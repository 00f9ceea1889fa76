"""Export a trained run's model to safetensors with a config file, checked by reading it back.

``export(run_dir, out_dir, format)`` writes one of two layouts, with the run's tokenizer beside
them as Hugging Face files (``jaxaccel.data.hf_tokenizer``: ``tokenizer.json`` and
``tokenizer_config.json``; a SentencePiece run's ``tokenizer.model`` too):

- ``native``, for any model: every variable of its state (LoRA merged where exact, float32,
  FP8 histories and N:M masks included) under its dotted path, and ``config.json``: the run's
  settings (``load_native`` rebuilds the model from them), the step and the tokenizer.
- ``llama``, for jaxaccel's GPT when its evaluation forward is Llama's (``blocker`` says why not):
  HF ``LlamaForCausalLM`` tensors (N:M masks folded in) with safetensors metadata ``format: pt``,
  as ``transformers`` requires, its config and ``generation_config.json`` (the special ids; the
  padded vocabulary's tail suppressed, as ``experiments.sample`` never samples it). Our RoPE
  rotates the halves of each head's features like HF's ``rotate_half``, so q/k need no
  permutation.

Files are written under temporary names and renamed, then read back: every tensor must equal
what was meant bitwise, and the logits of a forward pass from the files alone (``llama_forward``,
an independent float64 NumPy Llama, or ``load_native``) our model's to ``LOGIT_TOLERANCE`` times
max(1, largest logit), and the ``tokenizer.json`` (``tokenizers``) must encode, frame and decode
a probe text as the run's tokenizer does; else ``ExportCheckError``, the files left in place.
"""

import dataclasses
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccel.data import hf_tokenizer
from jaxaccel.core.errors import ConfigError
from jaxaccel.core.report import dump_json
from jaxaccel.core.sections import absolute_name
from jaxaccel.core.tokenizer import BYTE_OFFSET, RUN_FILES, from_run as tokenizer_from_run

FORMATS = ("auto", "native", "llama")
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
RMS_EPS = 1e-6              # flax nnx.RMSNorm's default epsilon, which every norm of ours uses
LOGIT_TOLERANCE = 1e-4      # of max(1, largest |logit|)
CHECK_TOKENS = 24           # length of the read-back check's sequence (at most max_seq_len)


@dataclasses.dataclass
class Exported:
    """What ``export`` wrote (``format``: the layout chosen) and what its check measured."""

    out_dir: str
    format: str
    step: int
    tensors: int
    bytes: int
    max_logit_diff: float


class ExportCheckError(RuntimeError):
    """The read-back check found the files differ from the model; the files stay in place."""


def blocker(cfg) -> tuple[str, str] | None:
    """(why, fix): the first setting of TrainConfig ``cfg`` barring HF's Llama layout, or None."""
    from jaxaccel.model import gpt, contract as model_lib
    if not model_lib.is_preset(cfg.model.name):
        return (f"the model is {cfg.model.name}, not jaxaccel's GPT", "a --model preset")
    shape = gpt.preset(cfg.model.name, **{k: v for k, v in dataclasses.asdict(cfg.gpt).items()
                                         if v is not None})
    from jaxaccel.techniques import registry
    reasons = [
        (shape.mlp != "swiglu", f"mlp={shape.mlp} (Llama's MLP is SwiGLU)", "mlp=swiglu"),
        (shape.tie_embeddings, "tie_embeddings=True (Llama's output head is untied)",
         "tie_embeddings=False"),
    ]
    found = [(why, fix) for blocked, why, fix in reasons if blocked]
    return next(iter(found + registry.llama_blockers(cfg)), None)


def flatten(state) -> dict[str, np.ndarray]:
    """The variables of a model's state by dotted path, as NumPy arrays."""
    from jaxaccel.core.sharding import path_name
    return {path_name(path).replace("/", "."): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def plain_gpt(model):
    """jaxaccel's GPT as plain Llama: N:M masks and then LoRA folded in, the stack unscanned,
    techniques off."""
    from jaxaccel.model import nn
    from jaxaccel.techniques import surgery
    surgery.unwrap(model)
    for _, stack in nn.stacks(model):
        stack.unscan()
    return model


LLAMA_NAMES = {("attn", "wq"): "self_attn.q_proj", ("attn", "wk"): "self_attn.k_proj",
               ("attn", "wv"): "self_attn.v_proj", ("attn", "wo"): "self_attn.o_proj",
               ("mlp", "w_gate"): "mlp.gate_proj", ("mlp", "w_in"): "mlp.up_proj",
               ("mlp", "w_out"): "mlp.down_proj"}


def llama_tensors(model) -> dict[str, np.ndarray]:
    """HF Llama tensors (float32) of a ``plain_gpt``; kernels [in, out] become weights [out, in]."""
    def vector(x):
        return np.asarray(x[...], np.float32)

    def torch_weight(linear):
        return np.ascontiguousarray(vector(linear.kernel).T)

    out = {"model.embed_tokens.weight": vector(model.embed.embedding),
           "model.norm.weight": vector(model.final_norm.scale),
           "lm_head.weight": torch_weight(model.head)}
    for i, layer in enumerate(model.blocks.layers):
        prefix = f"model.layers.{i}."
        for (part, ours), theirs in LLAMA_NAMES.items():
            out[prefix + theirs + ".weight"] = torch_weight(getattr(getattr(layer, part), ours))
        out[prefix + "input_layernorm.weight"] = vector(layer.attn_norm.scale)
        out[prefix + "post_attention_layernorm.weight"] = vector(layer.mlp_norm.scale)
    return out


def tokenizer_record(tok) -> dict:
    """The model's tokenizer for config.json: bytes, or the run's file (copied beside the weights
    for SentencePiece; a tokenizer.json run's is rewritten for transformers, ``fingerprint``
    being the run's)."""
    record = {"name": type(tok).__name__, "vocab_size": tok.vocab_size,
              "padded_vocab_size": tok.padded_vocab_size, "pad_token_id": tok.pad_id,
              "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    if tok.kind == "bytes":
        return {**record, "name": "jaxaccel.core.tokenizer.ByteTokenizer",
                "byte_offset": BYTE_OFFSET}
    return {**record, "file": RUN_FILES[tok.kind], "fingerprint": tok.fingerprint}


def llama_config(model, step: int, tok) -> dict:
    """HF ``LlamaConfig`` fields of the GPT, plus our step and tokenizer under ``jaxaccel``."""
    cfg = model.cfg
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": len(model.blocks), "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": RMS_EPS, "rope_theta": cfg.rope_base, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float32", "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id, "jaxaccel": {"step": step, "tokenizer": tokenizer_record(tok)},
    }


def load_native(tensors: dict[str, np.ndarray], config: dict):
    """The model of a native export, rebuilt from its config and tensors, in evaluation mode."""
    from flax import nnx

    from jaxaccel.techniques import registry as techniques
    from jaxaccel.run.config import TrainConfig, build, flatten as flat_config
    cfg = build(TrainConfig, flat_config(config["train_config"]))
    graphdef, abstract_state = nnx.split(techniques.abstract(cfg))
    names = flatten(jax.tree.map(lambda x: np.zeros((), np.int8), abstract_state))
    treedef = jax.tree_util.tree_structure(abstract_state)
    state = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(tensors[name]) for name in names])
    model = nnx.merge(graphdef, state)
    model.eval()
    return model


def llama_forward(tensors: dict[str, np.ndarray], config: dict, ids_T: np.ndarray) -> np.ndarray:
    """Logits [T, V] of one sequence from HF Llama tensors and config alone, in float64 NumPy, as
    HF's ``LlamaForCausalLM`` computes them, written independently of
    ``jaxaccel.model.contract``."""
    w = {k: v.astype(np.float64) for k, v in tensors.items()}
    H, K, E = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    T = len(ids_T)

    def rms_norm(x_TD, weight_D):
        variance_T1 = np.mean(x_TD * x_TD, axis=-1, keepdims=True)
        return weight_D * (x_TD / np.sqrt(variance_T1 + config["rms_norm_eps"]))

    inv_freq_R = 1.0 / config["rope_theta"] ** (np.arange(0, E, 2) / E)
    freqs_TE = np.tile(np.arange(T)[:, None] * inv_freq_R, 2)
    cos_TE, sin_TE = np.cos(freqs_TE), np.sin(freqs_TE)

    def rope(x_HTE):
        rotated_HTE = np.concatenate([-x_HTE[..., E // 2:], x_HTE[..., :E // 2]], axis=-1)
        return x_HTE * cos_TE + rotated_HTE * sin_TE

    def heads(x_TF, n):
        return x_TF.reshape(T, n, E).transpose(1, 0, 2)

    def linear(x, name):
        return x @ w[name].T

    x_TD = w["model.embed_tokens.weight"][ids_T]
    future_TT = np.triu(np.ones((T, T), bool), k=1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h_TD = rms_norm(x_TD, w[p + "input_layernorm.weight"])
        q_HTE = rope(heads(linear(h_TD, p + "self_attn.q_proj.weight"), H))
        k_KTE = rope(heads(linear(h_TD, p + "self_attn.k_proj.weight"), K))
        v_KTE = heads(linear(h_TD, p + "self_attn.v_proj.weight"), K)
        k_HTE, v_HTE = np.repeat(k_KTE, H // K, axis=0), np.repeat(v_KTE, H // K, axis=0)
        scores_HTT = q_HTE @ k_HTE.transpose(0, 2, 1) / np.sqrt(E)
        scores_HTT = np.where(future_TT, -np.inf, scores_HTT)
        probs_HTT = np.exp(scores_HTT - scores_HTT.max(axis=-1, keepdims=True))
        probs_HTT /= probs_HTT.sum(axis=-1, keepdims=True)
        attn_TF = (probs_HTT @ v_HTE).transpose(1, 0, 2).reshape(T, H * E)
        x_TD = x_TD + linear(attn_TF, p + "self_attn.o_proj.weight")
        h_TD = rms_norm(x_TD, w[p + "post_attention_layernorm.weight"])
        gate_TF = linear(h_TD, p + "mlp.gate_proj.weight")
        up_TF = linear(h_TD, p + "mlp.up_proj.weight")
        x_TD = x_TD + linear(gate_TF / (1.0 + np.exp(-gate_TF)) * up_TF,
                             p + "mlp.down_proj.weight")
    return linear(rms_norm(x_TD, w["model.norm.weight"]), "lm_head.weight")


def our_logits(model, ids_T) -> np.ndarray:
    """The model's float32 logits [T, V] of one sequence, attention as XLA einsums, on one device
    as the files are read (a sharded sum's other order moves FP8's roundings)."""
    from flax import nnx

    from jaxaccel.model.attention import as_xla
    from jaxaccel.model.contract import make_apply, sequence_batch

    graphdef, state = nnx.split(model)
    state = jax.device_put(state, jax.devices()[0])
    batch = sequence_batch(jnp.asarray(ids_T, jnp.int32)[None])
    with as_xla():
        logits = jax.jit(make_apply(graphdef))(state, batch)
    return np.asarray(logits[0], np.float32)


def check_out_dir(out_dir: str, overwrite: bool):
    """One ConfigError line for an out_dir that is a file, non-empty (without ``overwrite``) or
    cannot be created or written."""
    from jaxaccel.run.config import check_writable

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"out {out_dir} is a file; pass a folder", field="out")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConfigError(f"out {out_dir} is not empty; pass a new or empty folder, or set "
                          f"overwrite to replace its {WEIGHTS}, {CONFIG} and tokenizer files",
                          field="out")
    check_writable("out", out_dir, may_create=True)


def write_files(out_dir: str, tensors: dict[str, np.ndarray], config: dict, metadata: dict,
                others: dict[str, str | bytes] | None = None):
    """``WEIGHTS``, ``CONFIG`` and ``others`` (contents by file name) in ``out_dir``, written under
    temporary names, synced, renamed."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    umask = os.umask(0)             # read by setting it and back
    os.umask(umask)
    writers = {WEIGHTS: lambda path: save_file(tensors, path, metadata=metadata),
               CONFIG: lambda path: dump_json(path, config)}
    for name, content in (others or {}).items():
        writers[name] = lambda path, content=content: _write(path, content)
    done = {}
    try:
        for name, write in writers.items():
            fd, done[name] = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=out_dir)
            os.close(fd)
            write(done[name])
            with open(done[name], "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(done[name], 0o666 & ~umask)
    except BaseException:
        for path in done.values():
            if os.path.exists(path):
                os.remove(path)
        raise
    for name, path in done.items():
        os.replace(path, os.path.join(out_dir, name))


def _write(path: str, content: str | bytes):
    with open(path, "wb") as f:
        f.write(content.encode("utf-8") if isinstance(content, str) else content)


def tokenizer_files(tok, context: int, model_vocab: int | None) -> dict[str, str | bytes]:
    """The tokenizer files of an export by name (``jaxaccel.data.hf_tokenizer``), with a
    SentencePiece
    run's ``.model``."""
    out = hf_tokenizer.files(tok, context, model_vocab)
    if tok.kind == "sentencepiece":
        with open(tok.path, "rb") as f:
            out[RUN_FILES[tok.kind]] = f.read()
    return out


def check_tokenizer(out_dir: str, tok):
    """ExportCheckError unless the exported tokenizer.json encodes, frames and decodes
    ``hf_tokenizer.PROBE`` as ``tok``."""
    with open(os.path.join(out_dir, hf_tokenizer.TOKENIZER_CONFIG)) as f:
        tokenizer_config = json.load(f)
    hf = hf_tokenizer.load(os.path.join(out_dir, hf_tokenizer.TOKENIZER_JSON), tokenizer_config)
    wrong = hf_tokenizer.mismatch(tok, hf)
    if wrong:
        raise ExportCheckError(f"export check failed: {out_dir}/{hf_tokenizer.TOKENIZER_JSON} "
                               f"differs from the run's tokenizer: {wrong}; the files are left "
                               f"for inspection")


def read_back(out_dir: str, tensors: dict[str, np.ndarray], config: dict):
    """The files of ``out_dir`` as (tensors, config); ExportCheckError unless bitwise as meant."""
    from safetensors.numpy import load_file

    read = load_file(os.path.join(out_dir, WEIGHTS))
    with open(os.path.join(out_dir, CONFIG)) as f:
        config_read = json.load(f)
    wrong = sorted(set(tensors) ^ set(read)) + [
        name for name in tensors if name in read
        and not (read[name].dtype == tensors[name].dtype
                 and np.array_equal(read[name], tensors[name]))]
    if wrong:
        raise ExportCheckError(f"export check failed: {len(wrong)} tensors of {out_dir}/{WEIGHTS} "
                               f"differ from what was written (first: {wrong[0]}); the files "
                               f"are left for inspection")
    if config_read != config:
        raise ExportCheckError(f"export check failed: {out_dir}/{CONFIG} differs from what "
                               f"was written")
    return read, config_read


def check_logits(model, context: int, forward, read, config_read, out_dir, tok) -> float:
    """The largest difference between our model's logits and ``forward``'s from the files;
    ExportCheckError beyond the tolerance."""
    from flax import nnx

    from jaxaccel.model.contract import make_apply, sequence_batch
    graphdef, state = nnx.split(model)
    shape_batch = sequence_batch(jax.ShapeDtypeStruct((1, min(4, context)), jnp.int32))
    vocab = jax.eval_shape(make_apply(graphdef), state, shape_batch).shape[-1]
    real_ids = min(vocab, tok.vocab_size)
    ids_T = np.random.default_rng(0).integers(BYTE_OFFSET, real_ids, min(CHECK_TOKENS, context))
    expected_TV = our_logits(model, ids_T)
    got_TV = forward(read, config_read, ids_T)
    diff = float(np.max(np.abs(got_TV - expected_TV)))
    limit = LOGIT_TOLERANCE * max(1.0, float(np.max(np.abs(expected_TV))))
    if not diff <= limit:
        raise ExportCheckError(f"export check failed: logits from the files in {out_dir} differ "
                               f"from the model's by up to {diff:.3g} (tolerance {limit:.3g}); "
                               f"the files are left for inspection")
    return diff


def export(run_dir: str, out_dir: str, format: str = "auto", *,
           overwrite: bool = False, model: str | None = None) -> Exported:
    """Write the model of ``run_dir``'s latest checkpoint to ``out_dir`` in ``format`` (auto:
    llama if the model has that layout, else native) and check it by reading it back.
    ``model``: the run's own factory where it is now, if it moved since the run trained.
    ConfigError, before anything is written, for a bad format or run directory, a non-empty
    out_dir (without ``overwrite``) or an unwritable one, and llama for a model without it."""
    from flax import nnx

    from jaxaccel.techniques import registry
    from jaxaccel.run.config import override, to_dict
    from jaxaccel.outputs.generate import load_run, read_run_config

    if format not in FORMATS:
        raise ConfigError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}",
                          field="format")
    trained = read_run_config(run_dir)
    blocked = format == "llama" and blocker(trained)
    if blocked:
        raise ConfigError(f"the model has no Hugging Face Llama layout: {blocked[0]}; export in "
                          f"format native instead, or retrain with {blocked[1]}", field="format")
    check_out_dir(out_dir, overwrite)
    cfg, model, step = load_run(run_dir, model)
    tok = tokenizer_from_run(run_dir)
    chosen = format if format != "auto" else ("native" if blocker(cfg) else "llama")
    if chosen == "llama":
        model = plain_gpt(model)
        tensors, config = llama_tensors(model), llama_config(model, step, tok)
        metadata, forward = {"format": "pt"}, llama_forward
    else:
        tensors = flatten(nnx.state(model))
        # The exported model's settings: those of the techniques merged into its weights
        # (``load_run``; LoRA's, but where FP8 or N:M masks change the product)
        settings = override(cfg, {**registry.exported_settings(cfg, model),
                                  "run.init_from": None,
                                  "model.name": absolute_name(cfg.model.name)})
        config = {"format": "jaxaccel", "train_config": to_dict(settings), "step": step,
                  "tokenizer": tokenizer_record(tok)}
        metadata = {"format": "jaxaccel"}
        forward = lambda t, c, ids_T: our_logits(load_native(t, c), ids_T)    # noqa: E731
    model_vocab = config["vocab_size"] if chosen == "llama" else None
    write_files(out_dir, tensors, config, metadata,
                tokenizer_files(tok, cfg.model.max_seq_len, model_vocab))
    read, config_read = read_back(out_dir, tensors, config)
    check_tokenizer(out_dir, tok)
    diff = check_logits(model, cfg.model.max_seq_len, forward, read, config_read, out_dir, tok)
    return Exported(out_dir=out_dir, format=chosen, step=step, tensors=len(tensors),
                    bytes=os.path.getsize(os.path.join(out_dir, WEIGHTS)), max_logit_diff=diff)


def export_merged(run_dir: str, out_dir: str) -> str:
    """Write the LoRA run ``run_dir``'s model, its LoRA merged, as a run directory ``out_dir``
    that reads like any: its config without LoRA, a checkpoint with a fresh optimizer state."""
    from flax import nnx
    from jaxaccel.model import nn
    from jaxaccel.run.checkpoint import Checkpointer
    from jaxaccel.run.config import override, write_config
    from jaxaccel.run.loop.record import read_trained_run
    from jaxaccel.step.optim import build_optimizer
    from jaxaccel.step.state import init_state
    from jaxaccel.techniques import lora, surgery
    trained_cfg, model, step = read_trained_run(run_dir)
    lora.merge(model)
    if surgery.wrappers(model, lora.LoRA):
        raise ConfigError(f"the LoRA of {run_dir} sits under FP8 or N:M sparsity, which change "
                          f"its layers' product: merged, it would not compute what trained; "
                          f"use the run itself", field="run_dir")
    cfg = override(trained_cfg, {"lora.rank": 0})
    optimizer, _, _ = build_optimizer(cfg.optimizer, batch_rows=cfg.batch_rows(),
                                      total_steps=cfg.run.steps)
    variables = nnx.state(model)
    state = init_state(variables, optimizer, cfg.run.seed, cfg.make_loss_scale(), cfg.policy(),
                       nn.trainable(variables))
    os.makedirs(out_dir, exist_ok=True)
    write_config(cfg, out_dir)
    checkpointer = Checkpointer(os.path.join(out_dir, "checkpoints"))
    try:
        checkpointer.save(step, state, loader_position={}, config={})
    finally:
        checkpointer.close()
    return out_dir
