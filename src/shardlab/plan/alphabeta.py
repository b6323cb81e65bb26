"""The alpha-beta (latency-bandwidth) model of a collective, fitted to benchmark measurements.

    time(bytes, n) = steps(n) * alpha + traffic(n) * bytes / beta

alpha is the fixed cost of one communication step (seconds), beta the bandwidth (bytes/s) at which
a rank moves data, steps(n) and traffic(n) come from the algorithm: how many sequential rounds of
messages it takes and how many bytes each rank sends, as a multiple of the message size (the
nccl-tests size, the whole buffer for all_gather/reduce_scatter/all_to_all).

    fits = fit_rows(rows)                  # one AlphaBeta per (op, impl, world size, dtype)
    fits[0].predict(64 * 2**20, 8)         # seconds for 64 MiB on 8 ranks, by that algorithm
    save_fits(fits, "fits.json"); load_fits("fits.json")

The gloo backend ("torch") does not say which algorithm it runs; its costs are assumed ring-like
(ring all_reduce, ring reduce_scatter/all_gather, pairwise all_to_all, a pipelined chain for
broadcast/reduce) and the fit says `assumed: true`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable, Iterable, Sequence


def _log2(n: int) -> int:
    return 0 if n <= 1 else math.ceil(math.log2(n))


def _nodes(n: int) -> tuple[int, int]:
    """(ranks per node p, nodes m) of the hierarchical all-reduce: ceil(n/2) per node unless
    SHARDLAB_RANKS_PER_NODE says otherwise, as shardlab.comm.algorithms.hierarchical decides."""
    try:  # lazy, and optional: this arithmetic needs no torch until it asks comm/ for the rule
        from shardlab.comm.algorithms.hierarchical import resolve_ranks_per_node

        p = resolve_ranks_per_node(n)
    except ImportError:
        p = max(1, math.ceil(n / 2))
    return p, math.ceil(n / p)


def _hier_steps(n: int) -> float:
    p, m = _nodes(n)
    return 2 * (p - 1) + 2 * (m - 1)


def _hier_traffic(n: int) -> float:
    # Ring reduce-scatter and all-gather in the node, ring all-reduce of 1/p of the data across nodes.
    p, m = _nodes(n)
    return 2 * (p - 1) / p + 2 * (m - 1) / (m * p)


@dataclass(frozen=True)
class CostModel:
    """How an algorithm's cost grows with the group size n."""

    name: str
    steps: Callable[[int], float]      # sequential communication rounds
    traffic: Callable[[int], float]    # bytes each rank sends, as a multiple of the message size
    formula: str                       # the two above, for people


MODELS: dict[str, CostModel] = {m.name: m for m in [
    CostModel("ring_all_reduce", lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n,
              "2(n-1) alpha + 2(n-1)/n S/beta"),
    CostModel("ring", lambda n: n - 1, lambda n: (n - 1) / n, "(n-1) alpha + (n-1)/n S/beta"),
    CostModel("tree", _log2, _log2, "ceil(log2 n) (alpha + S/beta)"),
    CostModel("tree_all_reduce", lambda n: 2 * _log2(n), lambda n: 2 * _log2(n), "2 ceil(log2 n) (alpha + S/beta)"),
    CostModel("rd_all_reduce", lambda n: 2 * _log2(n), lambda n: 2 * (n - 1) / n,
              "2 log2(n) alpha + 2(n-1)/n S/beta"),
    CostModel("rd", _log2, lambda n: (n - 1) / n, "log2(n) alpha + (n-1)/n S/beta"),
    CostModel("pairwise", lambda n: n - 1, lambda n: (n - 1) / n, "(n-1) alpha + (n-1)/n S/beta"),
    CostModel("chain", lambda n: n - 1, lambda n: 1.0, "(n-1) alpha + S/beta"),
    CostModel("p2p", lambda n: 1, lambda n: 1.0, "alpha + S/beta"),
    CostModel("hierarchical", _hier_steps, _hier_traffic,
              "(2(p-1) + 2(m-1)) alpha + (2(p-1)/p + 2(m-1)/(mp)) S/beta, p ranks per node, m nodes"),
]}

# Which model each (impl, op) follows. Ours are known from the code; others fall back to _ASSUMED.
_KNOWN: dict[tuple[str, str], str] = {
    ("ring", "all_reduce"): "ring_all_reduce",
    ("ring", "reduce_scatter"): "ring",
    ("ring", "all_gather"): "ring",
    ("tree", "broadcast"): "tree",
    ("tree", "reduce"): "tree",
    ("tree", "all_reduce"): "tree_all_reduce",
    ("rd", "all_reduce"): "rd_all_reduce",
    ("rd", "all_gather"): "rd",
    ("rd", "reduce_scatter"): "rd",
    ("pairwise", "all_to_all"): "pairwise",
    ("hierarchical", "all_reduce"): "hierarchical",
}
# The backend's algorithm is not visible: assume ring-like costs.
_ASSUMED: dict[str, str] = {
    "all_reduce": "ring_all_reduce",
    "reduce_scatter": "ring",
    "all_gather": "ring",
    "all_to_all": "pairwise",
    "broadcast": "chain",
    "reduce": "chain",
    "sendrecv": "p2p",
}


def model_for(op: str, impl: str) -> tuple[CostModel, bool]:
    """The cost model of `impl` running `op`, and whether it is an assumption rather than known."""
    if op == "sendrecv":
        return MODELS["p2p"], False
    name = _KNOWN.get((impl, op))
    if name is not None:
        return MODELS[name], False
    if op not in _ASSUMED:
        raise ValueError(f"no cost model for op {op!r}")
    return MODELS[_ASSUMED[op]], True


@dataclass
class AlphaBeta:
    """A fitted latency-bandwidth model of one (op, impl) measured at one world size and dtype."""

    op: str
    impl: str
    world_size: int
    dtype: str
    model: str
    alpha_s: float               # seconds per step
    beta_bytes_per_s: float      # bytes per second per rank (inf when the data fits no bandwidth term)
    assumed: bool = False
    points: int = 0
    rel_err_median: float = 0.0
    rel_err_max: float = 0.0
    sizes: list[int] = field(default_factory=list)

    @property
    def cost(self) -> CostModel:
        return MODELS[self.model]

    def predict(self, nbytes: float, world_size: int | None = None) -> float:
        """Seconds for a message of `nbytes` (the nccl-tests size) on `world_size` ranks (default: as fitted)."""
        n = self.world_size if world_size is None else world_size
        bw_term = 0.0 if math.isinf(self.beta_bytes_per_s) else self.cost.traffic(n) * nbytes / self.beta_bytes_per_s
        return self.cost.steps(n) * self.alpha_s + bw_term

    def to_dict(self) -> dict:
        d = asdict(self)
        d["alpha_us"] = self.alpha_s * 1e6
        finite = math.isfinite(self.beta_bytes_per_s)
        d["beta_gbps"] = self.beta_bytes_per_s / 1e9 if finite else None
        d["beta_bytes_per_s"] = self.beta_bytes_per_s if finite else None  # JSON has no infinity
        d["formula"] = self.cost.formula
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "AlphaBeta":
        beta = d.get("beta_bytes_per_s")
        if beta is None and d.get("beta_gbps") is not None:
            beta = d["beta_gbps"] * 1e9
        alpha = d["alpha_s"] if "alpha_s" in d else d["alpha_us"] * 1e-6
        return cls(
            op=d["op"], impl=d["impl"], world_size=int(d["world_size"]), dtype=d["dtype"], model=d["model"],
            alpha_s=float(alpha), beta_bytes_per_s=math.inf if beta is None else float(beta),
            assumed=bool(d.get("assumed", False)), points=int(d.get("points", 0)),
            rel_err_median=float(d.get("rel_err_median", 0.0)), rel_err_max=float(d.get("rel_err_max", 0.0)),
            sizes=list(d.get("sizes", [])),
        )

    def save(self, path: str | Path) -> None:
        save_fits([self], path)

    @classmethod
    def load(cls, path: str | Path) -> "AlphaBeta":
        fits = load_fits(path)
        if len(fits) != 1:
            raise ValueError(f"{path} holds {len(fits)} fits; use load_fits to read them all")
        return fits[0]


def save_fits(fits: Sequence[AlphaBeta], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"fits": [f.to_dict() for f in fits]}, indent=2) + "\n")


def first_nonfinite(value: object, where: str = "") -> str | None:
    """The JSON path of the first nan or inf number in `value` (JSON reads NaN and Infinity), or None:
    a measured rate that is nan would rank layouts by nan times."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'the value'} = {value}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = first_nonfinite(item, f"{where}[{key!r}]" if isinstance(key, int) else f"{where}.{key}".lstrip("."))
        if found:
            return found
    return None


def load_fits(path: str | Path) -> list[AlphaBeta]:
    """Fits from a file written by save_fits or by `shardlab bench comm --json` (its "fits" key)."""
    data = json.loads(Path(path).read_text())
    bad = first_nonfinite(data)
    if bad:
        raise ValueError(f"{path}: {bad} is not a finite number")
    items = data["fits"] if isinstance(data, dict) else data
    return [AlphaBeta.from_dict(d) for d in items]


# --------------------------------------------------------------------------------------- fitting
def nnls2(a: Sequence[Sequence[float]], b: Sequence[float]) -> tuple[float, float]:
    """Least squares for two non-negative unknowns: min |A x - b|^2 with x >= 0.

    With two unknowns the optimum is either the unconstrained solution (when it is non-negative) or
    lies on an axis, so trying the three candidates is exact; no solver library needed.
    """
    # Scale the columns to unit norm first: seconds-per-step and seconds-per-byte differ by ~1e9,
    # which would cost the normal equations most of their precision. Scaling keeps x >= 0 intact.
    norms = [math.sqrt(sum(r[j] * r[j] for r in a)) or 1.0 for j in (0, 1)]
    a = [(r[0] / norms[0], r[1] / norms[1]) for r in a]
    x = _nnls2_scaled(a, b)
    return x[0] / norms[0], x[1] / norms[1]


def _nnls2_scaled(a: Sequence[Sequence[float]], b: Sequence[float]) -> tuple[float, float]:
    s11 = sum(r[0] * r[0] for r in a)
    s12 = sum(r[0] * r[1] for r in a)
    s22 = sum(r[1] * r[1] for r in a)
    t1 = sum(r[0] * y for r, y in zip(a, b))
    t2 = sum(r[1] * y for r, y in zip(a, b))
    candidates = []
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * max(s11 * s22, 1e-300):
        x = ((s22 * t1 - s12 * t2) / det, (s11 * t2 - s12 * t1) / det)
        if x[0] >= 0 and x[1] >= 0:
            return x
    if s11 > 0:
        candidates.append((max(0.0, t1 / s11), 0.0))
    if s22 > 0:
        candidates.append((0.0, max(0.0, t2 / s22)))
    candidates.append((0.0, 0.0))

    def residual(x: tuple[float, float]) -> float:
        return sum((r[0] * x[0] + r[1] * x[1] - y) ** 2 for r, y in zip(a, b))
    return min(candidates, key=residual)


def fit(op: str, impl: str, world_size: int, dtype: str, sizes: Sequence[float], times_s: Sequence[float]) -> AlphaBeta:
    """Fit alpha and beta to measured (bytes, seconds) points of one (op, impl, world size, dtype).

    The residuals are relative (each equation divided by its measured time): the sizes span six orders
    of magnitude, and plain least squares would fit the largest messages and ignore the latency end.
    """
    if len(sizes) != len(times_s) or len(sizes) < 2:
        raise ValueError("a fit needs at least two (size, time) points")
    cost, assumed = model_for(op, impl)
    n = world_size
    rows = [[cost.steps(n) / t, cost.traffic(n) * s / t] for s, t in zip(sizes, times_s)]
    alpha, inv_beta = nnls2(rows, [1.0] * len(sizes))
    result = AlphaBeta(op, impl, world_size, dtype, cost.name, alpha, 1.0 / inv_beta if inv_beta > 0 else math.inf,
                       assumed=assumed, points=len(sizes), sizes=[int(s) for s in sizes])
    errors = [abs(result.predict(s) - t) / t for s, t in zip(sizes, times_s)]
    result.rel_err_median = median(errors)
    result.rel_err_max = max(errors)
    return result


def fit_rows(rows: Iterable[dict], time_key: str = "time_us") -> list[AlphaBeta]:
    """One fit per (op, impl, world_size, dtype) of benchmark rows with at least two sizes.

    A world of one moves no data between ranks: there is nothing to fit, so it is left out.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["world_size"] < 2:
            continue
        groups.setdefault((r["op"], r["impl"], r["world_size"], r["dtype"]), []).append(r)
    fits = []
    for (op, impl, n, dtype), group in groups.items():
        group = sorted((r for r in group if r[time_key] and r[time_key] > 0), key=lambda r: r["bytes"])
        if len({r["bytes"] for r in group}) < 2:
            continue
        fits.append(fit(op, impl, n, dtype, [r["bytes"] for r in group], [r[time_key] * 1e-6 for r in group]))
    return fits


def format_fits(fits: Sequence[AlphaBeta]) -> str:
    """A table of fits: alpha, beta and how well the line matches the measurements."""
    if not fits:
        return "alpha-beta fits: none (each needs at least two message sizes and two ranks)"
    head = f"{'op':<15}{'impl':<13}{'ws':>3} {'dtype':<9}{'model':<16}{'alpha_us':>10}{'beta_GB/s':>11}" \
           f"{'err_med':>9}{'err_max':>9}"
    lines = ["alpha-beta fits: time = steps(n) alpha + traffic(n) bytes / beta  (relative least squares, x >= 0)",
             head, "-" * len(head)]
    for f in fits:
        beta = "inf" if math.isinf(f.beta_bytes_per_s) else f"{f.beta_bytes_per_s / 1e9:.3f}"
        mark = "*" if f.assumed else ""
        lines.append(f"{f.op:<15}{f.impl:<13}{f.world_size:>3} {f.dtype:<9}{f.model + mark:<16}"
                     f"{f.alpha_s * 1e6:>10.1f}{beta:>11}{f.rel_err_median:>8.0%} {f.rel_err_max:>8.0%}")
    if any(f.assumed for f in fits):
        lines.append("* model assumed: the backend does not say which algorithm it runs (gloo: ring-like costs)")
    return "\n".join(lines)
