"""Plain-text tables and bar charts for the experiment modules."""

import os


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; ``columns`` are (key, header, format spec), e.g. ("speedup", "x", ".2f")."""
    def cell(row, key, spec):
        value = row.get(key)
        if value is None:
            return "n/a"
        return format(value, spec) if spec else str(value)

    body = [[cell(r, key, spec) for key, _, spec in columns] for r in rows]
    headers = [header for _, header, _ in columns]
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(line, widths)) + " |" for line in body]
    return "\n".join(lines)


def bar_chart(path: str, labels: list[str], panels: list[tuple[str, list[float]]], title: str):
    """One bar panel per (y label, values), side by side, written as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (ylabel, values) in zip(axes if len(panels) > 1 else [axes], panels):
        bars = ax.bar(labels, values, color="#4c72b0")
        ax.bar_label(bars, fmt="%.4g", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
