"""verify's report as text: the layout in one line, a row per step, the verdict with its largest
differences and tolerances, the precision's own error under mixed precision, what was compiled, and
the AdamW bound's bars (train/verify_noise.py format_bars)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardlab.parallel.layout_section import LayoutSection
from shardlab.train.sections import ModelSection
from shardlab.train.verify_noise import format_bars

LAYOUT_FIELDS = {f.name for f in dataclasses.fields(LayoutSection)}


def family(m: ModelSection) -> str:
    """' (rmsnorm, swiglu, rotary, 2 kv heads)' for the GPT's non-default options; '' otherwise."""
    if m.name != "gpt":
        return ""
    parts = [p for p, on in ((m.norm, m.norm != "layernorm"), (m.mlp, m.mlp != "gelu"), ("rotary", m.rotary),
                             (f"{m.n_kv_head} kv heads", 0 < m.n_kv_head < m.n_head), ("untied", not m.tie_embeddings))
             if on]
    return f" ({', '.join(parts)})" if parts else ""


def format_report(report: dict[str, Any]) -> str:
    lay = report["layout"]
    # The layout's own description, from the fields the report records (the others at their defaults).
    section = LayoutSection(**{k: v for k, v in lay.items() if k in LAYOUT_FIELDS})
    lines = [
        f"verify {report['model']}{report.get('family', '')}: {section.describe(comm_impl=True)}, "
        f"{lay['micro_batches']} micro-batch(es), {lay['precision']}, world size {report['world_size']}, "
        f"against one process on the whole batch, {report['steps']} steps",
        f"{'step':>4} {'loss (ref)':>11} {'loss diff':>10} {'grad abs':>9} {'grad rel':>9} "
        f"{'param abs':>9} {'param rel':>9}  {'ok':<4} closest to its bound",
    ]
    for r in report["per_step"]:
        lines.append(
            f"{r['step'] + 1:>4} {r['ref_loss']:>11.6f} {r['loss_diff']:>10.2e} {r['max_abs_grad_diff']:>9.2e} "
            f"{r['max_rel_grad_diff']:>9.2e} {r['max_abs_param_diff']:>9.2e} {r['max_rel_param_diff']:>9.2e}  "
            f"{'yes' if r['passed'] else 'NO':<4} {r['worst_param']} ({r['param_allowance_used']:.0%} of allowance)"
        )
    verdict = "PASS" if report["passed"] else "FAIL"
    if report.get("deterministic"):  # train.deterministic: the bar is 0 everywhere
        lines[0] = lines[0].replace("on the whole batch", "on the same micro-batches, bit for bit")
        lines.append(
            f"{verdict}: deterministic, largest absolute differences (0 required): loss "
            f"{max(abs(d) for d in report['loss_diffs']):.2e}, gradients {report['max_abs_grad_diff']:.2e}, "
            f"parameters {report['max_abs_param_diff']:.2e}, gradient norm {report['max_abs_grad_norm_diff']:.2e}")
        return "\n".join(lines)
    lines.append(
        f"{verdict}: largest relative differences: loss {report['max_rel_loss_diff']:.2e}, gradients "
        f"{report['max_rel_grad_diff']:.2e}, parameters {report['max_rel_param_diff']:.2e}, gradient norm "
        f"{report['max_rel_grad_norm_diff']:.2e} (tolerance {report['tolerance']:.0e} + {report['atol']:.0e} absolute for parameters, "
        f"{report['grad_tolerance']:.0e} for gradients and their norm)"
    )
    if report.get("mp_factor"):
        last = report["per_step"][-1]
        lines.append(
            f"{lay['precision']}: allowances include {report['mp_factor']:g} x the precision's own error (the "
            f"{lay['precision']} reference against fp32: loss {last['precision_loss_gap']:.2e}, gradients "
            f"{last['precision_rel_grad_gap']:.2e}, parameters {last['precision_rel_param_gap']:.2e} relative)")
    if report.get("compiled"):
        cfg_train = report["config"]["train"]
        lines.append(f"compiled blocks ({cfg_train['compile_backend']}) against the eager reference: "
                     + ", ".join(f"rank {r}: {c['graphs']} graphs, {c['graph_breaks']} graph breaks"
                                 for r, c in enumerate(report["compiled"])))
    return "\n".join(lines + format_bars(report))
