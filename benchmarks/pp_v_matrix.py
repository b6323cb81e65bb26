"""The V-shaped and interleaved zero-bubble schedules' verify matrix (issue 42), one `shardlab verify`
per case, each against one process.

    python benchmarks/pp_v_matrix.py                            # every case below
    python benchmarks/pp_v_matrix.py --pp 2 --json v.json       # pp 2 only

Cases: zbv, dualpipev and interleaved-zb (2 chunks per rank) on the GPT at pp 2 and 4 with
m = p, 2p and 4p microbatches (dualpipev from m = 2p: it needs two legs' worth in flight); then
at pp 2, m = 4: each with --dp 2 --zero 1, --dp 2 --zero 2, --dp 2 --zero 3 (untied; ZeRO-2 and 3
with all three are refused before launch: ZeRO-2 measured wrong, see docs/pipeline.md),
--recompute full, --tp 2, and the MoE GPT with --ep 2 --experts 4. Each line prints the case, its exit status (0: passed) and verify's largest relative
differences; a case verify refuses before launch prints its reason. CI runs the pp 2 cases only
(tests/test_pp_verify.py, tests/test_pipeline_executor.py); this is the bigger matrix.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = ("zbv", "dualpipev", "interleaved-zb")
COMPOSED = (["--dp", "2", "--zero", "1"], ["--dp", "2", "--zero", "2"],
            ["--dp", "2", "--zero", "3", "--set", "model.tie_embeddings=false"], ["--recompute", "full"],
            ["--tp", "2"], ["--ep", "2", "--experts", "4"])


def cases(pps: list[int]) -> list[list[str]]:
    out = []
    for p in pps:
        for kind in KINDS:
            for m in (p, 2 * p, 4 * p):
                if kind == "dualpipev" and m < 2 * p:
                    continue
                out.append(["--pp", str(p), "--schedule", kind, "--microbatches", str(m)])
    if 2 in pps:
        out += [["--pp", "2", "--schedule", kind, "--microbatches", "4", *extra] for kind in KINDS for extra in COMPOSED]
    return out


def run(args: list[str], workdir: Path) -> dict:
    path = workdir / "v.json"
    path.unlink(missing_ok=True)
    extra = ["--virtual-stages", "2"] if "interleaved-zb" in args else []
    cmd = [sys.executable, "-m", "shardlab", "verify", "--model", "gpt", *args, *extra, "--json", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row: dict = {"case": " ".join(args + extra), "exit": proc.returncode}
    if path.exists():
        rep = json.loads(path.read_text())
        row.update(passed=rep["passed"], loss=rep["max_rel_loss_diff"], grad=rep.get("max_rel_grad_diff"),
                   norm=rep["max_rel_grad_norm_diff"])
    else:
        row["reason"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases(args.pp):
            rows.append(run(case, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
