"""The GPU measurements of the open GPU issues (16: the training path, 19: flash attention), as
calls that each fit one device-tool command: every step is a subprocess with its own time limit
inside the call's budget, so a hang or a crash costs one step, not the call.

    python3 tools/gpu_session.py --list                 # the calls and their steps
    PYTHONPATH=. python3 tools/gpu_session.py train     # on the GPU machine (see below)
    .venv/bin/python tools/gpu_session.py train --smoke # here: every step at toy sizes, on the CPU

On the device tool: copy ``../shared/peers/torch_gpt2.py`` into ``.gpu/`` (ignored through
``.git/info/exclude``), name ``.gpu`` in ``carry``, and run ``PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 tools/gpu_session.py CALL``. The results come back in ``$OUT`` (at most 8 files):
``session.json`` (each step's command, exit code, seconds and the JSON it wrote), ``log.txt``
(everything the steps printed) and, after a tuning step, ``tuned.json``: copy that over
``jaxaccel/model/kernels/tuned.json`` and commit it before the next call, which merges its own head
dims into it. The last lines printed are a summary of the steps (the device tool returns the end of
the output). The tokamax rows need its wheels: ``tools/gpu_wheels.sh`` puts them in ``.whl`` (37
MB; carry ``.whl`` too), and the driver installs them there before the first step; without them
those rows say that tokamax is not installed.

Calls, in the order the issues want them: ``train`` (issue 16: start-up cold and warm, the loop
against its step alone, the profile, the torch peer; cuDNN against our kernel on fixed and on
packed rows, which ``--attention auto`` chooses between; the scatter embedding in the loop, the
embedding methods alone, FP8), ``speedup`` (issue 34: ``experiments.speedup --scale gpu``
within its 540 s; on a fresh H200 on 2026-11-27, before ``--quiet``, it was stopped after 13 of
its 16 row processes: BENCHMARKS.md, "The headline on a GPU"),
``attention`` (issue 19: ours with the built-in rows against cuDNN and JAX's reference kernel,
then tuning at D=128) and
``tune64`` (issue 19: tuning at D=64, the comparison again with the tuned table, the peers).
``issue36`` is issue 36's most wanted figures in one call (about 330 s on an H200): start-up
cold and warm, the loop against its step alone, the peer at both vocabularies, the FP8 probe and
FP8 in the step, GPT-2's vocabulary. Its ``gpt2`` step reads ``.gpu/bpe50257.json``, a
50,257-token BPE of the corpus made here beforehand (``python -c "from jaxaccel.data.corpus import
load_corpus; load_corpus('stdlib', tokenizer='bpe:50257', cache_dir='/tmp/bpe')"``, then copy
the ``tokenizer-bpe50257-*.json`` it writes), so the GPU spends no time training it.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / ".gpu" / "torch_gpt2.py"
BPE = ROOT / ".gpu" / "bpe50257.json"      # GPT-2's vocabulary size, made here (docstring)
TUNED = ROOT / "jaxaccel" / "kernels" / "tuned.json"
BUDGET_S = 570         # of the device tool's 600 s per command
MARGIN_S = 15          # kept for writing the results after the last step
STOP_S = 25            # after its limit, a step's SIGTERM has this long to write what it has
                       # (experiments.speedup on an H200: the row stops after its step, then the
                       # partial table and JSON are written; 10 s was too short on 2026-11-27,
                       # when a row also saved a checkpoint)


@dataclasses.dataclass
class Step:
    name: str
    argv: list             # a python module and its arguments ("-m", ...) or a script
    limit_s: int
    smoke: list = dataclasses.field(default_factory=list)   # arguments appended in --smoke
    needs: str | None = None     # "peer": the torch script PEER and torch; "bpe": BPE
    json: bool = True            # the step takes --json PATH
    env: dict = dataclasses.field(default_factory=dict)     # set for this step only
    keep: list = dataclasses.field(default_factory=list)    # files of the work dir for $OUT


TRAIN = {"--model": "small", "--seq-len": "1024", "--batch-size": "16", "--precision": "bf16",
         "--attention": "auto", "--batching": "pack", "--embedding": "auto",
         "--train-tokens": "2000000", "--profile": "10:15", "--time-step": "20"}
TRAIN_SMOKE = {"--model": "tiny", "--d-model": "64", "--n-layers": "2", "--seq-len": "128",
               "--batch-size": "4", "--train-tokens": "12000", "--profile": "3:5",
               "--time-step": "3", "--precision": "fp32", "--eval-batches": "1",
               "--final-eval-batches": "1"}


def train(name: str, limit_s: int = 120, env: dict | None = None, **changes: str) -> Step:
    """experiments.train at issue 16's shape (GPT-2 small, seq 1024, batch 16, bf16, packed),
    with a profile of steps 10 to 15 and the step timed alone on the last 20 batches; ``changes``
    (``attention="cudnn"``) replace those flags."""
    flags = {**TRAIN, **{f"--{k.replace('_', '-')}": v for k, v in changes.items()}}
    flags = {k: v for k, v in flags.items() if v != "0:0"}     # profile="0:0": no profile
    return Step(name, ["-m", "experiments.train", *(x for kv in flags.items() for x in kv),
                       "--no-progress", "--run-dir", "{work}/" + name, "--compilation-cache",
                       "{work}/xla"], limit_s,
                smoke=[x for kv in TRAIN_SMOKE.items() for x in kv], env=env or {})


ATTENTION_SMOKE = ["--seq-lens", "64", "--head-dims", "32", "--heads", "2", "--batch", "1",
                   "--packed-docs", "1.5",
                   "--iters", "1", "--warmup", "0", "--max-t-limit", "0", "--impls", "xla,pallas"]
TUNE_SMOKE = ["--tune-seq-lens", "64", "--heads", "2", "--batch", "1", "--iters", "1",
              "--warmup", "0", "--tune-blocks", "32", "--tune-warps", "4", "--tune-stages", "2",
              "--causal", "causal"]


def attention(name: str, *extra: str, limit_s: int = 200) -> Step:
    """experiments.attention at issue 19's shapes: T 1k, 4k, 16k, D 64 and 128, causal and not,
    dense and packed rows, no memory search (it takes minutes)."""
    return Step(name, ["-m", "experiments.attention", "--seq-lens", "1024,4096,16384",
                       "--max-t-limit", "0", *extra], limit_s, smoke=ATTENTION_SMOKE)


def tune(head_dim: int, limit_s: int = 330) -> Step:
    return Step(f"tune{head_dim}", ["-m", "experiments.attention", "--tune", "--head-dims",
                                    str(head_dim), "--tuning-file", str(TUNED)], limit_s,
                smoke=TUNE_SMOKE + ["--head-dims", "32", "--tuning-file", "{work}/tuned.json"])


CALLS = {
    "train": [
        train("cold", 150),
        train("warm", 60),
        Step("torch_peer", [str(PEER), "--vocab", "320"], 150, needs="peer", json=False),
        train("fixed_cudnn", 90, batching="fixed", attention="cudnn"),
        train("fixed_pallas", 90, batching="fixed", attention="pallas"),
        train("pack_cudnn", 90, attention="cudnn"),
        train("gather", 60, embedding="gather"),
        Step("embedding", ["-m", "experiments.embedding"], 120,
             smoke=["--vocabs", "64,320", "--d-model", "32", "--batch", "2", "--seq-len", "64",
                    "--iters", "2"]),
        Step("fp8", ["-m", "experiments.precision", "--model", "small", "--seq-len", "1024",
                     "--batch-size", "16", "--precisions", "bf16,fp8", "--train-tokens",
                     "1000000", "--run-dir", "{work}/fp8"], 120,
             smoke=["--model", "tiny", "--d-model", "64", "--n-layers", "2", "--seq-len", "64",
                    "--batch-size", "4", "--train-tokens", "4000", "--precisions", "fp32"]),
    ],
    # Issue 36 in one call, most wanted first: start-up cold and warm, the loop against its step
    # alone (the warm run without a profile, 4x longer: on 2026-11-27 123 steps gave 81-91 %),
    # the peer, what XLA makes of FP8 and FP8 in the step, GPT-2's vocabulary (a 50,257-token
    # BPE of the corpus carried in .gpu) and its peer; last, the FP8 step profiled without XLA's
    # command buffers (with them the profile is one opaque command_buffer op).
    "issue36": [
        train("cold", 150),
        train("warm", 60, profile="0:0", train_tokens="8000000"),
        Step("torch_peer", [str(PEER), "--vocab", "320"], 120, needs="peer", json=False),
        Step("fp8_probe", ["tools/gpu_probe.py", "fp8"], 90, json=False),
        train("fp8", 120, precision="fp8", profile="0:0"),
        dataclasses.replace(train("gpt2", 120, model="gpt2", tokenizer=str(BPE),
                                  profile="0:0"), needs="bpe"),
        Step("torch_peer_50304", [str(PEER), "--vocab", "50304"], 120, needs="peer",
             json=False),
        train("fp8_profile", 90, precision="fp8", train_tokens="400000", time_step="0",
              env={"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}),
    ],
    "speedup": [
        Step("speedup", ["-m", "experiments.speedup", "--scale", "gpu", "--run-dir",
                         "{work}/speedup"], BUDGET_S - 30,
             smoke=["--scale", "cpu", "--rows", "pack", "--rounds", "1",
                    "gpt.d_model=64", "run.train_tokens=20000", "run.target_bpb=7.9"],
             keep=["speedup/report.md", "speedup/time_to_target.png", "speedup/loss_curves.png"]),
    ],
    "attention": [
        attention("attention_builtin", "--impls", "cudnn,jax_reference,pallas", limit_s=240),
        tune(128, limit_s=300),
    ],
    "tune64": [
        tune(64),
        attention("attention_tuned", "--impls", "cudnn,pallas,tokamax_mosaic,tokamax_triton,"
                  "tokamax_cudnn", limit_s=200),
    ],
}


def missing(needs: str | None) -> str | None:
    """Why a step cannot run here, or None."""
    if needs == "peer" and not PEER.exists():
        return f"skipped: {PEER.name} is not here; copy ../shared/peers/torch_gpt2.py to {PEER}"
    if needs == "bpe" and not BPE.exists():
        return f"skipped: {BPE.name} is not here; make it as the module docstring says"
    if needs == "peer" and importlib.util.find_spec("torch") is None:
        return "skipped: torch is not installed"
    return None


def install_wheels(work: Path, log) -> str | None:
    """Installs the wheels carried in ``.whl`` (``tools/gpu_wheels.sh``) into a folder of the
    work dir, which the steps then find first on their path; what happened, or None without
    wheels."""
    wheels = sorted(str(w) for w in (ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return None
    site = work / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--no-compile", "--no-cache-dir", "--target", str(site),
                           *wheels], stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        return f"pip could not install the {len(wheels)} wheels of .whl (exit {done.returncode})"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return f"installed the {len(wheels)} wheels of .whl"


def command(step: Step, work: Path, smoke: bool) -> list[str]:
    argv = [a.replace("{work}", str(work)) for a in step.argv + (step.smoke if smoke else [])]
    if step.json:
        argv += ["--json", str(work / f"{step.name}.json")]
    return [sys.executable, *argv]


def run_step(step: Step, work: Path, log, deadline: float, smoke: bool) -> dict:
    """Runs one step within its limit and the call's deadline; its record for session.json."""
    cmd = command(step, work, smoke)
    record = {"name": step.name, "command": " ".join(cmd[1:])}
    reason = missing(step.needs)
    left = deadline - time.monotonic()
    if reason is None and left < 20:
        reason = f"skipped: {left:.0f} s left of the call's budget"
    if reason:
        print(f"== {step.name}: {reason}", file=log, flush=True)
        return {**record, "status": reason}
    limit = min(step.limit_s, left)
    print(f"== {step.name} (limit {limit:.0f} s): {record['command']}", file=log, flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OUT": str(work), **step.env}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=limit)
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc, status = None, f"timed out after {limit:.0f} s"
    record.update(status=status, rc=rc, seconds=round(time.monotonic() - start, 1))
    out = work / ("torch_gpt2.json" if step.needs == "peer" else f"{step.name}.json")
    if out.exists():
        try:
            record["result"] = json.loads(out.read_text().strip().splitlines()[-1]
                                          if step.needs == "peer" else out.read_text())
        except (json.JSONDecodeError, IndexError) as e:
            record["result_error"] = f"{out.name}: {e}"
    print(f"== {step.name}: {status} in {record['seconds']} s", file=log, flush=True)
    return record


def highlights(record: dict) -> str:
    """One line of a step's key figures, from the JSON it wrote."""
    r = record.get("result")
    if not isinstance(r, dict):
        return ""
    if "real_tokens_per_s" in r:       # experiments.train's summary
        startup = r.get("startup_s") or {}
        alone = r.get("step_alone") or {}
        profile = r.get("profile") or {}
        ops = profile.get("ops") or [{}]
        mfu, share = r.get("mfu"), alone.get("loop_share")
        return (f"{r['real_tokens_per_s']:,.0f} real tok/s, MFU "
                f"{'n/a' if mfu is None else f'{mfu:.1%}'}; command to first step "
                f"{startup.get('command_to_first_step', 'n/a')} s (compile "
                f"{startup.get('compile', 'n/a')} s); loop/alone "
                f"{'n/a' if share is None else f'{share:.1%}'}, alone "
                f"{alone.get('real_tokens_per_s', 0):,.0f} tok/s; profiled step "
                f"{profile.get('step_ms', 0):.1f} ms, top op {ops[0].get('name', 'n/a')} "
                f"{ops[0].get('ms_per_step', 0):.2f} ms; data wait "
                f"{r.get('data_wait_s', 0):.2f} of {r.get('train_s', 0):.2f} s"
                + (f"; FP8 GEMMs {r['techniques']['fp8'].get('gemms')}"
                   if "fp8" in (r.get("techniques") or {}) else ""))
    if "tokens_per_s" in r:            # the torch peer
        return ", ".join(f"{k} {v}" for k, v in r.items() if k in ("ms_per_step", "tokens_per_s",
                                                                   "mfu"))
    rows = r.get("rows")
    if isinstance(rows, list) and "best" in r.get("meta", {}):     # experiments.speedup
        best = next((x for x in rows if x.get("name") == "best"), None)
        return (f"{len(rows)} rows; best = {' + '.join(r['meta']['best']) or 'baseline'}" +
                (f": {best['speedup']:.2f}x +- {best.get('spread') or 0:.2f} sooner to "
                 f"{r['meta'].get('target_bpb')} bits/byte ({best.get('verdict')})"
                 if best and best.get("speedup") else ""))
    if isinstance(rows, list):
        bad = [x for x in rows if str(x.get("status", "ok")).startswith("error")]
        return f"{len(rows)} rows, {len(bad)} errors"
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("call", nargs="?", choices=tuple(CALLS))
    ap.add_argument("--list", action="store_true", help="print the calls' steps and exit")
    ap.add_argument("--smoke", action="store_true",
                    help="every step at toy sizes (on the CPU: checks the commands, not speed)")
    ap.add_argument("--steps", help="comma-separated steps of the call to run (default: all)")
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help=f"seconds the whole call may take (default {BUDGET_S})")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="where the results go (default: $OUT)")
    a = ap.parse_args(argv)
    if a.list:
        for call, steps in CALLS.items():
            print(f"{call}:")
            for s in steps:
                argv = command(s, Path("WORK"), False)[1:]
                print(f"  {s.name} ({s.limit_s} s): {' '.join(argv)}")
        return 0
    if a.call is None or not a.out:
        ap.error("name a call (see --list) and --out DIR (or set $OUT)")
    steps = CALLS[a.call]
    if a.steps:
        names = a.steps.split(",")
        unknown = sorted(set(names) - {s.name for s in steps})
        if unknown:
            ap.error(f"unknown steps {unknown} of call {a.call}; choose from "
                     f"{', '.join(s.name for s in steps)}")
        steps = [s for s in steps if s.name in names]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_session-{a.call}-{os.getpid()}"
    work.mkdir(parents=True)
    deadline = time.monotonic() + a.budget - MARGIN_S
    session = {"call": a.call, "smoke": a.smoke, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "gpu": gpu_description(), "steps": []}
    with open(out / "log.txt", "w") as log:
        session["wheels"] = install_wheels(work, log)
        for step in steps:
            session["steps"].append(run_step(step, work, log, deadline, a.smoke))
            (out / "session.json").write_text(json.dumps(session, indent=1) + "\n")
    tuned = work / "tuned.json" if a.smoke else TUNED
    if any(s.name.startswith("tune") for s in steps) and tuned.exists():
        shutil.copy(tuned, out / "tuned.json")
    for hlo in sorted(work.glob("hlo_*.txt"))[:2]:     # the FP8 probe's optimized HLO
        shutil.copy(hlo, out / hlo.name)
    for kept in (work / k for s in steps for k in s.keep):     # a step's report and plots
        if kept.exists():
            shutil.copy(kept, out / kept.name)
    print(f"{a.call} on {session['gpu']}" + (" (smoke: toy sizes)" if a.smoke else ""))
    for rec in session["steps"]:
        print(f"- {rec['name']}: {rec['status']}"
              + (f" in {rec['seconds']} s" if "seconds" in rec else "")
              + (f"; {highlights(rec)}" if highlights(rec) else ""))
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped")
                    for r in session["steps"]) else 1


def gpu_description() -> str:
    """nvidia-smi's name, clocks and temperature of the GPU, or 'no GPU'."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20,
            check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "no GPU (nvidia-smi did not answer)"


if __name__ == "__main__":
    sys.exit(main())
