"""The table of a `benchmarks/gpu_check.sh` run: DIR/summary.md (for docs/gpu.md) and DIR/summary.json.

    python benchmarks/gpu_table.py docs/results/gpu

Reads what the check wrote in DIR (shardlab train's summaries, gpt_mfu.py's results, the planner's
prediction, the GPU tests' junit file) and sets every figure beside the device that made it. The
ratio of issue 29's bar is `shardlab train`'s tokens/s over the stand-alone compiled step's, both
from the same run; a figure a step did not produce (skipped at the deadline, or failed: see
gpu_check.log) is shown as '-'.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROWS = [  # (file, what ran, kind)
    ("train_compiled", "`shardlab train --config configs/gpt-350m-gpu.toml` (compiled, bf16-autocast)", "train"),
    ("mfu_standalone_compiled", "`benchmarks/gpt_mfu.py --compile` (the stand-alone step)", "mfu"),
    ("mfu_trainer_compiled", "`benchmarks/gpt_mfu.py --step trainer --compile` (train_step, fixed batch)", "mfu"),
    ("train_eager", "`shardlab train` 350M, eager (`--set train.compile=false`)", "train"),
    ("train_bf16_masters", "`shardlab train` 350M, `--precision bf16` (bf16 weights, fp32 masters)", "train"),
    ("train_llama_1b", "`shardlab train --config configs/llama-1b-gpu.toml` (1.24 B, compiled)", "train"),
]


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _figures(data: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """step (ms), tokens/s, MFU, peak GiB from a train summary or a gpt_mfu result."""
    if data is None:
        return None
    if kind == "mfu":
        return {"step_ms": data.get("step_ms_median"), "tokens_per_s": data.get("tokens_per_s"),
                "mfu": data.get("mfu"), "peak_gib": data.get("peak_memory_gib"), "device": data.get("device")}
    peak = data.get("peak_mem_bytes")
    return {"step_ms": 1e3 * data["median_step_s"] if data.get("median_step_s") else None,
            "tokens_per_s": data.get("tokens_per_s"), "mfu": data.get("mfu"),
            "peak_gib": max(peak) / 2**30 if peak else None, "device": data.get("device")}


def _tests(path: Path) -> str | None:
    try:
        suite = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    if suite is None:
        return None
    n, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return f"{n - fail - err - skip} passed, {fail + err} failed, {skip} skipped"


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summarise(out: Path) -> dict[str, Any]:
    rows = {name: _figures(_load(out / f"{name}.json"), kind) for name, _, kind in ROWS}
    device = next((r["device"] for r in rows.values() if r and r.get("device")), None)
    plan = _load(out / "plan_350m.json")
    predicted, stack = None, None
    if plan is not None:
        predicted = plan.get("evaluation", {}).get("time", {}).get("total_s")
        stack = plan.get("stack")     # the stack predicted and its interval (docs/planner.md, "Stacks")
    train, alone = rows["train_compiled"], rows["mfu_standalone_compiled"]
    ratio = (train["tokens_per_s"] / alone["tokens_per_s"]
             if train and alone and train.get("tokens_per_s") and alone.get("tokens_per_s") else None)
    return {"device": device, "rows": rows, "ratio_train_over_standalone": ratio,
            "gpu_tests": _tests(out / "pytest_gpu.xml"), "planned_step_s": predicted, "planned_stack": stack}


def markdown(s: dict[str, Any]) -> str:
    lines = [f"Device: **{s['device'] or 'unknown'}** (each figure below is from this device, one run of "
             f"`bash benchmarks/gpu_check.sh`).", "",
             "| what ran | step (ms) | tokens/s | MFU | peak alloc (GiB) |", "|---|---:|---:|---:|---:|"]
    for name, label, _ in ROWS:
        r = s["rows"][name] or {}
        lines.append(f"| {label} | {_fmt(r.get('step_ms'), '.1f')} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{'-' if r.get('mfu') is None else format(100 * r['mfu'], '.1f') + '%'} | "
                     f"{_fmt(r.get('peak_gib'), '.1f')} |")
    lines += ["", f"`shardlab train` over the stand-alone compiled step, same run: "
                  f"**{_fmt(s['ratio_train_over_standalone'], '.3f')}** (the bar: >= 1.0)."]
    if s["planned_step_s"]:
        st, t = s.get("planned_stack") or {}, s["planned_step_s"]
        iv = st.get("interval") or {}
        span = (f" ({1e3 * t / (1 + iv['hi']):.1f}-{1e3 * t / (1 + iv['lo']):.1f} ms)"
                if iv.get("lo") is not None and iv["lo"] > -1 else "")
        lines.append(f"`shardlab plan` (stack {st.get('stack', '?')}) predicts {1e3 * t:.1f} ms per step{span} "
                     f"for the 350M config.")
    lines.append(f"GPU tests (`tests/test_gpu.py`): {s['gpu_tests'] or 'not run'}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/gpu")
    s = summarise(out)
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    text = markdown(s)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
