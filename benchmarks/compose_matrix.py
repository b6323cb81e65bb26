"""The composition matrix of issue 18: every pair of features, each run through `shardlab verify`
(the resume through the trainer), at the smallest world size that holds it.

    python benchmarks/compose_matrix.py                                   # every pair + the multi-axis layouts
    python benchmarks/compose_matrix.py --only tp,pp-1f1b,zero1           # pairs among these features only
    python benchmarks/compose_matrix.py --markdown docs/results/compose.md --json compose.json
    python benchmarks/compose_matrix.py --from-json compose.json          # the tables again, nothing run

Features: data parallelism with each ZeRO stage (dp 2, zero 0-3), tensor parallelism (tp 2), tensor +
sequence parallelism (tp 2 --sp), a pipeline of 2 stages under each schedule (4 microbatches;
interleaved with 2 virtual stages), context parallelism (cp 2), expert parallelism (ep 2 over 4
experts), recomputation (full, selective), bf16 mixed precision, dropout (model.dropout 0.1: on the attention and
MLP outputs and the attention probabilities), and a checkpoint saved under one layout and resumed
under another. Two features of one family (two ZeRO stages, two schedules, tp
and tp + sp, the two recomputation modes) are not a pair. Every case is the GPT of `verify`'s
default small model (2 layers, or as many as the pipeline's chunks need, d_model 64, 5 steps).

Each pair is one fresh `shardlab verify` launch with the two features' flags together, its world
size the product of their degrees. The outcome is one of:
  pass     verify's own bars held at every step (fp32: loss within 1e-6 relative, gradients within
           1e-5 of their tensor's scale, parameters within 1e-7 + 1e-6 of theirs; bf16: the mixed-
           precision allowance verify --help describes);
  FAIL     verify ran and a bar was exceeded (exit 1), or it crashed;
  refused  the configuration check refused it before launch (exit 2), with the reason printed.
The resume feature is run through the trainer: the partner layout trains 4 steps with a checkpoint
at step 2, which a single process (another layout: the same model and precision) then resumes in another directory; its losses at
steps 2 and 3 must match the first run's within 1e-5 relative (fp32 rounding under another cut of
the arithmetic; a silent fresh start would be off by two steps of training).

The table lists the worst relative differences over the steps and ranks (loss, gradients,
parameters, gradient norm). docs/compose.md quotes the results with the command that made them.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (family, verify flags). A pair's world size is the product of its degrees.
FEATURES: dict[str, tuple[str, list[str]]] = {
    "dp": ("dp", ["--dp", "2"]),
    "zero1": ("dp", ["--dp", "2", "--zero", "1"]),
    "zero2": ("dp", ["--dp", "2", "--zero", "2"]),
    "zero3": ("dp", ["--dp", "2", "--zero", "3"]),
    "tp": ("tp", ["--tp", "2"]),
    "sp": ("tp", ["--tp", "2", "--sp"]),
    **{f"pp-{kind}": ("pp", ["--pp", "2", "--schedule", kind, "--microbatches", "4"]
                      + (["--virtual-stages", "2"] if kind == "interleaved" else []))
       for kind in ("naive", "gpipe", "1f1b", "interleaved", "zb1")},
    "cp": ("cp", ["--cp", "2"]),
    "ep": ("ep", ["--ep", "2", "--experts", "4"]),
    "rc-full": ("rc", ["--recompute", "full"]),
    "rc-selective": ("rc", ["--recompute", "selective"]),
    "bf16": ("precision", ["--precision", "bf16"]),
    "dropout": ("dropout", ["--set", "model.dropout=0.1"]),  # residual and attention dropout (models/dropout.py)
    "resume": ("resume", []),
}

# The layouts of several axes that the issue names (8 ranks each), run through verify as they are.
MULTI: dict[str, list[str]] = {
    "tp2 pp2 cp2 sp zero1": ["--tp", "2", "--pp", "2", "--cp", "2", "--sp", "--zero", "1", "--microbatches", "4"],
    "dp2 tp2 pp2 zero1 interleaved": ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--schedule",
                                      "interleaved", "--virtual-stages", "2", "--microbatches", "4"],
    "dp2 ep2 pp2 zero2 experts": ["--dp", "2", "--ep", "2", "--pp", "2", "--zero", "2", "--experts", "4",
                                  "--microbatches", "4"],
    "dp2 ep2 pp2 zero3 experts": ["--dp", "2", "--ep", "2", "--pp", "2", "--zero", "3", "--experts", "4",
                                  "--microbatches", "4"],
    "dp2 ep2 pp2 zero3 zb1 experts": ["--dp", "2", "--ep", "2", "--pp", "2", "--zero", "3", "--experts", "4",
                                      "--schedule", "zb1", "--microbatches", "4"],
    "tp2 pp2 cp2 sp zero1 dropout": ["--tp", "2", "--pp", "2", "--cp", "2", "--sp", "--zero", "1", "--microbatches",
                                     "4", "--set", "model.dropout=0.1"],
}


_LOCK: str | None = None  # --lock: each launch holds this file's lock (a machine shared with others)


@contextlib.contextmanager
def _held():
    if _LOCK is None:
        yield
        return
    with open(_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pairs(only: list[str] | None) -> list[tuple[str, str]]:
    """Every unordered pair of features of different families, in table order."""
    names = [n for n in FEATURES if only is None or n in only]
    return [(a, b) for a, b in itertools.combinations(names, 2) if FEATURES[a][0] != FEATURES[b][0]]


def flags_of(names: tuple[str, ...]) -> list[str]:
    """The verify flags of these features together (no two of one family, so no flag twice)."""
    return [f for n in names for f in FEATURES[n][1]]


def _refusal(text: str) -> str:
    """The configuration check's reasons, one line each ("  - ..." after "invalid configuration")."""
    lines = [ln.strip()[2:] for ln in text.splitlines() if ln.strip().startswith("- ")]
    return " | ".join(lines) if lines else text.strip().splitlines()[-1] if text.strip() else "?"


def run_verify(label: str, flags: list[str], workdir: Path, timeout: float) -> dict:
    path = workdir / f"{label.replace(' ', '_').replace('+', '_')}.json"
    cmd = [sys.executable, "-m", "shardlab", "verify", "--model", "gpt", *flags, "--json", str(path)]
    start = time.perf_counter()
    try:
        with _held():
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = 124, f"timed out after {timeout:.0f} s: {exc}"
    row: dict = {"case": label, "flags": " ".join(flags), "exit": code, "seconds": round(time.perf_counter() - start, 1)}
    if code == 2:
        row.update(outcome="refused", reason=_refusal(out))
    elif path.exists():
        rep = json.loads(path.read_text())
        row.update(outcome="pass" if rep["passed"] and code == 0 else "FAIL", loss=rep["max_rel_loss_diff"],
                   grad=rep["max_rel_grad_diff"], param=rep["max_rel_param_diff"], norm=rep["max_rel_grad_norm_diff"],
                   world=rep.get("world_size"))
    else:
        row.update(outcome="FAIL", reason=out.strip()[-600:])
    return row


def _train(flags: list[str], out_dir: Path, extra: list[str], timeout: float) -> subprocess.CompletedProcess:
    # The fixed settings first, so that a feature's own --set (the dropout feature's) wins over them.
    cmd = [sys.executable, "-m", "shardlab", "train", "--model", "gpt", "--steps", "4",
           "--set", f"log.out_dir={json.dumps(str(out_dir))}", "--set", "model.n_layer=2", "--set", "model.d_model=64",
           "--set", "model.n_head=4", "--set", "model.seq_len=32", "--set", "model.dropout=0.0",
           "--set", "train.global_batch=8", "--set", "train.warmup_steps=1", "--set", "train.log_every=1",
           "--set", "train.eval_every=0", "--set", "data.max_bytes=200000", "--set", "log.sample_tokens=0",
           "--set", "log.plot=false", "--set", "log.tensorboard=false", *flags, *extra]
    with _held():
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _losses(out_dir: Path) -> dict[int, float]:
    path = out_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def run_resume(label: str, partner: str, workdir: Path, timeout: float) -> dict:
    """Train 4 steps under the partner's layout, saving at step 2; resume that checkpoint on a single
    process (another layout) in another directory; its steps 3 and 4 (counted from 1) against the first run's."""
    flags = FEATURES[partner][1]  # the trainer takes verify's flags
    ref, part = workdir / f"{label}-ref", workdir / f"{label}-part"
    start = time.perf_counter()
    row: dict = {"case": label, "flags": " ".join(flags) + " -> resume on 1 process"}
    first = _train(flags, ref, ["--set", "checkpoint.every=2", "--set", "checkpoint.async_save=false"], timeout)
    if first.returncode == 2:
        row.update(outcome="refused", exit=2, reason=_refusal(first.stdout + first.stderr),
                   seconds=round(time.perf_counter() - start, 1))
        return row
    step2 = ref / "checkpoints" / "step_00000002"
    # The same model and precision (a MoE stays a MoE), on one process: only the layout changes.
    resumed = _train(_model_flags(flags), part, ["--set", f"checkpoint.resume={json.dumps(str(step2))}"], timeout)
    a, b = _losses(ref), _losses(part)
    worst = max((abs(b[s] - a[s]) / abs(a[s]) for s in (3, 4) if s in a and s in b), default=float("inf"))
    ok = first.returncode == 0 and resumed.returncode == 0 and sorted(b) == [3, 4] and worst <= 1e-5
    row.update(outcome="pass" if ok else "FAIL", exit=resumed.returncode, loss=worst,
               seconds=round(time.perf_counter() - start, 1))
    if not ok:
        row["reason"] = (f"train exit {first.returncode}, resume exit {resumed.returncode}, resumed steps {sorted(b)}: "
                         + (resumed.stderr or first.stderr)[-400:])
    return row


def _model_flags(flags: list[str]) -> list[str]:
    """Of a feature's flags, those that describe the model or its arithmetic, not the layout (dropout:
    the resumed single process draws the masks the layout drew, so its losses must match too)."""
    keep, out = ("--experts", "--precision"), []
    for i, f in enumerate(flags):
        if f in keep or (f == "--set" and flags[i + 1].startswith("model.")):
            out += [f, flags[i + 1]]
    return out


def run_pair(a: str, b: str, workdir: Path, timeout: float) -> dict:
    label = f"{a} + {b}"
    if "resume" in (a, b):
        return run_resume(label.replace(" + ", "_"), b if a == "resume" else a, workdir, timeout) | {"case": label}
    return run_verify(label, flags_of((a, b)), workdir, timeout)


def _fmt(r: dict, k: str) -> str:
    return f"{r[k]:.1e}" if isinstance(r.get(k), float) else "-"


def markdown(rows: list[dict]) -> str:
    lines = ["| case | outcome | loss | gradients | parameters | grad norm | s | reason (refused / failed) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reason = r.get("reason", "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['case']} | {r['outcome']} | {_fmt(r, 'loss')} | {_fmt(r, 'grad')} | {_fmt(r, 'param')} | "
                     f"{_fmt(r, 'norm')} | {r.get('seconds', '-')} | {reason[:300]} |")
    return "\n".join(lines)


def grid(rows: list[dict]) -> str:
    """The pairs as a square: P pass, F fail, R refused, blank for one family or not run."""
    names = list(FEATURES)
    mark = {"pass": "P", "FAIL": "F", "refused": "R"}
    cell: dict[tuple[str, str], str] = {}
    for r in rows:
        if " + " in r["case"]:
            a, b = r["case"].split(" + ")
            cell[a, b] = cell[b, a] = mark.get(r["outcome"], "?")
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        lines.append(f"| {a} | " + " | ".join(cell.get((a, b), "") for b in names) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated features: pairs among these only "
                                                 f"(of: {', '.join(FEATURES)})")
    ap.add_argument("--pairs", default=None, help="run these pairs only, e.g. zero1+pp-1f1b,cp+tp (after --only)")
    ap.add_argument("--skip-json", default=None, metavar="PATH", help="leave out the cases an earlier --json "
                                                                    "already holds (to continue a run)")
    ap.add_argument("--no-multi", action="store_true", help="skip the 8-rank multi-axis layouts")
    ap.add_argument("--multi", default=None, metavar="NAMES", help="run these multi-axis layouts only (';'-separated, "
                                                                 f"of: {'; '.join(MULTI)})")
    ap.add_argument("--no-pairs", action="store_true", help="run the multi-axis layouts only")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (default %(default)s)")
    ap.add_argument("--lock", default=None, metavar="FILE", help="hold this file's lock (flock) during each launch, "
                                                             "so that a shared machine's other jobs interleave")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every row as JSON")
    ap.add_argument("--markdown", default=None, metavar="PATH", help="write the tables as Markdown")
    ap.add_argument("--from-json", default=None, metavar="PATH", help="the tables of an earlier --json, "
                                                                      "running nothing")
    args = ap.parse_args()
    global _LOCK
    _LOCK = args.lock
    only = args.only.split(",") if args.only else None
    if only and (bad := [n for n in only if n not in FEATURES]):
        ap.error(f"--only: unknown feature(s) {', '.join(bad)}; known: {', '.join(FEATURES)}")
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
    else:
        rows = []
        todo: list = [] if args.no_pairs else [("pair", p) for p in pairs(only)]
        if args.pairs:
            wanted = [tuple(x.split("+")) for x in args.pairs.split(",")]
            if bad := [w for w in wanted if len(w) != 2 or any(n not in FEATURES for n in w)]:
                ap.error(f"--pairs: {bad} are not pairs of known features ({', '.join(FEATURES)})")
            todo = [("pair", w) for w in wanted]
        multi = args.multi.split(";") if args.multi else list(MULTI)
        if bad := [m for m in multi if m not in MULTI]:
            ap.error(f"--multi: unknown layout(s) {bad}; known: {'; '.join(MULTI)}")
        todo += [] if args.no_multi else [("multi", m) for m in multi]
        if args.skip_json:
            done = {r["case"] for r in json.loads(Path(args.skip_json).read_text())}
            todo = [(k, w) for k, w in todo if (" + ".join(w) if k == "pair" else w) not in done]
        with tempfile.TemporaryDirectory() as tmp:
            for i, (kind, what) in enumerate(todo, 1):
                row = (run_pair(*what, Path(tmp), args.timeout) if kind == "pair"
                       else run_verify(what, MULTI[what], Path(tmp), args.timeout))
                rows.append(row)
                print(f"[{i}/{len(todo)}] {row['case']}: {row['outcome']} in {row.get('seconds')} s "
                      f"{row.get('reason', '')[:200]}", flush=True)
                if args.json:  # as it goes: a long run interrupted keeps what it measured
                    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    table, square = markdown(rows), grid(rows)
    print(square + "\n\n" + table)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("pass", "FAIL", "refused")}
    print(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['refused']} refused of {len(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(square + "\n\n" + table + "\n")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
