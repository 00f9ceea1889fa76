"""docs/FLAGS.md is what tools/flag_reference.py writes from the config schema now, and lists
the flags ``--help`` does, in its order."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import flag_reference  # noqa: E402

from jaxaccel.run.config import build_parser  # noqa: E402


def test_the_flag_reference_is_up_to_date():
    try:
        written = Path(flag_reference.PATH).read_text()
    except FileNotFoundError:
        written = None
    if written != flag_reference.render():
        pytest.fail(f"docs/FLAGS.md differs from the config schema; run "
                    f"`{flag_reference.COMMAND}` and commit it", pytrace=False)


def test_the_reference_lists_the_flags_of_help_in_its_order():
    listed = re.findall(r"^\| `(--[a-z0-9-]+)`", flag_reference.render(), re.M)
    parser = build_parser()
    shown = [a.option_strings[0] for a in parser._actions
             if a.option_strings and a.dest not in ("help", "config")]
    assert listed == shown
