"""The main job: train a model on the embedded corpus and print what the run achieved.

    python -m experiments.train                 # tiny model, stdlib corpus, a few CPU minutes
    python -m experiments.train --model examples/tiny_lm.py:make --model-args 'width: 64'
    python -m experiments.train --resume        # continue the latest run from its checkpoint
    python -m experiments.train --config run.yaml optimizer.name=lion   # a file, an override
    python -m experiments.train --help          # every setting, by section

The model is a preset of jaxaccel's GPT (``--model tiny|small|medium|gpt2``) or any Flax NNX
model of one's own, ``--model FILE.py:FUNCTION`` (README, "Your own model"). Writes config.yaml
(the resolved settings: ``--config`` repeats the run), command.txt, metrics.jsonl,
checkpoints/ and loss.png into the run directory. Bits per byte count every target token: each
byte, and the end-of-document token once per document.

This module imports jax (with ``jaxaccel.run.loop``) only when it trains, so that ``--help`` is
fast.
"""

import dataclasses
import sys
from typing import TYPE_CHECKING

from experiments.common import DIVERGED, command, dump_json, exit_code, train_until_stopped
from jaxaccel.run.config import parse

if TYPE_CHECKING:       # for the annotations only: jaxaccel.run.loop imports jax
    from jaxaccel.run.loop import RunSummary


def format_summary(s: "RunSummary") -> str:
    """The run's summary as aligned lines for the terminal."""
    mfu = f"{s.mfu:.1%}" if s.mfu is not None else "n/a (device peak unknown)"
    rows = [
        ("run dir", s.run_dir),
        ("device", f"{s.device}, jax {s.jax_version}"),
        ("steps", f"{s.steps} ({s.steps_this_run} this run)"
                  + (f"; the run's length changed from {s.extended_from_steps} steps on this "
                     f"resume (the schedule follows the new one)"
                     if s.extended_from_steps else "")),
        ("model", f"{s.model}, {s.params:,} parameters" + _techniques(s)),
        ("optimizer", f"{s.optimizer}, peak lr {s.learning_rate:.3g}, weight decay "
                      f"{s.weight_decay:.3g}, state {s.optimizer_state_bytes:,} bytes"),
        ("precision", f"{s.precision}" + _fp8(s.techniques.get("fp8"))
                      + f", loss scale {s.loss_scale:g}, {s.skipped_steps} skipped steps"),
        ("remat", _remat_line(s)),
        ("sharding", f"{s.sharding} over mesh {_mesh(s.mesh)} ({s.mesh_axis_types} axes), "
                     f"{s.process_count} process(es); parameters + optimizer state "
                     f"{s.param_opt_bytes_per_device:,} bytes per device"
                     + _pipeline(s)),
        *([("real tokens/s", f"{s.real_tokens_per_s:,.0f}"),
           ("model FLOP/s", f"{s.achieved_flops_per_s / 1e9:,.1f} GFLOP/s (MFU {mfu})"),
           ("padding efficiency", f"{s.padding_efficiency:.1%}"),
           ("train bits/byte", f"{s.train_bpb:.3f} (last tenth of this run's steps)")]
          if s.steps_this_run else
          [("training", "no steps ran: the run had reached its last step (the evaluation "
                        "below is of its final state)")]),
        ("val bits/byte", f"{s.val_bpb:.3f} over {s.val_tokens:,} tokens"),
        *([("target", _target(s.target))] if s.target else []),
        ("unigram bits/byte", f"{s.unigram_bpb:.3f} (entropy of the train split's token "
                              "frequencies, per byte of its text)"),
        ("compiles", f"{s.compiles} train step ({s.compile_s:.1f} s), "
                     f"{s.eval_compiles} eval step"),
        ("documents", f"{s.split_documents:,} split into chunks, "
                      f"{s.empty_documents_skipped:,} empty skipped"
                      + "".join(f", {n:,} {reason} skipped"
                                for reason, n in (s.inputs_skipped or {}).items())),
        ("wall time", f"{s.wall_s:.1f} s ({s.train_s:.1f} s training)"),
    ]
    if s.startup_s:
        rows.insert(len(rows) - 1, ("start-up", _startup_line(s.startup_s)))
    if s.step_alone:
        alone = s.step_alone
        rows.insert(len(rows) - 1, ("step alone", (
            f"{alone['real_tokens_per_s']:,.0f} real tokens/s over the last {alone['steps']} "
            f"batches (no loading, logging or waits between steps); the loop ran at "
            f"{alone['loop_share']:.1%} of it")))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _startup_line(startup: dict) -> str:
    """The start-up phases' seconds, and the time to the first step's result."""
    phases = ", ".join(f"{name} {startup[key]:.1f} s" for key, name in (
        ("before_set_up", "mesh"), ("corpus", "corpus"), ("compile", "compile"),
        ("init", "init"), ("first_step", "first step")) if key in startup)
    line = (f"{phases}; the first step's result {startup.get('to_first_step', 0):.1f} s after "
            f"set-up began")
    if "command_to_first_step" in startup:
        line += f", {startup['command_to_first_step']:.1f} s after the command started"
    return line


def _techniques(s: "RunSummary") -> str:
    """The survey techniques the run used, for the model line."""
    from jaxaccel.techniques import registry
    t, parts = s.techniques, registry.describe(s.techniques)
    if s.trainable_params != s.params:
        parts.append(f"{s.trainable_params:,} trainable ({s.trainable_params / s.params:.2%})")
    if (t.get("lora") or {}).get("init_from") or t.get("init_from"):
        parts.append(f"from {(t.get('lora') or {}).get('init_from') or t.get('init_from')}")
    return "; " + "; ".join(parts) if parts else ""


def _target(t: dict) -> str:
    """Time to quality (run.target_bpb): where the run reached its target, or that it did not."""
    if not t["reached"]:
        why = (f"given up after {t['gave_up_after_s']:.1f} s of training"
               if "gave_up_after_s" in t else "by the run's end")
        return f"{t['bpb']:g} bits/byte not reached {why}"
    return (f"{t['bpb']:g} bits/byte reached at step {t['step']} ({t['val_bpb']:.3f}), after "
            f"{t['real_tokens']:,} real tokens and {t['train_s']:.1f} s of training")


def _fp8(fp8: dict | None) -> str:
    if not fp8:
        return ""
    gemms = f", {fp8['gemms']} FP8 GEMMs in the step" if fp8.get("gemms") is not None else ""
    return f" ({fp8['note']}){gemms}"


def _pipeline(s: "RunSummary") -> str:
    pipe = s.techniques.get("pipeline")
    if not pipe:
        return ""
    return (f"; pipeline {pipe['schedule']} over {s.mesh['stage']} stages x {s.accumulate} "
            f"microbatches, bubble {pipe['bubble']:.1%}")


def _mesh(shape: dict) -> str:
    return ",".join(f"{axis}={size}" for axis, size in shape.items())


def _remat_line(s: "RunSummary") -> str:
    """The remat policy and layout, and with a memory budget each policy's compiled figures."""
    remat = s.techniques.get("remat") or {}
    line = f"{remat.get('policy', 'none')}{', scanned layers' if remat.get('scan_layers') else ''}"
    step = s.step_memory_bytes
    if step:
        line += f", step {step['total']:,} bytes ({step['temp']:,} temporary)"
    plan = remat.get("plan")
    if plan:
        figures = "; ".join(
            f"{r['policy']} {r['total_bytes']:,} B{'' if r['fits'] else ' (too big)'}, "
            f"{r['flops'] or 0:.3g} FLOPs" for r in plan["rows"])
        line += (f"; chosen by --memory-budget {plan['budget']:,} at batch {plan['batch_size']} "
                 f"(fewest {plan['criterion']} that fit): {figures}")
    return line


def _resume_command(s: "RunSummary") -> str:
    return (f"python -m experiments.train --config {s.run_dir}/config.yaml --resume "
            f"--run-dir {s.run_dir}")


@command()
def main(argv=None) -> int:
    cfg = parse(argv, description=__doc__.split("\n\n")[0])
    summary = train_until_stopped(cfg)
    if summary.interrupted:
        last = summary.steps == summary.total_steps      # only the final evaluation was left
        print(f"stopped by {summary.interrupted} at step {summary.steps}"
              + (" before the final evaluation finished" if last else "")
              + (f"; checkpoint saved; {'finish' if last else 'continue'} with: "
                 f"{_resume_command(summary)}" if cfg.run.save_checkpoints else
                 "; no checkpoint written (--no-save-checkpoints), so it cannot be continued"),
              file=sys.stderr)
        return exit_code(summary.interrupted)
    if summary.stopped_at is not None:
        print(f"paused at step {summary.stopped_at} of {summary.total_steps} (--stop-at), "
              f"{summary.real_tokens_per_s:,.0f} real tokens/s; checkpoint saved; continue with:"
              f" {_resume_command(summary)}")
    else:
        print(format_summary(summary))
    if summary.profile:
        from jaxaccel.run.profiling import ProfileReport, format_report
        print(format_report(ProfileReport(**summary.profile)))
    if cfg.run.json:
        dump_json(cfg.run.json, dataclasses.asdict(summary))
    if summary.diverged_at_step is not None:
        print(f"error: training diverged: the loss was NaN or inf at step "
              f"{summary.diverged_at_step}; lower --learning-rate, keep --clip-norm on, or use "
              f"--loss-scale dynamic with fp16 (exit code {DIVERGED})", file=sys.stderr)
        return DIVERGED
    return 0


if __name__ == "__main__":
    sys.exit(main())
