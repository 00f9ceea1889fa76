"""Plain-text tables, bar charts and strict JSON for the experiment modules."""

import json
import math
import os


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; ``columns`` are (key, header, format spec), e.g. ("speedup", "x",
    ".2f")."""
    def cell(row, key, spec):
        value = row.get(key)
        if value is None:
            return "n/a"
        return format(value, spec) if spec else str(value)

    body = [[cell(r, key, spec) for key, _, spec in columns] for r in rows]
    for r, line in zip(rows, body):     # a run whose loss became NaN/inf: not a result
        if r.get("diverged_at_step") is not None and line:
            line[0] += f" (DIVERGED at step {r['diverged_at_step']})"
    headers = [header for _, header, _ in columns]
    widths = [max([len(h), *(len(line[i]) for line in body)]) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(line, widths)) + " |" for line in body]
    return "\n".join(lines)


def bar_chart(path: str, labels: list[str], panels: list[tuple[str, list[float]]], title: str):
    """One bar panel per (y label, values), side by side, written as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    many = len(labels) > 6   # long label lists get wider panels and slanted labels
    width = max(4.2, 0.45 * len(labels)) if many else 4.2
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.6 if many else 3.8))
    for ax, (ylabel, values) in zip(axes if len(panels) > 1 else [axes], panels):
        bars = ax.bar(labels, values, color="#4c72b0")
        ax.bar_label(bars, fmt="%.4g", fontsize=7 if many else 8,
                     rotation=90 if many else 0, padding=2)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        if many:
            ax.tick_params(axis="x", labelrotation=60)
            for label in ax.get_xticklabels():
                label.set_horizontalalignment("right")
            ax.margins(y=0.18)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finite_json(value):
    """``value`` with every NaN or infinite float replaced by None: JSON has no NaN, and bare
    ``NaN`` / ``Infinity`` break strict readers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def dump_json(path: str, value):
    """``value`` as strict JSON (non-finite floats as null, ``finite_json``;
    ``allow_nan=False`` guards the rest) to ``path``."""
    text = json.dumps(finite_json(value), indent=2, allow_nan=False)
    with open(path, "w") as f:
        f.write(text + "\n")
