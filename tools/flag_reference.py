"""docs/FLAGS.md: every flag of ``python -m experiments.train``, written from the config schema.

    python tools/flag_reference.py        # after changing a setting: rewrites docs/FLAGS.md

Each row comes from a field's ``setting(...)`` (``jaxaccel.run.config.flags``, which ``--help``
is built from too): its flag, field, type, range or choices, default and help text, by section
in ``--help``'s order. tests/test_flag_reference.py fails while the file differs from this.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)        # this checkout's jaxaccel, whatever is installed

from jaxaccel.run.config import CONFIG_HELP, OVERRIDES_HELP, Flag, flags  # noqa: E402

COMMAND = "python tools/flag_reference.py"
PATH = os.path.join(ROOT, "docs", "FLAGS.md")


def _text(text: str) -> str:
    """Help text for a table cell: the characters markdown would read as markup escaped."""
    for c in "\\`*<|$~":
        text = text.replace(c, "\\" + c)
    return text


def _code(value) -> str:
    return f"`{value}`"


def _flag(f: Flag) -> str:
    if f.kinds[0] is bool:
        return f"{_code(f.flag)}, {_code('--no-' + f.flag[2:])}"
    return _code(f.flag)


def _type(f: Flag) -> str:
    """``int, at least 1``, ``float, in [0, 1)``, ``bool``, ``one of `a`, `b```, ``int or
    `auto`, in [1, 64]``: the field's type and its range (``--help``'s words, shortened)."""
    kinds = f.kinds
    words = ", ".join(_code(c) for c in f.choices or ())
    accepts = f.accepts.replace("an integer in ", "in ").replace("a finite number ", "")
    accepts = f", {accepts.replace('a finite number', 'finite')}" if accepts else ""
    if str in kinds and len(kinds) > 1:                 # a number, or one of the words
        number = next(k for k in kinds if k is not str)
        return f"{number.__name__} or {words}{accepts}"
    if f.choices:
        return f"one of {words}"
    return kinds[0].__name__ + accepts


def render() -> str:
    """The text of docs/FLAGS.md."""
    every = flags()
    lines = [
        f"Generated from the config schema by `{COMMAND}`; edit the settings' help texts "
        f"(`setting(...)` in jaxaccel/), not this file.",
        "",
        "# Flags of `python -m experiments.train`",
        "",
        f"Every field of a run's config (`jaxaccel.run.config.TrainConfig`), {len(every)} flags by "
        "section, in the order `--help` lists them. A flag sets the field named beside it, as "
        "does an override `section.field=value` or a `--config` file; [TRAINING.md](TRAINING.md) "
        "explains how they work together. Each experiment (`python -m experiments.NAME --help`) "
        "takes these flags, less the fields it sets per row, and adds an `experiment` section "
        "of its own.",
        "",
        f"- `--config FILE.yaml`: {_text(CONFIG_HELP)}",
        f"- `section.field=value` (any number): {_text(OVERRIDES_HELP)}",
    ]
    section = None
    for f in every:
        if f.section != section:
            section = f.section
            lines += ["", f"## {section}", "",
                      "| Flag | Field | Type | Default | Meaning |", "|---|---|---|---|---|"]
        lines.append(f"| {_flag(f)} | {_code(f.path)} | {_type(f)} | {_code(f.default)} | "
                     f"{_text(f.help)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    text = render()
    with open(PATH, "w") as out:
        out.write(text)
    print(f"wrote {os.path.relpath(PATH, ROOT)}: {text.count(chr(10))} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
