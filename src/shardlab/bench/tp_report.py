"""What `shardlab bench train --tp N` adds to bench train's table: the loss check, communication
per step (counted beside Megatron's formula and each implementation's additions, bench/tp_volume.py) and activation memory per rank.

    result["tp"] = summarize(raw_runs, cfg.model, cfg.layout, cfg.train)   # in run_train_bench
    print(format_tp(result))                      # after the throughput table
"""

from __future__ import annotations

import statistics
from typing import Any

from shardlab.bench.tp_volume import Shapes, per_layer_and_edges, predicted_comm, totals
from shardlab.parallel.layout_section import LayoutSection
from shardlab.train.sections import ModelSection, TrainSection

MiB = 2**20
_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}


def _max_per_rank(runs: list[dict[str, Any]], key: str, what: str) -> list[int]:
    return [max(r["activation_bytes"][key][rank][what] for r in runs) for rank in range(runs[0]["world_size"])]


def summarize(runs: list[dict[str, Any]], model: ModelSection, lay: LayoutSection, t: TrainSection) -> dict[str, Any]:
    """The runs' check results, the first run's collective counts with the prediction (for `model` cut
    by `lay`, t.global_batch rows in t.micro_batches), and the activation memory per rank (the largest
    over runs)."""
    first = runs[0]
    rows = t.global_batch // lay.dp // t.micro_batches
    comm = {}
    shapes = Shapes.of(model, rows, lay.tp)
    for variant, c in first["comm"].items():
        (depth, other), (at_depth, at_other) = c["layers"], c["at"]
        split = per_layer_and_edges(at_depth["fwd_bwd"], at_other["fwd_bwd"], depth, other)
        implementation = "torch" if variant.startswith("torch_") else "megatron" if variant.startswith("decl") else "ours"
        pred = _times(predicted_comm(shapes, lay.tp, variant.endswith("_sp"), implementation, lay.precision),
                      t.micro_batches)
        entry = {
            "layers": depth,
            "counted": {"per_layer": split["per_layer"], "edges": split["edges"], "fwd_bwd": at_depth["fwd_bwd"],
                        "after_backward": at_depth.get("after_backward", {})},
            "predicted": {**pred, "fwd_bwd": _add(pred["per_layer"], depth, pred["edges"])},
        }
        if "count_comm" in at_depth:
            entry["count_comm"] = at_depth["count_comm"]
            entry["count_comm_agrees"] = _same(at_depth["count_comm"], at_depth["fwd_bwd"])
        comm[variant] = entry
    memory = {k: {"held": _max_per_rank(runs, k, "held"), "peak": _max_per_rank(runs, k, "peak")}
              for k in first["activation_bytes"]}
    phases = {}
    for v in first["phase_s"]:
        # Per rank, the median over every run's timed steps; then the slowest rank's.
        per_rank = [[step for r in runs for step in r["phase_s"][v][rank]] for rank in range(first["world_size"])]
        phases[v] = {name: 1e3 * max(statistics.median(x[i] for x in steps) for steps in per_rank)
                     for i, name in enumerate(("fwd_bwd_ms", "after_backward_ms"))}
    dispatch = {}
    for v in first.get("dispatch", {}):
        # Per rank, the median over every run's reps; then the mean over ranks (a tp group's ranks
        # do the same work).
        per_rank = [[d for r in runs for d in r["dispatch"][v][rank]] for rank in range(first["world_size"])]
        dispatch[v] = {k: statistics.fmean(statistics.median(d[k] for d in ds) for ds in per_rank)
                       for k in per_rank[0][0]}
    checks = [r["check"] for r in runs if r.get("check")]
    check = None
    if checks:
        check = {"rtol": checks[0]["rtol"], "reference": [c["reference"] for c in checks],
                 "max_rel_diff": {v: max(c["variants"][v]["max_rel_diff"] for c in checks)
                                  for v in checks[0]["variants"]}}
    return {"check": check, "comm": comm, "activations": memory, "phases": phases, "dispatch": dispatch,
            "rows_per_micro_batch": rows, "units": {
                "bytes": "nccl-tests buffer bytes (the whole gathered/scattered buffer for all-gather, reduce-scatter)",
                "bus_bytes": "bytes each rank sends on a ring: x 2(n-1)/n for all-reduce, x (n-1)/n otherwise",
                "per_layer": "(count at L layers - count at L' layers) / (L - L'): one block's forward + backward",
                "edges": "the rest of forward + backward: embedding, head, loss (and positions, final norm)",
                "after_backward": "gradient sync of replicated parameters, clipping's norm: after the last backward",
                "fwd_bwd_ms": "forward + backward of a timed step: median over steps and runs, slowest rank's",
                "after_backward_ms": "the rest of the step: gradient sync, clipping, AdamW (same statistic)",
                "dispatch_ms": "CPU time of a step outside compute and communication (bench/dispatch_cost.py): a "
                               "profiled step's wall time (profiled_step_ms) minus its aten operators' self time "
                               "(compute_ms) and its time in collectives, waits included (comm_ms), min(steps, 3) "
                               "profiled steps; per rank the median over steps, runs and reps, then the mean over "
                               "ranks; profiler_ms: profiled_step_ms minus the unprofiled timed step (step_ms)",
                "held": "bytes forward leaves alive for backward (parameters excluded), per rank",
                "peak": "highest bytes during forward + backward (gradients included), per rank"}}


def _times(pred: dict[str, Any], m: int) -> dict[str, Any]:
    """A prediction for one micro-batch, for m of them (every collective is per micro-batch)."""
    def scale(ops: dict) -> dict:
        return {op: {f: x * m for f, x in o.items()} for op, o in ops.items()}

    return {"per_layer": scale(pred["per_layer"]), "edges": scale(pred["edges"]),
            "formula": {w: scale(ops) for w, ops in pred["formula"].items()},
            "added": [{**a, **{f: a[f] * m for f in ("calls", "bytes", "bus_bytes")}} for a in pred["added"]]}


def _add(per_layer: dict, depth: int, edges: dict) -> dict:
    out: dict[str, dict[str, float]] = {}
    for op in set(per_layer) | set(edges):
        a, b = per_layer.get(op, {}), edges.get(op, {})
        out[op] = {f: depth * a.get(f, 0) + b.get(f, 0) for f in ("calls", "bytes", "bus_bytes")}
    return out


def _same(a: dict, b: dict) -> bool:
    return {op: (o["calls"], o["bytes"]) for op, o in a.items()} == {op: (o["calls"], o["bytes"]) for op, o in b.items()}


def _ops(ops: dict[str, dict[str, float]]) -> str:
    """'4 AR' or '6 AG + 4 RS + 6 AR' (calls, rounded where a per-layer figure is fractional)."""
    parts = [f"{o['calls']:g} {_SHORT[op]}" for op, o in sorted(ops.items()) if round(o["calls"], 6)]
    return " + ".join(parts) or "-"


def _bus(ops: dict[str, dict[str, float]]) -> str:
    return f"{totals(ops)['bus_bytes'] / MiB:,.2f}" if ops else "0"


COMM_COLUMNS = ["variant", "per layer: predicted", "counted", "MiB pred.", "MiB counted", "edges: predicted",
                "counted", "MiB pred.", "MiB counted", "step MiB pred.", "step MiB counted", "after backward"]


def comm_cells(result: dict[str, Any]) -> list[list[str]]:
    cells = []
    for v, c in result["tp"]["comm"].items():
        p, k = c["predicted"], c["counted"]
        after = k["after_backward"]
        cells.append([v, _ops(p["per_layer"]), _ops(k["per_layer"]), _bus(p["per_layer"]), _bus(k["per_layer"]),
                      _ops(p["edges"]), _ops(k["edges"]), _bus(p["edges"]), _bus(k["edges"]),
                      _bus(p["fwd_bwd"]), _bus(k["fwd_bwd"]),
                      f"{_ops(after)} ({totals(after)['bytes']:,.0f} B)" if after else "-"])
    return cells


ADDED_COLUMNS = ["variant", "where", "adds", "MiB per step", "why"]


def added_cells(result: dict[str, Any]) -> list[list[str]]:
    """The prediction's terms beyond Megatron's formula, per variant (bus MiB over the whole step)."""
    cells = []
    for v, c in result["tp"]["comm"].items():
        for a in c["predicted"].get("added", []):
            layers = c["layers"] if a["where"] == "per_layer" else 1
            where = f"each of {c['layers']} layers" if a["where"] == "per_layer" else "edges"
            cells.append([v, where, f"{a['calls']:g} {_SHORT[a['op']]} of {a['bytes'] / a['calls']:,.0f} B",
                          f"{layers * a['bus_bytes'] / MiB:,.2f}", a["why"]])
    return cells


DISPATCH_COLUMNS = ["variant", "profiled step ms", "compute ms", "comm ms", "outside compute + comm ms", "of step",
                    "unprofiled step ms", "profiler's own ms"]

MEMORY_COLUMNS = ["model", "held MiB per rank", "of plain", "peak MiB per rank", "of plain"]


def memory_cells(result: dict[str, Any]) -> list[list[str]]:
    mem = result["tp"]["activations"]
    plain_held, plain_peak = max(mem["plain"]["held"]), max(mem["plain"]["peak"])
    cells = []
    for k, m in mem.items():
        held, peak = max(m["held"]), max(m["peak"])
        cells.append(["plain (1 process's work, same rows)" if k == "plain" else k,
                      " / ".join(f"{x / MiB:.1f}" for x in m["held"]), f"{held / plain_held:.2f}",
                      " / ".join(f"{x / MiB:.1f}" for x in m["peak"]), f"{peak / plain_peak:.2f}"])
    return cells


def _table(heads: list[str], cells: list[list[str]], markdown: bool) -> str:
    if markdown:
        rows = ["| " + " | ".join(heads) + " |", "|" + "|".join(["---"] + ["---:"] * (len(heads) - 1)) + "|"]
        return "\n".join(rows + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(c[i]) for c in [heads, *cells]) for i in range(len(heads))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(heads), "  ".join("-" * w for w in widths), *(line(c) for c in cells)])


def format_tp(result: dict[str, Any], markdown: bool = False) -> str:
    """The check line, the communication table and the activation-memory table."""
    tp = result["tp"]
    cfg = result["config"]
    b, s, h = tp["rows_per_micro_batch"], cfg["model"]["seq_len"], cfg["model"]["d_model"]
    out = []
    if tp["check"]:
        worst = ", ".join(f"{v} {d:.1e}" for v, d in tp["check"]["max_rel_diff"].items())
        out.append(f"Loss check (step 0, and after one AdamW step, vs one process; every run): largest relative "
                   f"difference {worst}; allowed {tp['check']['rtol']:.0e}.")
    phases = tp.get("phases", {})
    if phases:
        out += ["", "Where a step's time goes (this rank's clock; median over timed steps, slowest rank):", "",
                _table(["variant", "forward + backward ms", "after backward ms (sync, clip, AdamW)"],
                       [[v, f"{p['fwd_bwd_ms']:.1f}", f"{p['after_backward_ms']:.1f}"] for v, p in phases.items()],
                       markdown)]
    disp = tp.get("dispatch", {})
    if disp:
        out += ["", "Dispatch cost: a step's CPU time outside compute and communication (bench/dispatch_cost.py: a profiled "
                    "step's wall time minus its aten operators' self time and its time in collectives, waits included; "
                    "medians over steps and runs, mean over ranks; the profiler's own cost, profiled minus unprofiled "
                    "step, is an upper bound on how much of the figure is the profiler's):", "",
                _table(DISPATCH_COLUMNS, [[v, f"{d['profiled_step_ms']:.1f}", f"{d['compute_ms']:.1f}", f"{d['comm_ms']:.1f}",
                                           f"{d['dispatch_ms']:.1f}", f"{d['dispatch_ms'] / d['profiled_step_ms']:.0%}",
                                           f"{d['step_ms']:.1f}", f"{d['profiler_ms']:.1f}"]
                                          for v, d in disp.items()], markdown)]
    out += ["", f"Communication per step and rank, forward + backward (bus MiB: what each rank sends on a ring; "
                f"b x s x h = {b} x {s} x {h}; AR all-reduce, AG all-gather, RS reduce-scatter; "
                f"predicted: Megatron's formula and what the implementation adds to it, bench/tp_volume.py):", "",
            _table(COMM_COLUMNS, comm_cells(result), markdown)]
    added = added_cells(result)
    if added:
        out += ["", "What the prediction adds to Megatron's formula, on purpose (bus MiB per step and rank):", "",
                _table(ADDED_COLUMNS, added, markdown)]
    agree = {v: c["count_comm_agrees"] for v, c in tp["comm"].items() if "count_comm_agrees" in c}
    if agree:
        out.append("\ncount_comm() (our autograd collectives) equals the dispatcher count for "
                   + ", ".join(f"{v}: {'yes' if ok else 'NO'}" for v, ok in agree.items()))
    out += ["", "Activation memory per rank (MemoryTracker; held: left by forward for backward; peak: during "
                "forward + backward, gradients included):", "", _table(MEMORY_COLUMNS, memory_cells(result), markdown)]
    return "\n".join(out)
