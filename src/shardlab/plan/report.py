"""What `shardlab plan` prints and writes: the ranked table, one layout's breakdown, the reasons.

    print(format_ranked(result, top=10))
    print("\\n".join(explain(result, spec, gpus)))
    json.dump(result_json(result, spec, hw, gpus, global_batch), f)
"""

from __future__ import annotations

from dataclasses import asdict

from shardlab.plan.hardware import Hardware
from shardlab.plan.models import ModelSpec
from shardlab.plan.search import Evaluation, SearchResult
from shardlab.plan.stack_use import StackUse

GB = 1e9


def _gb(n: float) -> str:
    """Bytes as GB, or MB below 1 GB (shardlab's own models on this machine)."""
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.2f} MB"
_PARTS = ("compute", "tp/cp/ep comm", "pipeline p2p", "bubble", "dp comm", "optimizer", "stragglers", "host overhead")


def _range(t, use: StackUse | None) -> str:
    """The MFU's range under the stack's interval (capped at the record; '!' where the point passes it)."""
    if use is None or not use.interval.known:
        return ""
    lo, hi, flags = use.mfu_range(t.mfu_causal)
    scale = t.mfu / t.mfu_causal if t.mfu_causal else 1.0    # the range in the column's own convention
    return f"{lo * scale * 100:.0f}-{hi * scale * 100:.0f}%" + ("!" if any(f.startswith("ABOVE") for f in flags) else "")


def _row(i: int | str, e: Evaluation, use: StackUse | None = None) -> str:
    t = e.time
    mem = f"{e.memory.total / GB:7.1f}/{e.capacity / GB:.0f}"
    if t is None:
        return f"{i!s:>4}  {e.layout.name():<44}{mem:>11}"
    shares = t.breakdown()
    top = " ".join(f"{k.split()[0]} {shares[k] * 100:.0f}%" for k in ("tp/cp/ep comm", "bubble", "dp comm")
                   if shares[k] >= 0.005)
    return (f"{i!s:>4}  {e.layout.name():<44}{mem:>11}{t.total_s:>9.3f}{t.tokens_per_s:>12,.0f}"
            f"{t.mfu * 100:>6.1f}%{_range(t, use):>9}  {top}")


def header() -> str:
    return (f"{'rank':>4}  {'layout':<44}{'mem GB':>11}{'step s':>9}{'tokens/s':>12}{'MFU':>7}{'range':>9}"
            f"  exposed overheads")


def format_ranked(result: SearchResult, top: int = 10, use: StackUse | None = None) -> str:
    lines = [header(), "-" * 119]
    lines += [_row(i + 1, e, use) for i, e in enumerate(result.ranked[:top])]
    return "\n".join(lines)


def prediction_lines(e: Evaluation, use: StackUse | None) -> list[str]:
    """The step, tokens/s and MFU with the stack's interval, and the record's flags."""
    t = e.time
    if use is None or t is None:
        return []
    if not use.interval.known:
        return [f"prediction ({use.stack}): step {t.total_s:.4g} s, {t.tokens_per_s:,.0f} tokens/s, MFU "
                f"{t.mfu_causal:.1%}: NO INTERVAL ({use.interval.flag})"]
    s_lo, s_hi = use.interval.step_range(t.total_s)
    k_lo, k_hi = use.interval.rate_range(t.tokens_per_s)
    m_lo, m_hi, flags = use.mfu_range(t.mfu_causal)
    out = [f"prediction ({use.stack} on {use.generation}): step {t.total_s:.4g} s ({s_lo:.4g}-{s_hi:.4g}), "
           f"{t.tokens_per_s:,.0f} tokens/s ({k_lo:,.0f}-{k_hi:,.0f}), MFU {t.mfu_causal:.1%} "
           f"({m_lo:.1%}-{m_hi:.1%}; causal attention as half, bf16 peak)"]
    out += [f"  {f}" for f in flags]
    return out


def format_one(e: Evaluation, use: StackUse | None = None) -> str:
    """One layout in full: memory by kind and time by component."""
    m, t = e.memory, e.time
    lines = [header(), "-" * 119, _row("-", e, use), "",
             f"memory per rank (busiest: pipeline stage {m.stage}, peak at {m.peak_at}):",
             f"  parameters {_gb(m.params)}   gradients {_gb(m.grads)}   optimizer {_gb(m.optimizer)}   "
             f"activations {_gb(m.activations)}   buffers {_gb(m.buffers)}   total {_gb(m.total)} of "
             f"{_gb(e.capacity)} usable: " + ("fits" if e.fits else "DOES NOT FIT")]
    if t is not None:
        shares = t.breakdown()
        lines += [f"time per step {t.total_s:.4g} s ({t.micro_batches} micro-batches; MFU {t.mfu * 100:.1f}%, "
                  f"HFU {t.hfu * 100:.1f}%):",
                  "  " + "   ".join(f"{k} {shares[k] * 100:.1f}%" for k in _PARTS if k != "host overhead" or t.host_s),
                  f"  communication hidden behind compute: {t.comm_hidden_s:.3g} s tp/cp/ep, "
                  f"{t.dp_comm_total_s - t.dp_comm_s:.3g} s data-parallel"]
        lines += prediction_lines(e, use)
    return "\n".join(lines)


def _shape(e: Evaluation) -> tuple:
    lay = e.layout
    return (lay.tp, lay.pp, lay.cp, lay.ep)


def _components(e: Evaluation) -> dict[str, float]:
    t = e.time
    return {"compute": t.compute_s, "tp/cp/ep comm": t.comm_exposed_s, "pipeline p2p": t.p2p_s,
            "bubble": t.bubble_s, "dp comm": t.dp_comm_s, "optimizer": t.optimizer_s, "stragglers": t.stragglers_s,
            "host overhead": t.host_s}


def ties(result: SearchResult, use: StackUse | None) -> list[str]:
    """How many layouts the stack's interval cannot tell from the fastest (its tie rule)."""
    if len(result.ranked) < 2 or use is None:
        return []
    if not use.interval.known:
        return [f"Ties cannot be judged: {use.interval.flag}; the ranking is the model's alone."]
    tie = use.interval.tie
    close = sum(1 for e in result.ranked if e.time.total_s <= (1 + tie) * result.ranked[0].time.total_s)
    return [f"{close} layout(s) are within {tie:.1%} of the fastest, the half-width of {use.stack}'s interval on "
            f"{use.generation}: treat them as ties and choose among them by other needs."]


def explain(result: SearchResult, spec: ModelSpec, gpus: int, alternatives: int = 3,
            use: StackUse | None = None) -> list[str]:
    """Why the top layout wins (against the fastest layout of each other parallel shape) and why
    the simple layouts do not fit."""
    out: list[str] = ties(result, use)
    if result.ranked:
        out += prediction_lines(result.ranked[0], use)
    if not result.ranked and not (result.misses or result.refused):  # nothing got as far as its memory
        out.append(f"No layout of {spec.name} on {gpus} devices can be built: every combination was refused "
                   f"before its memory was counted (below).")
    elif not result.ranked:
        out.append(f"No layout of {spec.name} on {gpus} devices fits in memory.")
    else:
        best = result.ranked[0]
        t = best.time
        shares = t.breakdown()
        out.append(f"Why {best.layout.name()} wins: " + ", ".join(f"{k} {shares[k] * 100:.1f}%" for k in _PARTS
                                                                    if shares[k] >= 0.001) + " of its step.")
        seen = {_shape(best)}
        for e in result.ranked[1:]:
            if len(seen) > alternatives:
                break
            if _shape(e) in seen:
                continue
            seen.add(_shape(e))
            a, b = _components(best), _components(e)
            worse = sorted(((b[k] - a[k], k) for k in a), reverse=True)
            why = ", ".join(f"{k} +{d:.3g} s" for d, k in worse if d > 0.002 * t.total_s)[:140]
            better = ", ".join(f"{k} {-d:.3g} s" for d, k in sorted(worse) if d < -0.002 * t.total_s)[:100]
            out.append(f"  vs {e.layout.name()} ({e.time.total_s / t.total_s - 1:+.1%} time): {why or 'about equal'}"
                       + (f"; it saves {better}" if better else ""))
    out += _misses(result, gpus)
    if result.rejected:
        common = "; ".join(f"{reason} ({n})" for reason, n in result.rejected.most_common(4))
        out.append(f"Not built ({sum(result.rejected.values())} combinations): {common}.")
    if result.refused:
        common = "; ".join(f"{reason} ({n})" for reason, n in result.refused.most_common(4))
        out.append(f"Refused by the trainer's rules (train/config_check.py; {sum(result.refused.values())} of the "
                   f"{result.checked} checked; --any-layout ranks them too): {common}.")
    return out


def _misses(result: SearchResult, gpus: int) -> list[str]:
    if not result.misses and not result.ranked:
        return []
    if not result.misses:
        return [f"Every parallel shape has some layout that fits ({len(result.ranked)} fit)."]
    lines = [f"{len(result.misses)} (degrees, ZeRO, recompute) combinations do not fit; for example:"]
    picks = []
    most_dp = max(e.layout.dp for e in result.misses.values())   # the most data-parallel shape tried
    pure = [e for e in result.misses.values() if e.layout.dp == most_dp]
    picks += sorted(pure, key=lambda e: (e.layout.recompute != "none", e.layout.zero))[:1]
    picks += sorted(pure, key=lambda e: e.memory.total)[:1]
    if result.ranked:
        top = result.ranked[0].layout
        same = [e for e in result.misses.values() if _shape(e) == (top.tp, top.pp, top.cp, top.ep)]
        picks += sorted(same, key=lambda e: -e.memory.total)[:2]
    picks += sorted(result.misses.values(), key=lambda e: e.memory.total)[:1]   # the closest miss
    for e in {id(e): e for e in picks}.values():
        m = e.memory
        parts = {"model state": m.model_state, "activations": m.activations, "buffers": m.buffers}
        big = max(parts, key=parts.get)
        lines.append(f"  {e.layout.name()}: {m.total / GB:.1f} GB > {e.capacity / GB:.0f} GB usable "
                     f"({big} {parts[big] / GB:.1f} GB)")
    return lines


def result_json(result: SearchResult, spec: ModelSpec, hw: Hardware, gpus: int, global_batch: int,
                top: int = 50, use: StackUse | None = None) -> dict:
    return {"stack": use.to_dict() if use else None,
        "tool": "shardlab plan", "model": asdict(spec), "params": spec.params(), "hardware": hw.to_dict(),
        "gpus": gpus, "global_batch": global_batch, "considered": result.considered, "fitting": len(result.ranked),
        "ranked": [e.to_dict() for e in result.ranked[:top]],
        "misses": [e.to_dict() for e in sorted(result.misses.values(), key=lambda e: e.memory.total)[:top]],
        "rejected": dict(result.rejected), "refused_by_trainer": dict(result.refused),
        "checked_by_trainer": result.checked, "fitting_before_trainer": result.fitting,
        "explanation": explain(result, spec, gpus, use=use),
    }
