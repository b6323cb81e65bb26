"""Rules: which mesh axis each logical axis (models/axes.py) is laid out over, for compute and for storage.

    rules = Rules.parse(compute="heads=tp, kv_heads=tp, mlp=tp, vocab=tp")           # Megatron TP
    rules = Rules.parse(compute="heads=tp, kv_heads=tp, mlp=tp, vocab=tp, seq=tp")   # + sequence parallel
    rules = Rules.parse(compute="", params="embed=dp")                              # FSDP (ZeRO-3)
    rules = Rules.parse(compute="heads=tp, mlp=tp, vocab=tp, seq=cp")              # + context parallel
    rules = Rules.parse(compute="heads=tp, mlp=tp, vocab=tp, seq=cp+tp")           # + both (cp outer)
    rules = Rules.parse(compute="layers=pp, experts=ep")                           # pipeline stages + experts

`compute` says how activations, and the weights used in compute, are laid out; `params` how weights
are stored between uses, given as the entries that differ from `compute` (the storage mapping is the
compute mapping updated by them). A weight stored over an axis it is computed whole on is gathered
before each use and its gradient reduce-scattered back (FSDP; Zhao et al. 2023).

What the derivation executes (parallel/sharding/derive.py says why each other rule is refused):
model dimensions over the mesh's "tp" axis, the batch over "dp" (always: the trainer splits rows over
the data-parallel ranks), the sequence over "cp" (context parallelism: the whole model on this rank's
zigzag chunks, attention by the ring; parallel/sharding/context.py), storage over "dp", and whole modules:
the blocks over "pp" (layers=pp: pipeline stages) and a mixture's experts over "ep" (experts=ep: expert
parallelism; parallel/sharding/placed.py). One logical
axis may name several mesh axes joined by '+', outer first: only `seq=cp+tp` is derived (the sequence
over cp everywhere, and each cp share further over tp between blocks: sequence parallelism). The
`[sharding]` section of a configuration holds the same two mappings as text ("heads=tp, mlp=tp") or
TOML inline tables ({heads = "tp"}).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shardlab.models.axes import LOGICAL_AXES

MODEL_AXIS = "tp"
"""The mesh axis that model dimensions are cut over (its group is the model's tp_group)."""
DATA_AXIS = "dp"
"""The mesh axis the batch is split over, and that storage may shard weights over (FSDP)."""
CONTEXT_AXIS = "cp"
"""The mesh axis the sequence may be cut over for the whole model (context parallelism)."""
PIPELINE_AXIS = "pp"
"""The mesh axis the blocks (logical axis `layers`) may be placed over: pipeline stages."""
EXPERT_AXIS = "ep"
"""The mesh axis a mixture's experts (logical axis `experts`) may be placed over: expert parallelism."""
PLACED = {"layers": PIPELINE_AXIS, "experts": EXPERT_AXIS}
"""The logical axes that index modules (models/axes.py MODULE_AXES) and the one mesh axis each may name."""


def axes_of(value: str | None) -> tuple[str, ...]:
    """'cp+tp' -> ('cp', 'tp'); None or '' -> ()."""
    return tuple(a.strip() for a in value.split("+") if a.strip()) if value else ()


def split_seq(compute: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(the sequence's context axis, its axis between blocks) of `seq`'s mapping: 'cp' -> ('cp',
    None), 'tp' -> (None, 'tp'), 'cp+tp' -> ('cp', 'tp')."""
    parts = axes_of(compute.get("seq"))
    cp = CONTEXT_AXIS if CONTEXT_AXIS in parts else None
    rest = [a for a in parts if a != CONTEXT_AXIS]
    return cp, (rest[0] if rest else None)


class ShardingError(ValueError):
    """Rules that cannot be derived; the message names every module, tensor and axis at fault."""


@dataclass(frozen=True)
class Rules:
    compute: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)

    @staticmethod
    def parse(compute: str | Mapping[str, str] = "", params: str | Mapping[str, str] = "") -> "Rules":
        c = _mapping(compute, "sharding.compute")
        if "heads" in c and "kv_heads" not in c:
            c["kv_heads"] = c["heads"]  # grouped-query attention pairs them: cut alike unless told otherwise
        return Rules(c, _mapping(params, "sharding.params"))

    def __bool__(self) -> bool:
        return bool(self.compute) or bool(self.params)

    def storage(self) -> dict[str, str]:
        """The storage mapping: compute's, with params' entries over it."""
        return {**self.compute, **self.params}

    def describe(self) -> str:
        c = ", ".join(f"{k}={v}" for k, v in self.compute.items()) or "-"
        p = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"compute: {c}" + (f"; params: {p}" if p else "")

    def problems(self) -> list[str]:
        """What is wrong with the rules on their own (unknown names, axes not derived)."""
        out = []
        for where, mapping in (("compute", self.compute), ("params", self.params)):
            for logical, axis in mapping.items():
                if logical not in LOGICAL_AXES:
                    out.append(f"sharding.{where}: unknown logical axis {logical!r}; the models declare "
                               f"{', '.join(LOGICAL_AXES)} (models/axes.py)")
                elif logical == "batch" and axis != DATA_AXIS:
                    out.append(f"sharding.{where}: batch={axis!r}: the batch is split over {DATA_AXIS!r} (the "
                               f"trainer's rows per data-parallel rank); no other axis is derived")
                elif logical in PLACED and (where == "params" or axis != PLACED[logical]):
                    out.append(f"sharding.{where}: {logical}={axis!r}: {logical} index whole modules (the "
                               f"{'blocks' if logical == 'layers' else 'experts'}), placed over "
                               f"{PLACED[logical]!r} in compute ({'pipeline stages' if logical == 'layers' else 'expert parallelism'})"
                               f"{'; storage follows compute for whole modules' if where == 'params' else ''}")
                elif logical not in PLACED and axis in (PIPELINE_AXIS, EXPERT_AXIS):
                    out.append(f"sharding.{where}: {logical}={axis!r}: {axis!r} places whole modules (layers={PIPELINE_AXIS}, "
                               f"experts={EXPERT_AXIS}); it cuts no tensor dimension")
                elif logical in PLACED:
                    continue
                elif where == "compute" and logical == "seq":
                    parts = axes_of(axis)
                    if parts not in ((MODEL_AXIS,), (CONTEXT_AXIS,), (CONTEXT_AXIS, MODEL_AXIS)):
                        out.append(f"sharding.compute: seq={axis!r}: the sequence is derived over {CONTEXT_AXIS!r} "
                                   f"(context parallelism: everywhere, attention by the ring), {MODEL_AXIS!r} "
                                   f"(sequence parallelism: between blocks) or '{CONTEXT_AXIS}+{MODEL_AXIS}' (both, "
                                   f"cp outer)")
                elif where == "compute" and logical == "ctx":
                    if axis != CONTEXT_AXIS or split_seq(self.compute)[0] != CONTEXT_AXIS:
                        out.append(f"sharding.compute: ctx={axis!r}: the sequence inside blocks follows seq's "
                                   f"{CONTEXT_AXIS!r} part (seq={CONTEXT_AXIS} cuts it everywhere, attention by ring "
                                   f"attention); it is never cut alone (every query needs every earlier key) nor "
                                   f"over {MODEL_AXIS!r} (that axis cuts heads inside attention)")
                elif where == "compute" and logical != "batch" and axis == CONTEXT_AXIS:
                    out.append(f"sharding.compute: {logical}={axis!r}: only the sequence (seq) is cut over "
                               f"{CONTEXT_AXIS!r}; the weights stay whole over it (their gradients summed over cp)")
                elif where == "compute" and logical != "batch" and axis != MODEL_AXIS:
                    out.append(f"sharding.compute: {logical}={axis!r}: model dimensions are derived over the mesh's "
                               f"{MODEL_AXIS!r} axis, the sequence also over {CONTEXT_AXIS!r}, whole modules over "
                               f"{PIPELINE_AXIS!r} and {EXPERT_AXIS!r} (layers, experts); storage over {DATA_AXIS!r} goes in "
                               f"sharding.params)")
                elif where == "params" and axis not in (DATA_AXIS, MODEL_AXIS):
                    out.append(f"sharding.params: {logical}={axis!r}: weights are stored over {DATA_AXIS!r} "
                               f"(FSDP) or as computed ({MODEL_AXIS!r}); other axes are not derived")
                elif where == "params" and axis == MODEL_AXIS and self.compute.get(logical) != MODEL_AXIS:
                    out.append(f"sharding.params: {logical}={axis!r} but compute keeps {logical} "
                               f"{self.compute.get(logical) or 'whole'}: storing over the model axis what compute "
                               f"uses whole is not derived (it would be FSDP over tp)")
        return out


def _mapping(value: str | Mapping[str, str], what: str) -> dict[str, str]:
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    out: dict[str, str] = {}
    for item in (s.strip() for s in value.replace(";", ",").split(",")):
        if not item:
            continue
        key, sep, axis = item.partition("=")
        if not sep:
            key, sep, axis = item.partition(":")
        key, axis = key.strip(), axis.strip().strip("'\"")
        if not sep or not key or not axis:
            raise ShardingError(f"{what}: {item!r} is not logical=axis (e.g. 'heads=tp, mlp=tp')")
        if key in out and out[key] != axis:
            raise ShardingError(f"{what}: {key} is mapped twice ({out[key]!r} and {axis!r})")
        out[key] = axis
    return out
