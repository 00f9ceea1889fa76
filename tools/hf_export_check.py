"""By hand, not in the suite: an ``experiments.export`` folder through transformers, against ours.

    # the project's venv: our tokenizer's ids and text for probe texts, and greedy text
    python tools/hf_export_check.py ours --run-dir runs/R --out ours.json
    python -m experiments.sample --run-dir runs/R --prompt "def " --temperature 0 \
        --max-new-tokens 80 --warmup 0 --json sample.json
    # a separate venv with torch (CPU) and transformers 5, not a project dependency
    python tools/hf_export_check.py hf --export exported/R --ours ours.json \
        --sample sample.json --prompt "def " --max-new-tokens 80

``hf`` loads the folder with ``AutoTokenizer`` and ``AutoModelForCausalLM`` and prints: the
versions; BOS, EOS and PAD (token, transformers' id, config.json's, ours); how many probe texts
``tok(text)`` encodes to our BOS-framed ids and ``decode(..., skip_special_tokens=True)`` gives
our text for; and whether ``generate(do_sample=False)`` gives ``experiments.sample``'s greedy
text. Exit code 1 if anything differs. BENCHMARKS.md has a record.
"""

import argparse
import json
import sys

PROBES = ["def f(x):\n    return x  *  2  # héllo wörld\t日本 🚀 \n", "import os\n", "",
          "  two  spaces  ", "class A:\n\tpass", "<s> literal </s> <|bos|> <unk>",
          "x = '日本語'  # 🚀🚀"]


def ours(run_dir: str, out: str):
    from jaxaccel.core.tokenizer import from_run
    tok = from_run(run_dir)
    cases = [{"text": t, "framed": tok.encode(t, eos=False).tolist(),
              "decoded": tok.decode(tok.encode(t))} for t in PROBES]
    with open(out, "w") as f:
        json.dump({"kind": tok.kind, "bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id,
                   "cases": cases}, f, ensure_ascii=False)


def hf(export: str, ours_path: str, sample_path: str, prompt: str, new_tokens: int) -> bool:
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = json.load(open(ours_path))
    config = json.load(open(f"{export}/config.json"))
    tok = AutoTokenizer.from_pretrained(export)
    print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, "
          f"torch {torch.__version__}; {type(tok).__name__}")
    specials = {r: (getattr(tok, f"{r}_token"), getattr(tok, f"{r}_token_id"),
                    config[f"{r}_token_id"], record[r]) for r in ("bos", "eos", "pad")}
    print("specials (token, transformers id, config.json id, ours):", specials)
    good = all(v[1] == v[2] == v[3] for v in specials.values())
    encoded = decoded = 0
    for case in record["cases"]:
        got = tok(case["text"])["input_ids"]
        encoded += got == case["framed"]
        text = tok.decode(case["framed"] + [record["eos"]], skip_special_tokens=True)
        decoded += text == case["decoded"]
    n = len(record["cases"])
    print(f"encode (BOS-framed ids) equal: {encoded}/{n}; decode equal: {decoded}/{n}")
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    start = inputs["input_ids"].shape[1]
    theirs = prompt + tok.decode(out[0, start:], skip_special_tokens=True)
    mine = prompt + json.load(open(sample_path))["meta"]["texts"][0]
    print(f"prompt ids {inputs['input_ids'][0].tolist()}, {out.shape[1] - start} new tokens; "
          f"greedy text equal: {theirs == mine}")
    print("transformers:", repr(theirs[:160]))
    print("sample      :", repr(mine[:160]))
    return good and encoded == decoded == n and theirs == mine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    o = sub.add_parser("ours")
    o.add_argument("--run-dir", required=True)
    o.add_argument("--out", required=True)
    h = sub.add_parser("hf")
    for name in ("--export", "--ours", "--sample", "--prompt"):
        h.add_argument(name, required=True)
    h.add_argument("--max-new-tokens", type=int, default=80)
    args = parser.parse_args(argv)
    if args.command == "ours":
        ours(args.run_dir, args.out)
        return 0
    return 0 if hf(args.export, args.ours, args.sample, args.prompt, args.max_new_tokens) else 1


if __name__ == "__main__":
    sys.exit(main())
