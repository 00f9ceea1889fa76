"""Export a trained run's model to safetensors and config.json, as a Hugging Face Llama if it fits.

    python -m experiments.export --run-dir runs/R --out exported/R [--format auto|native|llama]

Reads the run's latest checkpoint and rebuilds its model, whatever it is (a GPT preset or the
run's own factory, where the run recorded it or ``--model`` says; LoRA merged into the weights),
and writes ``model.safetensors`` and
``config.json`` into ``--out`` (new or empty; ``--overwrite`` replaces those files):
``LlamaForCausalLM``'s tensor names and config when the model is jaxaccel's GPT in Llama's shape
(SwiGLU, untied head, RMSNorms; N:M masks folded into the weights; no branch gates, adapters or
FP8) and ``--format`` is auto or llama, else (native, any model) every variable of the model's
state under its dotted path, buffers included, with the run's settings as the config
(``jaxaccel.outputs.export``). The run's tokenizer goes beside them as Hugging Face files
(``tokenizer.json``, ``tokenizer_config.json``, for Llama ``generation_config.json``;
``jaxaccel.data.hf_tokenizer``): transformers' ``AutoTokenizer`` gets its BOS, EOS and PAD at the
run's ids, prepends BOS as training did, and encodes and decodes as the run's tokenizer. The
export is then read back: every tensor must equal what was written, a forward pass from the
files alone (for Llama, an independent NumPy Llama; native, the model rebuilt from the config)
must give the model's logits, and the tokenizer.json must encode and decode a probe text as
ours. It prints one line: the layout, tensors, size, the largest logit difference and the
folder. A failed check is one line and exit code 1, the files left for inspection.
"""

import dataclasses
import sys

from experiments.common import command, environment, settings_named, write_json
from jaxaccel.run.config import parse, setting
from jaxaccel.core.errors import ConfigError
from jaxaccel.outputs.export import FORMATS, ExportCheckError, export


@dataclasses.dataclass
class ExportSettings:
    run_dir: str | None = setting(None, "the training run to export (its directory)")
    model: str | None = setting(None, "where the run's own model factory is now, FILE.py:FUNCTION "
                                      "or package.module:FUNCTION, if it moved since the run "
                                      "trained (default: the one the run recorded)")
    out: str | None = setting(None, "folder to write model.safetensors and config.json into "
                                    "(new or empty)")
    format: str = setting("auto", "llama (Hugging Face LlamaForCausalLM layout), native (our "
                                  "variable names, any model) or auto (llama when the model "
                                  "fits it)",
                          choices=FORMATS)
    overwrite: bool = setting(False, "replace model.safetensors, config.json and the tokenizer "
                                     "files in a non-empty --out")
    json: str | None = setting(None, "also write the result as JSON to this path")


@dataclasses.dataclass
class ExportConfig:
    """What to export and where: this experiment trains nothing, so it has only its own
    section."""

    experiment: ExportSettings = dataclasses.field(default_factory=ExportSettings)


def summary(result) -> str:
    """One line: layout, step, tensors, megabytes, the logits check, the folder."""
    return (f"exported step {result.step} as {result.format}: {result.tensors} tensors, "
            f"{result.bytes / 1e6:.2f} MB; logits from the files vs the model: max diff "
            f"{result.max_logit_diff:.2e}; in {result.out_dir}")


@command(ExportConfig)
def main(argv=None) -> int:
    cfg = parse(argv, ExportConfig, description=__doc__.split("\n\n")[0])
    exp = cfg.experiment
    for field, what in (("run_dir", "the training run to export"),
                        ("out", "the folder to write the model into")):
        if not getattr(exp, field):
            raise ConfigError(f"{field} is missing; name {what}", field=f"experiment.{field}")
    try:
        with settings_named():
            result = export(exp.run_dir, exp.out, exp.format, overwrite=exp.overwrite,
                            model=exp.model)
    except ExportCheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary(result))
    write_json(exp.json, [dataclasses.asdict(result)], {**environment(),
                                                       "run_dir": exp.run_dir})
    return 0


if __name__ == "__main__":
    sys.exit(main())
