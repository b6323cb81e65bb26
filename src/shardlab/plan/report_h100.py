"""`shardlab plan --validate-h100` and `--validate-comm`: the H100 and communication validation
tables as text, JSON and a PNG (docs/planner.md's tables)."""

from __future__ import annotations

from shardlab.plan.hardware import H100_FP8_EFF, HOPPER_ATTN_EFF, get_hardware
from shardlab.plan.published_h100 import LLAMA3_405B
from shardlab.plan.validate_comm import comm_rows, format_comm
from shardlab.plan.validate_h100 import calibrate, h100_rows, leave_one_out, summary
from shardlab.plan.validate_report import write_json


def h100_report() -> tuple[str, dict]:
    base = get_hardware("h100-sxm")
    hw, (fp8_eff, attn_eff) = calibrate(base)
    rows = h100_rows(hw)
    loo = {r["case"]: r for r in leave_one_out(base)}
    held = h100_rows(base, [LLAMA3_405B])[0]
    head = (f"{'case':<22}{'gpus':>6}  {'layout':<36}{'pub s':>8}{'pred s':>8}{'error':>8}{'LOO':>8}"
            f"{'MFU pub full/causal':>21}{'MFU pred full/causal':>22}{'mem GB':>8}")
    lines = [f"NeMo Framework 24.07, DGX-H100, fp8: step time from tokens/s/GPU; fitted fp8_eff {fp8_eff:.3f} "
             f"(preset {H100_FP8_EFF}), attn_eff {attn_eff:.3f} (preset {HOPPER_ATTN_EFF}); MFU against the "
             f"bf16 dense peak (989 TFLOP/s), attention counted whole (NeMo's convention) / causal half",
             head, "-" * len(head)]
    for r in rows + [held]:
        lo = loo.get(r["case"])
        lo_text = f"{lo['error'] * 100:+7.1f}%" if lo else "   held"
        lines.append(f"{r['case']:<22}{r['gpus']:>6}  {r['layout'][:35]:<36}{r['published_s']:>8.2f}"
                     f"{r['predicted_s']:>8.2f}{r['error'] * 100:>+7.1f}%{lo_text}"
                     f"{r['published_mfu_full_attention'] * 100:>13.1f}/{r['published_mfu_causal'] * 100:.1f}%"
                     f"{r['predicted_mfu_full_attention'] * 100:>14.1f}/{r['predicted_mfu_causal'] * 100:.1f}%"
                     f"{r['memory_gb']:>7.1f}{'' if r['fits'] else '!'}")
    s = summary(rows)
    errs = [abs(r["error"]) for r in loo.values()]
    loo_s = {"mae": sum(errs) / len(errs), "max_abs_error": max(errs)}
    lines += [f"fit: mean absolute error {s['mae'] * 100:.1f}%, largest {s['max_abs_error'] * 100:.1f}% "
              f"({s['worst_case']}); leave-one-out (both numbers refitted without the case): mean "
              f"{loo_s['mae'] * 100:.1f}%, largest {loo_s['max_abs_error'] * 100:.1f}%",
              f"held out: {held['case']} ({held['layout']}): predicted {held['predicted_s']:.2f} s vs "
              f"{held['published_s']:.2f} s ({held['error'] * 100:+.1f}%), {held['memory_gb']:.1f} GB per GPU: "
              + ("fits" if held["fits"] else "DOES NOT FIT")]
    data = {"fp8_eff": fp8_eff, "attn_eff": attn_eff, "rows": rows, "summary": s, "leave_one_out": list(loo.values()),
            "leave_one_out_summary": loo_s, "held_out": held}
    return "\n".join(lines), data


def print_h100_validation(json_path: str | None = None, plot_path: str | None = None) -> int:
    text, data = h100_report()
    print(text)
    write_json(json_path, data)
    if plot_path:
        from shardlab.plan.plot import plot_agreement

        points = [(r["case"], r["published_s"], r["predicted_s"]) for r in data["rows"] + [data["held_out"]]]
        print(f"wrote {plot_agreement(points, plot_path, 'H100: NeMo 24.07 table and Llama 3 405B', 's', 0.1)}")
    return 0


def print_comm_validation(json_path: str | None = None) -> int:
    rows = comm_rows()
    print("Collectives: predicted vs published (nccl-tests busbw at 8 GiB; TPU all-gathers of How to Scale Your "
          "Model); nothing fitted")
    print(format_comm(rows))
    for r in rows:
        print(f"  {r['case']}: {r['source']}" + (f" ({r['note']})" if r["note"] else ""))
    write_json(json_path, {"rows": rows})
    return 0
