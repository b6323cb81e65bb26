"""A candidate layout for the planner: parallel degrees, ZeRO stage, pipeline schedule, precision.

    lay = PlanLayout(tp=8, pp=8, sp=True, recompute="selective", micro_batch=1)
    lay.check(spec, world=64, global_batch=64)   # raises LayoutError naming every degree that does not fit

Ranks are numbered tp fastest, then cp, then dp, then pp (Megatron-LM's order, and the one in which
shardlab's mesh puts tp innermost): a tensor-parallel group is the closest ranks, a pipeline
neighbour the farthest. Expert parallelism subdivides the data-parallel ranks: ep ranks hold
different experts, dp/ep copies of each.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
# fp8: the linear layers' matmuls at the fp8 rate (Transformer Engine's recipe); weights, activations
# and gradients stay 16-bit in memory, attention and the optimizer as under bf16.
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")


def _even_split(layers: int, parts: int) -> list[int]:
    """`layers` over `parts` as evenly as possible, the parts with one layer fewer placed at the two
    ends first (they sit beside the embedding and the head)."""
    base, extra = divmod(layers, parts)
    if not extra:
        return [base] * parts
    ends = list(dict.fromkeys(i for pair in zip(range(parts), range(parts - 1, -1, -1)) for i in pair))
    light = set(ends[:parts - extra])
    return [base + (0 if i in light else 1) for i in range(parts)]


class LayoutError(ValueError):
    """A layout that cannot run this model on this many ranks; the message says which factor fails."""


@dataclass(frozen=True)
class PlanLayout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1                  # context parallelism: the sequence split over cp ranks (ring attention)
    ep: int = 1                  # expert parallelism: experts split over ep of the dp ranks
    zero: int = 0                # ZeRO stage over the data-parallel group (0-3)
    schedule: str = "1f1b"       # pipeline schedule
    micro_batch: int = 1         # sequences per micro-batch on one data-parallel rank
    virtual: int = 1             # interleaved schedule: model chunks per pipeline rank
    sp: bool = False             # sequence parallelism (needs tp > 1 to save anything)
    recompute: str = "none"      # activation recomputation
    precision: str = "bf16"      # parameters and activations; bf16/fp16 keep fp32 master weights
    grad_fp32: bool = False      # accumulate and reduce gradients in fp32 (Megatron-LM's main_grad)
    dp_overlap: bool = True      # gradient reduction overlapped with the last micro-batch's backward
    tp_overlap: bool = True      # tp's backward collectives behind the weight-gradient matmuls (Megatron-LM)
    grads_persist: bool = True   # gradient buffers live through forward (DDP buckets, Megatron's grad buffer);
                                 # False: made in backward, freed after the step (zero_grad(set_to_none))
    tp_comm_overlap: bool = False   # every tp/sp collective split and hidden behind its GEMM (Megatron-LM's
                                    # --tp-comm-overlap, userbuffers), forward and backward
    param_gather_overlap: bool = False  # ZeRO >= 1: the next step's parameter all-gather hidden behind the
                                        # forward (Megatron-LM's --overlap-param-gather)
    stage_layers: tuple[int, ...] = ()  # layers per pipeline stage; () = as even as possible (see layers_on)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element."""
        return 4 if self.precision == "fp32" else 2

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        return 4 if (self.precision == "fp32" or self.grad_fp32) else 2

    @property
    def optim_bytes(self) -> int:
        """AdamW state per parameter: two fp32 moments, plus an fp32 master copy under 16-bit."""
        return 8 if self.precision == "fp32" else 12

    def layers_on(self, layers: int, stage: int) -> int:
        """Transformer layers on pipeline stage `stage`: the explicit `stage_layers`, or `layers`
        split as evenly as possible, the stages with one layer fewer placed first and last (they
        also hold the embedding and the head; Llama 3 405B's 126 layers over 16 stages: 7, 8 x 14, 7)."""
        if self.stage_layers:
            return self.stage_layers[stage]
        chunks = _even_split(layers, self.pp * self.virtual)   # interleaved: stage s holds chunks s, s + pp, ...
        return sum(chunks[stage::self.pp])

    def stage_layer_counts(self, layers: int) -> list[int]:
        return [self.layers_on(layers, i) for i in range(self.pp)]

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def name(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"cp{self.cp}"] * (self.cp > 1) + [f"ep{self.ep}"] * (self.ep > 1)
        text = " ".join(parts)
        if self.sp:
            text += " sp"
        if self.zero:
            text += f" z{self.zero}"
        if self.pp > 1:
            text += f" {self.schedule}" + (f"/v{self.virtual}" if self.schedule == "interleaved" else "")
        if self.recompute != "none":
            text += f" rc-{self.recompute[:3]}"
        if self.precision == "fp8":
            text += " fp8"
        return text + f" mb{self.micro_batch}"

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self, spec, world: int | None = None, global_batch: int | None = None) -> None:
        """Raise LayoutError listing every reason this layout cannot run `spec`."""
        bad = []
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "virtual"):
            if getattr(self, name) < 1:
                bad.append(f"{name} = {getattr(self, name)} must be at least 1")
        if bad:
            raise LayoutError("; ".join(bad))
        if world is not None and self.world != world:
            bad.append(f"dp {self.dp} x tp {self.tp} x pp {self.pp} x cp {self.cp} = {self.world}, "
                       f"not the {world} ranks")
        if self.zero not in (0, 1, 2, 3):
            bad.append(f"ZeRO stage {self.zero} is not 0-3")
        if self.schedule not in SCHEDULES:
            bad.append(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            bad.append(f"recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.precision not in PRECISIONS:
            bad.append(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if spec.heads % self.tp:
            bad.append(f"tp {self.tp} does not divide the {spec.heads} attention heads")
        elif spec.n_kv % self.tp and self.tp % spec.n_kv:
            bad.append(f"tp {self.tp} and the {spec.n_kv} key-value heads: neither divides the other")
        if spec.d_ff % self.tp:
            bad.append(f"tp {self.tp} does not divide the feed-forward size {spec.d_ff}")
        if spec.vocab % self.tp:
            bad.append(f"tp {self.tp} does not divide the vocabulary {spec.vocab}")
        if self.stage_layers:
            if len(self.stage_layers) != self.pp or sum(self.stage_layers) != spec.layers \
                    or min(self.stage_layers) < 1:
                bad.append(f"stage layers {list(self.stage_layers)} must be {self.pp} positive counts summing to "
                           f"the {spec.layers} layers")
            if self.virtual > 1:
                bad.append("explicit stage layers do not combine with the interleaved schedule's chunks")
        elif spec.layers < self.pp * self.virtual:
            bad.append(f"pp {self.pp} x virtual {self.virtual} exceeds the {spec.layers} layers")
        if self.virtual > 1 and self.schedule != "interleaved":
            bad.append(f"virtual {self.virtual} needs the interleaved schedule")
        if self.schedule == "interleaved" and self.pp == 1:
            bad.append("the interleaved schedule needs pp > 1")
        if spec.seq % (self.cp * (self.tp if self.sp else 1)):
            bad.append(f"sequence {spec.seq} does not divide into cp {self.cp}"
                       + (f" x tp {self.tp} (sp)" if self.sp else ""))
        if self.ep > 1 and (spec.experts % self.ep or (self.dp * self.cp) % self.ep):
            bad.append(f"ep {self.ep} must divide the {spec.experts} experts and dp x cp = {self.dp * self.cp}")
        if self.sp and self.tp == 1:
            bad.append("sequence parallelism needs tp > 1")
        if global_batch is not None:
            if global_batch % (self.dp * self.micro_batch):
                bad.append(f"global batch {global_batch} does not divide into dp {self.dp} "
                           f"x micro-batch {self.micro_batch}")
            elif self.schedule == "interleaved" and self.micro_batches(global_batch) % self.pp:
                bad.append(f"interleaved: {self.micro_batches(global_batch)} micro-batches must be a multiple "
                           f"of pp {self.pp}")
        if bad:
            raise LayoutError("; ".join(bad))
