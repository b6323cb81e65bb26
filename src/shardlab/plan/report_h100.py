"""`shardlab plan --validate-h100` and `--validate-comm`: the H100 and communication validation
tables as text, JSON and a PNG (docs/planner.md's tables)."""

from __future__ import annotations

from shardlab.plan.hardware import HOPPER_KERNELS, get_hardware
from shardlab.plan.plot import plot_agreement
from shardlab.plan.published_bf16 import FOUNDRY_H100, LLAMA3_H100
from shardlab.plan.published_h100 import LLAMA3_405B
from shardlab.plan.validate_bf16 import bf16_rows, fit_stack, leave_one_out as bf16_loo, summary as bf16_summary
from shardlab.plan.validate_comm import comm_rows, format_comm
from shardlab.plan.validate_gpu import H100_RUN, H200_RUN, MEASURED_H100, gpu_rows, trainer_overhead_s
from shardlab.plan.validate_h100 import calibrate, fitted_names, h100_rows, leave_one_out, summary
from shardlab.plan.validate_report import write_json


def h100_report() -> tuple[str, dict]:
    base = get_hardware("h100-sxm")
    hw, values = calibrate(base)
    fitted = dict(zip(fitted_names(base), values))
    rows = h100_rows(hw)
    loo = {r["case"]: r for r in leave_one_out(base)}
    held = h100_rows(base, [LLAMA3_405B])[0]
    head = (f"{'case':<22}{'gpus':>6}  {'layout':<36}{'pub s':>8}{'pred s':>8}{'error':>8}{'LOO':>8}"
            f"{'MFU pub full/causal':>21}{'MFU pred full/causal':>22}{'mem GB':>8}")
    lines = ["NeMo Framework 24.07, DGX-H100, fp8: step time from tokens/s/GPU; fitted "
             + ", ".join(f"{k} {v:.3f}" for k, v in fitted.items())
             + f" (preset fp8_frac {HOPPER_KERNELS.fp8_frac}; the scales are NeMo's stack relative to the profiled "
               f"H200 kernels); MFU against the bf16 dense peak (989 TFLOP/s), attention counted whole (NeMo's "
               f"convention) / causal half", head, "-" * len(head)]
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
              f"({s['worst_case']}); leave-one-out (all three numbers refitted without the case): mean "
              f"{loo_s['mae'] * 100:.1f}%, largest {loo_s['max_abs_error'] * 100:.1f}%",
              f"held out: {held['case']} ({held['layout']}), the preset as it is: predicted {held['predicted_s']:.2f} s "
              f"vs {held['published_s']:.2f} s ({held['error'] * 100:+.1f}%), {held['memory_gb']:.1f} GB per GPU: "
              + ("fits" if held["fits"] else "DOES NOT FIT")]
    data = {"fitted": fitted, "rows": rows, "summary": s, "leave_one_out": list(loo.values()),
            "leave_one_out_summary": loo_s, "held_out": held}
    return "\n".join(lines), data


def bf16_report() -> tuple[str, dict]:
    """llm-foundry's H100 bf16 table (the stack's scales leave-one-out) and Llama 3's Table 4 (nothing
    fitted)."""
    base = get_hardware("h100-sxm")
    _, scales = fit_stack(base, FOUNDRY_H100)
    raw = bf16_rows(base, FOUNDRY_H100)
    loo = bf16_loo(base, FOUNDRY_H100)
    llama = bf16_rows(base, LLAMA3_H100)
    head = f"{'case':<34}{'layout':<26}{'pub s':>9}{'pred s':>9}{'LOO':>8}{'raw':>8}{'MFU pub/pred':>14}{'mem GB':>8}"
    lines = ["llm-foundry MPT table, H100 80GB bf16 (2023, FSDP): each row predicted with the stack's GEMM and "
             f"attention scales fitted to the other rows (all rows: {scales}); raw: the preset's kernels as profiled",
             head, "-" * len(head)]
    for r, q in zip(loo, raw):
        lines.append(f"{r['case']:<34}{r['layout'][:25]:<26}{r['published_s']:>9.3f}{r['predicted_s']:>9.3f}"
                     f"{r['error'] * 100:>+7.1f}%{q['error'] * 100:>+7.1f}%"
                     f"{r['published_mfu'] * 100:>8.1f}/{r['predicted_mfu_full_attention'] * 100:.1f}%"
                     f"{r['memory_gb']:>7.1f}{'' if r['fits'] else '!'}")
    s, sr = bf16_summary(loo), bf16_summary(raw)
    lines += [f"leave-one-out: mean {s['mae'] * 100:.1f}%, largest {s['max_abs_error'] * 100:.1f}% ({s['worst_case']}), "
              f"{s['within_20']}/{s['cases']} within 20%; raw (no stack scales): mean {sr['mae'] * 100:.1f}%",
              "", "Llama 3 405B, Table 4 (H100 80GB bf16; the preset as it is, nothing fitted):"]
    for r in llama:
        lines.append(f"{r['case']:<34}{r['layout'][:25]:<26}{r['published_s']:>9.2f}{r['predicted_s']:>9.2f}"
                     f"{r['error'] * 100:>+7.1f}%{'':>8}{r['published_mfu'] * 100:>8.1f}/"
                     f"{r['predicted_mfu_full_attention'] * 100:.1f}%{r['memory_gb']:>7.1f}"
                     + ("" if r["fits"] else "!") + ("" if r["in_mean"] else "  (FLOP convention open: not in the mean)"))
    held = [r for r in loo + llama if r["in_mean"]]
    errs = [abs(r["error"]) for r in held]
    total = {"cases": len(held), "mae": sum(errs) / len(errs), "max_abs_error": max(errs),
             "refused": 0, "does_not_fit": sum(not r["fits"] for r in loo + llama)}
    lines.append(f"all bf16 rows not fitted to ({total['cases']}): mean {total['mae'] * 100:.1f}%, largest "
                 f"{total['max_abs_error'] * 100:.1f}%; layouts refused 0, judged 'does not fit' {total['does_not_fit']}")
    return "\n".join(lines), {"stack_scales": scales, "foundry_leave_one_out": loo, "foundry_raw": raw,
                              "llama3": llama, "summary": total}


def gpu_report() -> tuple[str, dict]:
    hw = get_hardware("h200")
    rows = gpu_rows(hw)
    lines = [f"One GPU measured ({H200_RUN}): GPT-2 medium's shape, batch 16 x 1024, bf16 autocast; the planner "
             f"times the kernels (constants fitted to the compiled stand-alone step's profile)",
             f"{'what ran':<32}{'measured ms':>12}{'planner ms':>12}{'error':>8}{'beyond the kernels':>20}"]
    for r in rows:
        lines.append(f"{r['case']:<32}{r['measured_s'] * 1e3:>12.1f}{r['predicted_s'] * 1e3:>12.1f}"
                     f"{r['error'] * 100:>+7.1f}%{r['beyond_kernels_s'] * 1e3:>17.1f} ms")
    lines.append(f"shardlab train's own overhead on that GPU: {trainer_overhead_s(hw) * 1e3:.0f} ms per step "
                 f"(--step-overhead-ms to include it)")
    h100 = gpu_rows(get_hardware("h100-sxm"), MEASURED_H100)
    lines.append(f"held out: the same stand-alone step on {H100_RUN}, nothing of it fitted:")
    for r in h100:
        lines.append(f"{r['case']:<32}{r['measured_s'] * 1e3:>12.1f}{r['predicted_s'] * 1e3:>12.1f}"
                     f"{r['error'] * 100:>+7.1f}%{r['beyond_kernels_s'] * 1e3:>17.1f} ms")
    return "\n".join(lines), {"rows": rows, "h100_held_out": h100}


def print_h100_validation(json_path: str | None = None, plot_path: str | None = None) -> int:
    text, data = h100_report()
    print(text)
    print()
    text_bf16, data_bf16 = bf16_report()
    print(text_bf16)
    print()
    text_gpu, data_gpu = gpu_report()
    print(text_gpu)
    write_json(json_path, {**data, "bf16": data_bf16, "one_gpu": data_gpu})
    if plot_path:
        points = [(r["case"], r["published_s"], r["predicted_s"]) for r in data["rows"] + [data["held_out"]]]
        points += [(r["case"], r["published_s"], r["predicted_s"])
                   for r in data_bf16["foundry_leave_one_out"] + data_bf16["llama3"]]
        print(f"wrote {plot_agreement(points, plot_path, 'H100: NeMo fp8, llm-foundry and Llama 3 bf16', 's', 0.1)}")
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
