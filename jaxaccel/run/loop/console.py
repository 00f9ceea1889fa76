"""What a run shows while it trains: the phases on stdout, progress on stderr (a bar on a
terminal, plain lines off one), and the metrics of each logged window."""

import sys

import jax
import numpy as np


def progress_bar(total_steps: int, first_step: int, enabled: bool):
    """A tqdm bar on a terminal; off one (a batch job, a pipe) plain lines (``LineProgress``)."""
    if not enabled:
        return None
    if not sys.stderr.isatty():
        return LineProgress(total_steps, first_step)
    from tqdm import tqdm
    return tqdm(total=total_steps, initial=first_step, desc="train", unit="step",
                dynamic_ncols=True)


class LineProgress:
    """Progress off a terminal (tqdm's interface): one plain line per logged step on stderr."""

    def __init__(self, total: int, initial: int):
        self.total, self.n = total, initial

    def update(self, steps: int):
        self.n += steps

    def set_postfix(self, *, seconds: float | None = None, **values):
        fields = "  ".join(f"{key} {value}" for key, value in values.items())
        elapsed = f"  elapsed {seconds:.1f} s" if seconds is not None else ""
        self.write(f"step {self.n}/{self.total}  {fields}{elapsed}")

    @staticmethod
    def write(line: str):
        print(line, file=sys.stderr, flush=True)

    def close(self):
        pass


def announce(cfg, line: str, progress=None):
    """A phase of the run as one line on stdout, past a bar (process 0, with ``run.progress``)."""
    if not cfg.run.progress or jax.process_index() != 0:
        return
    if progress is not None and not isinstance(progress, LineProgress):
        progress.write(line, file=sys.stdout)
    else:
        print(line, flush=True)


LAST_ONLY = ("grad_norm", "update_norm", "loss_scale", "skipped_steps", "learning_rate")


def log_window(writer, step, window, totals, seconds, progress, bits_per_nat: float
                ) -> list[tuple[float, float]]:
    """Write the mean metrics of the last steps (``totals``, the run's real tokens and positions,
    and ``seconds`` so far); return their (loss, tokens) per step."""
    # one transfer for what is needed: three scalars a step, the last step's others
    per_step, last = jax.device_get(([(m["loss"], m["real_tokens"], m["padded_tokens"])
                                      for m in window], {k: window[-1][k] for k in LAST_ONLY}))
    losses, tokens, padded = np.array(per_step, dtype=np.float64).reshape(-1, 3).T
    totals["real"] += int(tokens.sum())
    totals["positions"] += int(tokens.sum() + padded.sum())
    tokens_per_s = totals["real"] / max(seconds, 1e-9)
    loss = float(np.sum(losses * tokens) / max(tokens.sum(), 1.0))
    record = {
        "loss": loss, "bpb": loss * bits_per_nat, "grad_norm": float(last["grad_norm"]),
        "update_norm": float(last["update_norm"]), "loss_scale": float(last["loss_scale"]),
        "skipped_steps": int(last["skipped_steps"]),
        "learning_rate": float(last["learning_rate"]), "real_tokens": int(tokens.sum()),
        "padding_efficiency": float(tokens.sum() / max(tokens.sum() + padded.sum(), 1.0)),
        "real_tokens_per_s": tokens_per_s, "train_s": seconds}
    writer.write(step, "train", record)
    if progress is not None:
        progress.update(step - progress.n)
        extra = {"seconds": seconds} if isinstance(progress, LineProgress) else {}
        progress.set_postfix(loss=f"{loss:.3f}", bpb=f"{record['bpb']:.2f}",
                             tok_s=f"{tokens_per_s:,.0f}", **extra)
    return list(zip(losses.tolist(), tokens.tolist()))


def note(cfg, line: str, progress=None):
    """What the run did to its files (records dropped, an unfinished checkpoint removed): one
    line on stdout from process 0, said whatever ``run.progress`` is, so nothing goes silently."""
    if jax.process_index() != 0:
        return
    if progress is not None and not isinstance(progress, LineProgress):
        progress.write(line, file=sys.stdout)
    else:
        print(line, flush=True)
