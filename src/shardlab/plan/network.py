"""A cluster's network as levels, and what a collective costs on the levels its group spans.

    net = (Level("nvswitch", 8, "switch", 450e9, 5e-6, in_network_reduction=True),
           Level("ib-ndr", 0, "fat-tree", 50e9, 10e-6))          # 0: the rest of the cluster
    collective_seconds(net, "all_reduce", nbytes, size=16, stride=1)

Ranks fill the levels innermost first (tp fastest, layout.py), so a group of `size` ranks `stride`
apart has, at each level, a factor f_i: how many of its members differ at that level (the f_i
multiply to `size`). Torus levels expand into their axes, each a ring with or without wrap-around.

Cost of a collective, per level (alpha-beta, Hockney 1994), hierarchically (Thakur et al. 2005):
a reduce-scatter runs level by level from the innermost on a buffer 1/f_j smaller each level, an
all-gather the other way, an all-reduce is both. NCCL pipelines the levels (its channels run
NVLink and the NICs at once), so the bandwidth term is the SLOWEST level's, while latencies add:

    switch / fat-tree   (f-1)/f x D / (b x eff)            (fat-tree: b / oversubscription)
                        in-network reduction (NVLink SHARP) all-reduce: D / (b x eff)
    torus (its spanned  (F-1)/F x D / (b x eff x sum over axes of 2 with wrap-around, 1 without))
      axes together)    a bidirectional ring uses both directions of every axis it spans
                        (How to Scale Your Model, "Sharded Matrices": T = V / (W_ici x n_axes))
    latency             switch: f - 1 steps; torus: f/2 hops per wrapped axis, f - 1 without

b is the per-device bandwidth in one direction (a torus: per link), D the data at that level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

KINDS = ("switch", "fat-tree", "nvlink-switch", "ring", "torus")


@dataclass(frozen=True)
class Level:
    name: str
    size: int                       # units of the level below in one unit of this; 0: the rest of the cluster
    kind: str                       # KINDS
    bandwidth: float                # bytes/s per device (torus, ring: per link), one direction
    latency: float                  # seconds per step (hop)
    efficiency: float = 0.0         # achievable share of the bandwidth (0: the hardware's link_eff)
    oversubscription: float = 1.0   # fat-tree: bandwidth above the leaf switches divided by this
    dims: tuple[int, ...] = ()      # torus: axis lengths (their product is `size`)
    wrap: tuple[bool, ...] = ()     # torus: wrap-around link per axis
    in_network_reduction: bool = False  # the switch reduces (NVLink SHARP): all-reduce moves D once each way
    ndim: int = 0                   # torus sized to the cluster (size 0): its number of axes
    wrap_multiple: int = 1          # torus sized to the cluster: an axis wraps around when its length is a multiple

    def __post_init__(self) -> None:
        if self.kind == "torus" and self.size == 0 and self.ndim:
            return                      # shaped later by resolve(), when the device count is known
        if self.kind not in KINDS:
            raise ValueError(f"level {self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not (0 < self.bandwidth < math.inf and 0 <= self.latency < math.inf and 0 <= self.efficiency <= 1
                and 0 < self.oversubscription < math.inf):
            raise ValueError(f"level {self.name}: bandwidth must be > 0, latency >= 0, efficiency in [0, 1] "
                             f"(0: the hardware's), oversubscription > 0, all finite; got {self.bandwidth}, "
                             f"{self.latency}, {self.efficiency}, {self.oversubscription}")
        if self.kind == "torus" and (len(self.dims) != len(self.wrap) or math.prod(self.dims) != self.size):
            raise ValueError(f"level {self.name}: a torus needs dims multiplying to its size {self.size} "
                             f"and a wrap flag per axis, got {self.dims} and {self.wrap}")

    def describe(self) -> str:
        shape = "x".join(map(str, self.dims)) if self.dims else (str(self.size) if self.size else "rest")
        extra = f", wrap {''.join('y' if w else 'n' for w in self.wrap)}" if self.dims else ""
        extra += f", 1:{self.oversubscription:g} oversubscribed" if self.oversubscription != 1 else ""
        extra += ", in-network reduction" if self.in_network_reduction else ""
        return (f"{self.name} ({self.kind} {shape}, {self.bandwidth / 1e9:g} GB/s per "
                f"{'link' if self.kind in ('torus', 'ring') else 'device'} per direction, "
                f"{self.latency * 1e6:g} us{extra})")


def torus_dims(n: int, ndim: int) -> tuple[int, ...]:
    """A slice of n chips (a power of two) as ndim axes, as near a cube as powers of two allow,
    the longer axes last (256 chips: 16x16 in 2D, 4x8x8 in 3D)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a TPU slice has a power-of-two number of chips, not {n}")
    dims = [1] * ndim
    bits, i = n.bit_length() - 1, ndim - 1
    for _ in range(bits):
        dims[i] *= 2
        i = i - 1 if i > 0 else ndim - 1
    return tuple(sorted(dims))


def resolve(net: tuple[Level, ...], world: int) -> tuple[Level, ...]:
    """The network with any cluster-sized torus shaped for `world` devices (wrap-around on the
    axes whose length is a multiple of the level's wrap_multiple)."""
    out, below = [], 1
    for lv in net:
        if lv.kind == "torus" and lv.size == 0:
            dims = torus_dims(max(1, world // below), lv.ndim)
            wrap = tuple(d > 2 and d % lv.wrap_multiple == 0 for d in dims)
            lv = replace(lv, size=math.prod(dims), dims=dims, wrap=wrap)
        out.append(lv)
        below *= lv.size or 1
    return tuple(out)


@dataclass(frozen=True)
class _Axis:
    """One ring of the flattened network: a switch level, or one axis of a torus."""

    level: int
    size: int
    wrap: bool


def _axes(net: tuple[Level, ...], world: int) -> list[_Axis]:
    out: list[_Axis] = []
    below = 1
    for i, lv in enumerate(net):
        if lv.kind == "torus" and not lv.dims:
            raise ValueError(f"level {lv.name}: the torus is not shaped yet (network.resolve with the device count)")
        if lv.kind == "torus":
            out += [_Axis(i, d, w) for d, w in zip(lv.dims, lv.wrap)]
            below *= lv.size
        else:
            size = lv.size or max(1, math.ceil(world / below))
            out.append(_Axis(i, size, True))
            below *= size
    return out


def factors(net: tuple[Level, ...], size: int, stride: int) -> list[tuple[_Axis, int]]:
    """(axis, f): how many members of a group of `size` ranks `stride` apart differ along each axis."""
    axes = _axes(net, size * stride)
    out, below, spanned = [], 1, 1
    for ax in axes:
        cum = below * ax.size
        # members sharing one unit of this axis and everything inside it
        inside = 1 if stride >= cum else max(1, min(size, cum // stride))
        f = max(1, inside // spanned)
        out.append((ax, f))
        spanned *= f
        below = cum
    if spanned < size:   # beyond the described network: the outermost level takes the rest
        ax, f = out[-1]
        out[-1] = (ax, f * math.ceil(size / spanned))
    return out


def _pieces(net: tuple[Level, ...], size: int, stride: int) -> list[tuple[Level, int, int, float]]:
    """Per spanned level: (level, factor F, latency steps, directions x links used per device)."""
    by_level: dict[int, list[tuple[_Axis, int]]] = {}
    for ax, f in factors(net, size, stride):
        if f > 1:
            by_level.setdefault(ax.level, []).append((ax, f))
    out = []
    for i in sorted(by_level):
        lv, parts = net[i], by_level[i]
        F = math.prod(f for _, f in parts)
        if lv.kind == "torus":
            steps = sum(f // 2 if ax.wrap else f - 1 for ax, f in parts)
            links = sum(2.0 if ax.wrap else 1.0 for ax, _ in parts)
        else:
            steps, links = F - 1, 1.0
        out.append((lv, F, steps, links))
    return out


def collective_seconds(net: tuple[Level, ...], op: str, nbytes: float, size: int, stride: int,
                       default_eff: float = 0.8) -> float:
    """Seconds for `op` (all_reduce, all_gather, reduce_scatter, all_to_all) on a buffer of
    `nbytes` (the nccl-tests size: the whole gathered or reduced buffer) over the group."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    pieces = _pieces(net, size, stride)
    if op == "all_to_all":
        slow, lat, inner = 0.0, 0.0, 1
        for lv, F, steps, links in pieces:
            inner *= F
            bw = lv.bandwidth * (lv.efficiency or default_eff) * links / lv.oversubscription
            if lv.kind == "torus":    # a quarter of an all-gather's bytes per axis length (How to Scale Your Model)
                t = nbytes * F / 4 / bw
            else:                      # the share of each rank's data that leaves the unit below this level
                t = (1 - inner / size + (F - 1) / size) * nbytes / bw
            slow, lat = max(slow, t), lat + steps * lv.latency
        return slow + lat
    if op not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"no cost model for collective {op!r}")
    twice = 2 if op == "all_reduce" else 1
    slow, lat, data = 0.0, 0.0, float(nbytes)
    single = len(pieces) == 1
    for lv, F, steps, links in pieces:
        bw = lv.bandwidth * (lv.efficiency or default_eff) * links / lv.oversubscription
        if op == "all_reduce" and single and lv.in_network_reduction:
            # The switch sums: each device sends its buffer once and receives the result once.
            t, n_steps = data / bw, 2
        else:
            t, n_steps = twice * (F - 1) / F * data / bw, twice * steps
        slow, lat = max(slow, t), lat + n_steps * lv.latency
        data /= F
    return slow + lat


def p2p_seconds(net: tuple[Level, ...], nbytes: float, stride: int, default_eff: float = 0.8) -> float:
    """One message between ranks `stride` apart: the innermost level that holds both, one hop."""
    if nbytes <= 0:
        return 0.0
    for ax, f in factors(net, 2, stride):
        if f > 1:
            lv = net[ax.level]
            return lv.latency + nbytes / (lv.bandwidth * (lv.efficiency or default_eff) / lv.oversubscription)
    lv = net[-1]
    return lv.latency + nbytes / (lv.bandwidth * (lv.efficiency or default_eff) / lv.oversubscription)


def parse_link(text: str) -> Level:
    """--link NAME:size=8,kind=switch,gbps=450,us=5[,eff=0.8][,oversub=2][,dims=4x4x4][,wrap=yyy][,sharp=1]"""
    name, _, rest = text.partition(":")
    if not name or not rest:
        raise ValueError(f"--link {text!r}: expected NAME:size=N,kind=KIND,gbps=G,us=U[,...]")
    kv = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--link {text!r}: {item!r} is not key=value")
        kv[key.strip()] = value.strip()
    known = {"size", "kind", "gbps", "us", "eff", "oversub", "dims", "wrap", "sharp"}
    if set(kv) - known:
        raise ValueError(f"--link {text!r}: unknown key(s) {sorted(set(kv) - known)}; known: {sorted(known)}")
    def number(key: str, default: str | None = None) -> float:
        # nan passes every `<= 0` test and would rank layouts by nan times; inf is no bandwidth either.
        value = float(kv[key] if default is None else kv.get(key, default))
        if not math.isfinite(value):
            raise ValueError(f"{key}={kv[key]} is not a finite number")
        return value

    try:
        dims = tuple(int(d) for d in kv["dims"].split("x")) if "dims" in kv else ()
        wrap = tuple(c == "y" for c in kv.get("wrap", "y" * len(dims)))
        size = math.prod(dims) if dims else int(kv.get("size", "0"))
        return Level(name, size, kv.get("kind", "torus" if dims else "switch"), number("gbps") * 1e9,
                     number("us", "5") * 1e-6, number("eff", "0"), number("oversub", "1"),
                     dims, wrap, kv.get("sharp", "0") in ("1", "y", "yes", "true"))
    except KeyError as exc:
        raise ValueError(f"--link {text!r}: missing {exc.args[0]}=") from None
    except ValueError as exc:
        raise ValueError(f"--link {text!r}: {exc}") from None
