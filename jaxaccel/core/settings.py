"""Declaring a setting: its default, help, flag, choices and range, in one place.

Every config section is a dataclass of ``setting(...)`` fields, which ``jaxaccel.run.config`` turns
into flags and overrides and checks against their ``Range``; technique modules declare their own
sections this way (``jaxaccel.techniques.lora.LoRASettings``, ...).
"""

import dataclasses
import math

from jaxaccel.core.errors import ConfigError

# Every int setting fits int32 (steps, sizes and seeds live in int32 arrays) unless its range
# says otherwise; below this, a huge value would wrap around or ask for absurd memory.
INT_LIMIT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: finite, an int within ``INT_LIMIT`` (unless
    ``at_most`` allows more), and within ``at_least`` / ``above`` (inclusive / exclusive lower)
    and ``at_most`` / ``below`` (upper). ``note`` says what a special value means (``0 = off``)."""

    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    note: str = ""

    def describe(self, kind) -> str:
        """``at least 1``, ``a finite number in [0, 1)``, ``an integer in [1, 64]``..."""
        low = self.at_least if self.above is None else self.above
        high = self.at_most if self.below is None else self.below
        if low is None and high is None:
            return "a finite number"
        if low is not None and high is not None:
            interval = (f"{'[' if self.above is None else '('}{_number(low)}, "
                        f"{_number(high)}{']' if self.below is None else ')'}")
            return f"an integer in {interval}" if kind is int else f"in {interval}"
        if low is None:
            return f"a finite number {'<=' if self.below is None else '<'} {_number(high)}"
        if kind is int:
            return f"{'at least' if self.above is None else 'more than'} {_number(low)}"
        return f"a finite number {'>=' if self.above is None else '>'} {_number(low)}"

    def contains(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        high = self.at_most if self.at_most is not None else (
            INT_LIMIT if isinstance(value, int) and self.below is None else None)
        return not ((self.at_least is not None and value < self.at_least)
                    or (self.above is not None and value <= self.above)
                    or (high is not None and value > high)
                    or (self.below is not None and value >= self.below))

    def check(self, path: str, value):
        if not self.contains(value):
            name = path.rpartition(".")[2]
            note = f" ({self.note})" if self.note else ""
            if isinstance(value, int) and value > INT_LIMIT and self.at_most is None:
                raise ConfigError(f"{name} must be at most {INT_LIMIT} (an int32), got {value}",
                                  field=path)
            raise ConfigError(f"{name} must be {self.describe(type(value))}{note}, got {value}",
                              field=path)


def _number(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


INT_RANGE, FLOAT_RANGE = Range(at_least=0), Range()     # the ranges of a field that names none


def setting(default, help_text: str, *, flag: str | None = None, choices=None,
            at_least=None, above=None, at_most=None, below=None, note: str = ""):
    """A config field with its help text; ``flag`` when its flag is not ``--<field name>``, and
    a numeric field's ``Range`` (without bounds: an int >= 0, a float finite)."""
    metadata = {"help": help_text, "flag": flag, "choices": choices,
                "range": Range(at_least, above, at_most, below, note)}
    return dataclasses.field(default=default, metadata=metadata)


