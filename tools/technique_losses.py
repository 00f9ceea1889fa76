"""Each technique's training losses on jaxaccel's GPT over a few steps, to compare two versions.

    python tools/technique_losses.py --out after.json             # every row
    python tools/technique_losses.py --out after.json --rows baseline,fp8
    python tools/technique_losses.py --compare tools/technique_losses_9f0ddd2.json after.json

``tools/technique_losses_9f0ddd2.json`` is the record of commit 9f0ddd2 (jaxaccel's GPT with the
techniques inside the model), taken before the "any model" change; BENCHMARKS.md compares it
with the code after it.

Each row runs ``python -m experiments.train`` with the same small model and corpus and the
technique's flags, logging every step; the record is the loss of every step and the final
validation loss, written as exact floats. ``--compare`` prints, per row, whether the two
records are bitwise equal, else the largest relative difference. Rows that need several devices
run with ``--xla_force_host_platform_device_count``; LoRA and adapter rows start from the
baseline row's run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

COMMON = ["--d-model", "64", "--n-layers", "4", "--n-heads", "4", "--seq-len", "64",
          "--batch-size", "8", "--steps", "6", "--log-every", "1", "--eval-every", "0",
          "--checkpoint-every", "0", "--final-eval-batches", "4", "--warmup-steps", "2",
          "--learning-rate", "3e-3", "--no-progress"]
# name: (flags, simulated devices)
ROWS = {
    "baseline": ([], 1),
    "gelu-tied": (["--mlp", "gelu", "--tie-embeddings"], 1),
    "dropout": (["--dropout", "0.1"], 1),
    "pack": (["--batching", "pack"], 1),
    "bucket": (["--batching", "bucket", "--buckets", "4"], 1),
    "bf16": (["--precision", "bf16"], 1),
    "fp16": (["--precision", "fp16"], 1),
    "fp8": (["--precision", "fp8"], 1),
    "fp8-scan": (["--precision", "fp8", "--scan-layers"], 1),
    "remat-full": (["--remat", "full"], 1),
    "remat-dots": (["--remat", "dots"], 1),
    "remat-attention": (["--remat", "attention"], 1),
    "remat-mlp": (["--remat", "mlp"], 1),
    "remat-offload": (["--remat", "offload"], 1),
    "scan": (["--scan-layers"], 1),
    "scan-remat-full": (["--scan-layers", "--remat", "full"], 1),
    "accumulate": (["--accumulate", "2"], 1),
    "rezero": (["--init", "rezero"], 1),
    "skipinit": (["--init", "skipinit"], 1),
    "tfixup": (["--init", "tfixup"], 1),
    "tfixup-scan": (["--init", "tfixup", "--scan-layers"], 1),
    "stochastic-depth": (["--stochastic-depth", "0.5"], 1),
    "stochastic-depth-scan": (["--stochastic-depth", "0.5", "--scan-layers"], 1),
    "token-drop": (["--token-keep", "0.5"], 1),
    "token-drop-loss": (["--token-keep", "0.5", "--token-drop-score", "loss"], 1),
    "token-drop-scan": (["--token-keep", "0.5", "--scan-layers"], 1),
    "token-drop-sd": (["--token-keep", "0.5", "--stochastic-depth", "0.5"], 1),
    "sparse-2:4": (["--sparsity", "2:4", "--sparsity-every", "2"], 1),
    "sparse-2:4-scan": (["--sparsity", "2:4", "--sparsity-every", "2", "--scan-layers"], 1),
    "fp8-sparse": (["--precision", "fp8", "--sparsity", "2:4"], 1),
    "importance": (["--sampling", "loss"], 1),
    "progressive": (["--progressive-stack", "2"], 1),
    "lora": (["--lora-rank", "4", "--init-from", "{baseline}"], 1),
    "lora-all": (["--lora-rank", "4", "--lora-targets", "q,k,v,o,in,gate,out",
                  "--init-from", "{baseline}"], 1),
    "adapters": (["--adapter-dim", "8", "--init-from", "{baseline}"], 1),
    "dp": (["--sharding", "dp"], 2),
    "fsdp": (["--sharding", "fsdp"], 2),
    "tp": (["--sharding", "tp"], 2),
    "fsdp-explicit": (["--sharding", "fsdp", "--mesh-axis-types", "explicit"], 2),
    "pp": (["--sharding", "pp", "--scan-layers", "--accumulate", "2"], 2),
    "pp-1f1b": (["--sharding", "pp", "--scan-layers", "--accumulate", "2",
                 "--pipeline-schedule", "1f1b"], 2),
}


def run_row(name: str, root: str, runs: dict) -> dict:
    flags, devices = ROWS[name]
    flags = [f.format(**runs) for f in flags]
    run_dir = os.path.join(root, name)
    summary = os.path.join(root, f"{name}.json")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    argv = [sys.executable, "-m", "experiments.train", *COMMON, *flags, "--run-dir", run_dir,
            "--json", summary]
    result = subprocess.run(argv, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        return {"flags": flags, "error": (result.stderr or result.stdout).strip()[-400:]}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    with open(summary) as f:
        val_loss = json.load(f)["val_loss"]
    runs[name] = run_dir
    return {"flags": flags, "devices": devices, "losses": losses, "val_loss": val_loss}


def compare(before: dict, after: dict) -> list[str]:
    lines = []
    for name, old in before.items():
        new = after.get(name)
        if new is None or "losses" not in new or "losses" not in old:
            lines.append(f"{name:24s} missing or failed: {(new or {}).get('error', '')[:120]}")
            continue
        a = old["losses"] + [old["val_loss"]]
        b = new["losses"] + [new["val_loss"]]
        if a == b:
            lines.append(f"{name:24s} bitwise equal ({len(a)} values)")
            continue
        worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
        lines.append(f"{name:24s} max relative difference {worst:.2e}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the records here (JSON)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (json.load(open(p)) for p in args.compare)
        print("\n".join(compare(before, after)))
        return 0
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not args.out:
        parser.error(f"unknown rows {unknown}" if unknown else "--out is required")
    if any("{baseline}" in " ".join(ROWS[n][0]) for n in names) and "baseline" not in names:
        names.insert(0, "baseline")
    records, runs = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            records[name] = run_row(name, root, runs)
            status = records[name].get("error") or f"val {records[name]['val_loss']:.6f}"
            print(f"{name:24s} {status}", flush=True)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
