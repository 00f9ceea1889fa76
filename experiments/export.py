"""Export a trained run's model to safetensors and a config file, Hugging Face Llama's layout when it fits.

    python -m experiments.export --run-dir runs/R --out exported/R [--format auto|native|llama]

Reads the run's latest checkpoint (LoRA merged into the weights) and writes ``model.safetensors``
and ``config.json`` into ``--out``: the Llama layout (``LlamaForCausalLM``'s tensor names and
config) when the model is a Llama (SwiGLU, untied head, norms, no gates, adapters, FP8 or N:M
masks) and ``--format`` is auto or llama; else every parameter under its own name
(``jaxaccel.export``). The export is then read back: every tensor must equal what was written,
and a forward pass from the files alone (for Llama, an independent NumPy Llama) must give the
model's logits; the table shows the largest logit difference.
"""

import dataclasses
import sys

from experiments.common import command, environment, write_json
from jaxaccel.config import parse, setting
from jaxaccel.errors import ConfigError
from jaxaccel.export import FORMATS, export
from jaxaccel.report import format_table


@dataclasses.dataclass
class ExportSettings:
    run_dir: str | None = setting(None, "the training run to export (its directory)")
    out: str | None = setting(None, "folder to write model.safetensors and config.json into "
                                    "(new or empty)")
    format: str = setting("auto", "llama (Hugging Face LlamaForCausalLM layout), native (our "
                                  "parameter names) or auto (llama when the model fits it)",
                          choices=FORMATS)
    overwrite: bool = setting(False, "replace the model files of a non-empty --out")
    json: str | None = setting(None, "also write the result as JSON to this path")


@dataclasses.dataclass
class ExportConfig:
    """What to export and where: this experiment trains nothing, so it has only its own
    section."""

    experiment: ExportSettings = dataclasses.field(default_factory=ExportSettings)


@command(ExportConfig)
def main(argv=None) -> int:
    cfg = parse(argv, ExportConfig, description=__doc__.split("\n\n")[0])
    exp = cfg.experiment
    for field in ("run_dir", "out"):
        if not getattr(exp, field):
            raise ConfigError(f"{field} is missing; pass --{field.replace('_', '-')}",
                              field=f"experiment.{field}")
    from jaxaccel.generate import read_run_config
    try:
        read_run_config(exp.run_dir)
        result = export(exp.run_dir, exp.out, exp.format, overwrite=exp.overwrite)
    except ConfigError as e:
        if e.field and "." not in e.field:
            raise ConfigError(str(e), field=f"experiment.{e.field}") from None
        raise
    row = dataclasses.asdict(result)
    print(format_table([row], [
        ("format", "format", ""), ("step", "step", "d"), ("tensors", "tensors", "d"),
        ("bytes", "bytes", ","), ("max_logit_diff", "logits read back vs model", ".2e"),
        ("out_dir", "out", "")]))
    write_json(exp.json, [row], {**environment(), "run_dir": exp.run_dir})
    return 0


if __name__ == "__main__":
    sys.exit(main())
