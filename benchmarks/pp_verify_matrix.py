"""The pipeline's verify matrix of issue 7, through the command line, one `shardlab verify` per case.

    python benchmarks/pp_verify_matrix.py                          # everything: 84 launches
    python benchmarks/pp_verify_matrix.py --models gpt --pp 2 --markdown pp.md --json pp.json
    python benchmarks/pp_verify_matrix.py --from-json pp.json      # the tables again, nothing run

Cases: every schedule at pp 2 and pp 4 with m = 1, 4 and 8 microbatches (interleaved, with 2
virtual stages per rank, only where m divides by pp: m = 4, 8), on the GPT and the deep MLP; then
the same at dp 2 x pp 2 (4 ranks). Each case is a fresh `shardlab verify` launch with its default
small models and tolerances (5 steps; loss within 1e-6 relative, gradients and their norm within
1e-5 of their tensor's scale, parameters within 1e-7 + 1e-6 of theirs), sized by verify itself:
layers enough for every chunk, a global batch of 12, or 16 where 12 does not divide into dp x m.

The table lists, over the 5 steps and all ranks, the largest relative differences from the single
process: loss, any gradient, any parameter (each relative to its tensor's largest element), and the
gradient norm the step clipped with; and the exit status (0: passed). A second table puts the
schedules with identical figures on one row (docs/pipeline.md quotes that one).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb1")


def cases(models: list[str], pps: list[int], dp2: bool) -> list[tuple[str, int, int, str, int]]:
    """(model, dp, pp, schedule, m) for every case of the matrix, in table order."""
    out = []
    layouts = [(1, p) for p in pps] + ([(2, 2)] if dp2 else [])
    for model in models:
        for dp, pp in layouts:
            for kind in SCHEDULES:
                for m in (1, 4, 8):
                    if kind == "interleaved" and m % pp:
                        continue  # Megatron's interleaved order runs microbatches in rounds of pp
                    out.append((model, dp, pp, kind, m))
    return out


def run_case(model: str, dp: int, pp: int, kind: str, m: int, workdir: Path) -> dict:
    path = workdir / f"{model}-dp{dp}-pp{pp}-{kind}-m{m}.json"
    cmd = [sys.executable, "-m", "shardlab", "verify", "--model", model, "--dp", str(dp), "--pp", str(pp),
           "--schedule", kind, "--microbatches", str(m), "--json", str(path), "--threads", "1"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row = {"model": model, "dp": dp, "pp": pp, "schedule": kind, "m": m, "exit": proc.returncode,
           "seconds": round(time.perf_counter() - start, 1)}
    if not path.exists():
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        return row
    report = json.loads(path.read_text())
    row.update(
        passed=report["passed"], n_layer=report["config"]["model"]["n_layer"],
        global_batch=report["config"]["train"]["global_batch"],
        virtual_stages=report["layout"]["virtual_stages"], dp_mode=report["layout"]["dp_mode"],
        loss=report["max_rel_loss_diff"], grad=report["max_rel_grad_diff"], param=report["max_rel_param_diff"],
        norm=report["max_rel_grad_norm_diff"], param_used=report["param_allowance_used"],
        grad_used=report["grad_allowance_used"],
    )
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| model | layout | schedule | m | loss | gradients | parameters | grad norm | exit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        layout = f"dp {r['dp']} x pp {r['pp']}" if r["dp"] > 1 else f"pp {r['pp']}"
        kind = r["schedule"] + (f" (v {r['virtual_stages']})" if r.get("virtual_stages", 1) > 1 else "")
        if "loss" not in r:
            lines.append(f"| {r['model']} | {layout} | {kind} | {r['m']} | - | - | - | - | {r['exit']} (no report) |")
            continue
        lines.append(f"| {r['model']} | {layout} | {kind} | {r['m']} | {r['loss']:.1e} | {r['grad']:.1e} | "
                     f"{r['param']:.1e} | {r['norm']:.1e} | {r['exit']} |")
    return "\n".join(lines)


def grouped(rows: list[dict]) -> str:
    """The table with the schedules that gave the same figures (same model, layout, m) on one row:
    the schedules reorder the same microbatches' arithmetic, so most of them agree to every digit."""
    groups: dict[tuple, list[str]] = {}
    for r in rows:
        if "loss" not in r:
            continue
        key = (r["model"], r["dp"], r["pp"], r["n_layer"], r["global_batch"], r["m"],
               *(f"{r[k]:.1e}" for k in ("loss", "grad", "param", "norm")), r["exit"])
        kind = r["schedule"] + (f" (v {r['virtual_stages']})" if r["virtual_stages"] > 1 else "")
        groups.setdefault(key, []).append(kind)
    lines = ["| model | layout | layers, batch | m | schedules | loss | gradients | parameters | grad norm | exit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, dp, pp, layers, batch, m, loss, grad, param, norm, code), kinds in groups.items():
        layout = f"dp {dp} x pp {pp}" if dp > 1 else f"pp {pp}"
        lines.append(f"| {model} | {layout} | {layers}, {batch} | {m} | {', '.join(kinds)} | {loss} | {grad} | "
                     f"{param} | {norm} | {code} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt,mlp", help="comma-separated: gpt, mlp (default %(default)s)")
    ap.add_argument("--pp", default="2,4", help="pipeline degrees at dp 1 (default %(default)s)")
    ap.add_argument("--no-dp", action="store_true", help="skip the dp 2 x pp 2 cases")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every row as JSON")
    ap.add_argument("--markdown", default=None, metavar="PATH", help="write the table as Markdown")
    ap.add_argument("--from-json", default=None, metavar="PATH", help="print the tables of an earlier --json, "
                                                                      "running nothing")
    args = ap.parse_args()
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
    else:
        rows = []
        todo = cases(args.models.split(","), [int(p) for p in args.pp.split(",")], not args.no_dp)
        with tempfile.TemporaryDirectory() as tmp:
            for i, case in enumerate(todo, 1):
                row = run_case(*case, Path(tmp))
                rows.append(row)
                status = "PASS" if row.get("passed") else f"FAIL (exit {row['exit']})"
                detail = (f"loss {row['loss']:.1e} grad {row['grad']:.1e} param {row['param']:.1e} "
                          f"norm {row['norm']:.1e}" if "loss" in row else row.get("error", "")[-300:])
                print(f"[{i}/{len(todo)}] {case}: {status} in {row['seconds']} s: {detail}", flush=True)
    table = markdown(rows)
    print(table + "\n\n" + grouped(rows))
    worst = {k: max((r[k] for r in rows if k in r), default=float("nan")) for k in ("loss", "grad", "param", "norm")}
    failed = [r for r in rows if r["exit"] != 0]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed; largest relative differences: loss {worst['loss']:.1e}, "
          f"gradients {worst['grad']:.1e}, parameters {worst['param']:.1e}, gradient norm {worst['norm']:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
