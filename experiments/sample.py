"""Generate text from a trained run: one jitted decode loop (a key/value cache where the model
offers one), tokens/s.

    python -m experiments.sample --run-dir runs/R --prompt "def " --max-new-tokens 200 \
        --temperature 0.8 --top-k 40 --num-samples 2

Reads the run's ``config.yaml`` and latest checkpoint and rebuilds its model, whatever it is (a GPT
preset or the run's own factory, found where the run recorded it or, if it moved, where ``--model``
says; LoRA merged into the weights, evaluation mode, float32), encodes the prompt with the run's
own tokenizer (the file the run kept, bytes if it trained on bytes; after BOS, as training
documents start), runs the prompt through the forward pass once (the prefill) and then the new
tokens one at a time in a ``lax.fori_loop`` (``jaxaccel.outputs.generate``): over a key/value cache
when the model offers one (``init_cache`` and ``decode``, as jaxaccel's GPT does), else by running
the model over the prefix so far for each new token (the same tokens, more work). Each sample is
printed up to its first EOS; the timings line gives the compile time, the prefill's prompt tokens/s
and the decode loop's new tokens/s over all samples, timed after ``--warmup`` untimed runs.
``--check-logits`` (on by default) also compares the prefill's logits with the training forward
pass (``model.make_apply``) on the prompt and prints the largest difference.

Temperature 0 is greedy decoding; otherwise top-k sampling at that temperature, seeded by
``--seed``: the same seed, prompt and run give the same text.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import command, environment, settings_named, write_json
from jaxaccel.outputs import generate as gen
from jaxaccel.run.config import parse, setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.model.contract import make_apply, sequence_batch
from jaxaccel.core.report import format_table
from jaxaccel.core.tokenizer import from_run as tokenizer_from_run


@dataclasses.dataclass
class SampleSettings:
    run_dir: str | None = setting(None, "the training run to sample from (its directory)")
    model: str | None = setting(None, "where the run's own model factory is now, FILE.py:FUNCTION "
                                      "or package.module:FUNCTION, if it moved since the run "
                                      "trained (default: the one the run recorded)")
    prompt: str = setting("", "text the samples continue (after BOS; empty: from BOS alone)")
    max_new_tokens: int | None = setting(
        None, "new tokens per sample (default: the rest of the model's context)", at_least=1)
    temperature: float = setting(0.8, "sampling temperature; 0 = greedy (argmax)", at_least=0.0)
    top_k: int = setting(40, "sample among the k most likely tokens", at_least=1)
    num_samples: int = setting(1, "samples drawn together (the batch of the decode loop)",
                               at_least=1, at_most=4096)
    seed: int = setting(0, "seed of the sampling")
    warmup: int = setting(1, "untimed generations before the timed one (the first run of a "
                             "compiled program pays one-time costs)", at_least=0, at_most=100)
    check_logits: bool = setting(True, "compare the prefill's logits with the training "
                                       "forward pass on the prompt")
    json: str | None = setting(None, "also write the samples and timings as JSON to this path")


@dataclasses.dataclass
class SampleConfig:
    """What to sample and how: this experiment trains nothing, so it has only its own section."""

    experiment: SampleSettings = dataclasses.field(default_factory=SampleSettings)


def check_logits(model, prompt_BT, prefill_logits_BTV) -> float:
    """The largest absolute difference between the prefill's logits and the training forward
    pass's (``make_apply``) over the prompt."""
    forward_BTV = jax.jit(make_apply(nnx.graphdef(model)))(nnx.state(model),
                                                           sequence_batch(prompt_BT))
    return float(jnp.max(jnp.abs(forward_BTV - prefill_logits_BTV)))


@command(SampleConfig)
def main(argv=None) -> int:
    cfg = parse(argv, SampleConfig, description=__doc__.split("\n\n")[0])
    with settings_named():
        return sample(cfg.experiment)


def sample(exp: SampleSettings) -> int:
    if not exp.run_dir:
        raise ConfigError("no run to sample from; pass --run-dir of a training run",
                          field="run_dir")
    gen.check_sampling(exp.temperature, exp.top_k)
    gen.read_run_config(exp.run_dir)          # one line for a wrong directory, before loading
    tokenizer = tokenizer_from_run(exp.run_dir)        # the file the run kept, else bytes
    prompt_T = tokenizer.encode(exp.prompt, bos=True, eos=False)
    run_cfg, model, step = gen.load_run(exp.run_dir, exp.model)
    context = run_cfg.model.max_seq_len
    new_tokens = exp.max_new_tokens or context - len(prompt_T)
    gen.check_lengths(context, len(prompt_T), new_tokens)

    prompt_BT = jnp.asarray(np.tile(prompt_T, (exp.num_samples, 1)), jnp.int32)
    key = jax.random.PRNGKey(exp.seed)
    params = nnx.state(model)
    generator = gen.Generator(model, len(prompt_T), new_tokens,
                              temperature=exp.temperature, top_k=exp.top_k,
                              valid_ids=gen.valid_ids_of(tokenizer), context=context)
    generator.compile(params, prompt_BT, key)
    for _ in range(exp.warmup):
        generator.run(params, prompt_BT, key)
    tokens_BN, timings = generator.run(params, prompt_BT, key)
    max_diff = None
    if exp.check_logits:
        logits_BTV, _ = generator.prefill(params, prompt_BT)
        max_diff = check_logits(model, prompt_BT, logits_BTV)

    samples = [tokenizer.decode(gen.cut_at_eos(row, tokenizer.eos_id))
               for row in np.asarray(tokens_BN)]
    for i, text in enumerate(samples):
        print(f"--- sample {i} (step {step} of {exp.run_dir}) ---")
        print(exp.prompt + text)
    row = {"samples": exp.num_samples, "prompt_tokens": len(prompt_T),
           "new_tokens": new_tokens, "compile_s": generator.compile_seconds,
           "prefill_tok_s": timings.prefill_tokens_per_s,
           "decode_tok_s": timings.decode_tokens_per_s, "prompt_logits_max_diff": max_diff}
    print(format_table([row], [
        ("samples", "samples", "d"), ("prompt_tokens", "prompt tok", "d"),
        ("new_tokens", "new tok", "d"), ("compile_s", "compile s", ".2f"),
        ("prefill_tok_s", "prefill tok/s", ",.0f"), ("decode_tok_s", "decode tok/s", ",.0f"),
        ("prompt_logits_max_diff", "logits vs forward", ".2e")]))
    write_json(exp.json, [row], {
        **environment(), "run_dir": exp.run_dir, "step": step, "prompt": exp.prompt,
        "temperature": exp.temperature, "top_k": exp.top_k, "seed": exp.seed,
        "texts": samples})
    return 0


if __name__ == "__main__":
    sys.exit(main())
