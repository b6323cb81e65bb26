"""The validation tables as text and JSON: `shardlab plan --validate`, docs/planner.md's tables."""

from __future__ import annotations

import json

from shardlab.plan.hardware import A100_MM_EFF, get_hardware
from shardlab.plan.plot import plot_agreement
from shardlab.plan.validate import (calibrate, leave_one_out, memory_rows, published_rows, sensitivity_rows, summary,
                                    table4_rows)


def published_report(refit: bool = True, loo: bool = True) -> tuple[str, dict]:
    """(text, data) of the comparison with Korthikanti et al. 2022. With `refit`, mm_eff is fitted
    afresh (and compared with the preset's value); otherwise the preset is used as it is."""
    base = get_hardware("a100-80gb")
    hw, eff = calibrate(base) if refit else (base, base.mm_eff)
    rows = published_rows(hw)
    overall, present = summary(rows), summary([r for r in rows if r["variant"] != "full recompute"])
    lines = [f"Korthikanti et al. 2022 (arXiv 2205.05198), Table 5: seconds per iteration on A100 80GB; "
             f"mm_eff {eff:.4f} (one number fitted to all eight; preset {A100_MM_EFF:.4f})",
             f"{'case':<22}{'tp':>3}{'pp':>4}{'v':>3}{'gpus':>6}{'batch':>6}{'published':>11}{'predicted':>11}{'error':>8}"
             f"{'MFU pub':>9}{'MFU pred':>9}",
             "-" * 92]
    for r in rows:
        mfu = f"{r['published_mfu'] * 100:.1f}%" if r["published_mfu"] else "-"
        lines.append(f"{r['case']:<22}{r['tp']:>3}{r['pp']:>4}{r['virtual']:>3}{r['gpus']:>6}{r['global_batch']:>6}"
                     f"{r['published_s']:>11.2f}{r['predicted_s']:>11.2f}{r['error'] * 100:>+7.1f}%"
                     f"{mfu:>9}{r['predicted_mfu_paper_flops'] * 100:>8.1f}%")
    lines.append(f"mean absolute error {overall['mae'] * 100:.2f}% (largest {overall['max_abs_error'] * 100:.1f}%, "
                 f"{overall['worst_case']}); present work (sp + selective) only: {present['mae'] * 100:.2f}% "
                 f"(largest {present['max_abs_error'] * 100:.1f}%)")
    data = {"mm_eff": eff, "preset_mm_eff": A100_MM_EFF, "rows": rows, "summary": overall,
            "summary_present_work": present}
    if loo:
        out = leave_one_out(base)
        mae = sum(abs(r["error"]) for r in out) / len(out)
        lines.append(f"leave-one-out (mm_eff refitted without the case it predicts): mean absolute error "
                     f"{mae * 100:.2f}%, largest {max(abs(r['error']) for r in out) * 100:.1f}%")
        data["leave_one_out"] = {"rows": out, "mae": mae}
        sens = sensitivity_rows(base)
        lines += ["", "Sensitivity: one assumption changed, mm_eff refitted",
                  f"{'variant':<44}{'mm_eff':>8}{'MAE':>8}{'largest':>9}  {'(case)':<22}{'MAE present':>12}"]
        lines += [f"{r['variant']:<44}{r['mm_eff']:>8.4f}{r['mae'] * 100:>7.2f}%{r['max_abs_error'] * 100:>8.1f}%  "
                  f"{r['worst_case']:<22}{r['mae_present_work'] * 100:>11.2f}%" for r in sens]
        data["sensitivity"] = sens
    t4 = table4_rows(hw)
    lines += ["", "Table 4: one 22B layer (micro-batch 4, tp 8), milliseconds (transcription less certain)",
              f"{'variant':<32}{'fwd pub':>9}{'fwd pred':>10}{'bwd pub':>9}{'bwd pred':>10}"]
    lines += [f"{r['variant']:<32}{r['published_fwd_ms']:>9.1f}{r['predicted_fwd_ms']:>10.2f}"
              f"{r['published_bwd_ms']:>9.1f}{r['predicted_bwd_ms']:>10.2f}" for r in t4]
    mem = memory_rows()
    lines += ["", "Memory per GPU (GB): activations on the first stage vs the paper's closed forms (Table 2 x L, "
              "sec. 4.2.3, 4.3) and Figure 1's values; model state, mean over stages, vs 18 bytes x params / (t p) "
              "and Figure 1's",
              f"{'model':<15}{'variant':<31}{'act paper':>10}{'fig 1':>7}{'ours':>8}{'err':>7}{'err f1':>7}"
              f"{'state paper':>12}{'fig 1':>7}{'ours':>7}{'err':>7}{'err f1':>7}{'1st stage':>10}"]
    lines += [f"{r['model']:<15}{r['variant']:<31}{r['paper_activations_gb']:>10.2f}{r['figure1_activations_gb']:>7.2f}"
              f"{r['predicted_activations_gb']:>8.2f}{r['activations_error'] * 100:>+6.1f}%"
              f"{r['figure1_activations_error'] * 100:>+6.1f}%{r['paper_model_state_gb']:>12.2f}"
              f"{r['figure1_model_state_gb']:>7.2f}{r['predicted_model_state_gb']:>7.2f}"
              f"{r['model_state_error'] * 100:>+6.1f}%{r['figure1_model_state_error'] * 100:>+6.1f}%"
              f"{r['first_stage_model_state_gb']:>10.2f}" for r in mem]
    data["table4"], data["memory"] = t4, mem
    return "\n".join(lines), data


def write_json(path: str | None, data: dict) -> None:
    """Write `data` as indented JSON to `path` (nothing when it is None) and say so."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        print(f"wrote {path}")


def print_validation(json_path: str | None = None, plot_path: str | None = None) -> int:
    text, data = published_report()
    print(text)
    write_json(json_path, data)
    if plot_path:
        pts = [(r["case"], r["published_s"], r["predicted_s"]) for r in data["rows"]]
        print(f"wrote {plot_agreement(pts, plot_path, 'Korthikanti et al. 2022, Table 5: seconds per iteration', 's', 0.08)}")
    return 0
