"""A layout as the cost model runs it (`Execution`): the trainer's own `[layout]`
(parallel/layout_section.py's LayoutSection, the one layout type), plus the facts of the run the
planner times that are not a layout: the micro-batch size and the modelled implementation's knobs
(overlaps, gradient precision and buffers, host overhead).

    lay = Execution(tp=8, pp=8, sp=True, recompute="selective", micro_batch=1)
    lay.check(spec, world=64, global_batch=64)   # raises LayoutError naming every degree that does not fit

One layout type for both: an Execution *is* a LayoutSection (dp, tp, pp, cp, ep, zero, schedule,
virtual_stages, stage_layers, sp, recompute, precision, dp_mode ... mean what the trainer means),
so the layout the planner picks is written as a configuration the trainer runs
(train/plan_config.py, `shardlab plan --emit-config`), and the trainer's own rules
(train/config_check.py) decide which layouts a search may rank. World size = dp x ep x cp x tp x pp,
as the trainer's mesh: dp does not count ep.

Ranks are numbered as the trainer's default mesh (layout.mesh_order "pp,dp,ep,cp,tp"), which is
Megatron-LM's order: tp fastest, then cp, then ep, then dp, then pp: a tensor-parallel group is the
closest ranks, a pipeline neighbour the farthest. Dense parameters are replicated over dp x ep x cp
(their gradients reduced there); an expert over dp x cp.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.pipeline.partition import even_layers

# The trainer's names (parallel/pipeline/schedules.py KINDS) for the schedules the cost model times;
# "zb-h1", the paper's name, is read as "zb1". The trainer's "naive" is not modelled.
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb1")
SCHEDULE_ALIASES = {"zb-h1": "zb1"}
RECOMPUTE = ("none", "selective", "full")
# Per-op selective recomputation (torchtitan's "op" policy, Korthikanti's selective generalised): the
# ops of a layer whose outputs may be kept (Execution.recompute_keep), in order. The MLP's down
# projection and the residual add after it are never redone (nothing in the layer's backward needs
# their outputs).
OP_KEYS = ("norm1", "qkv", "attention", "out_proj", "residual1", "norm2", "fc1", "activation")
# torchtitan's op-level policy keeps matmul outputs (every other one) and the attention kernel's and
# redoes the norms and elementwise ops: as kept ops here, the qkv projection, attention and the MLP's
# up projection (an approximation of "every other matmul").
TORCHTITAN_OP = ("qkv", "attention", "fc1")
# fp8: the linear layers' matmuls at the fp8 rate (Transformer Engine's recipe); weights, activations
# and gradients stay 16-bit in memory, attention and the optimizer as under bf16. The trainer has no
# fp8 (its rules refuse it), so a search asked for trainable layouts never ranks one.
# bf16-autocast (the trainer's torch.autocast recipe): fp32 parameters, gradients and AdamW state (no
# separate master), activations and matmuls in bf16.
PRECISIONS = ("bf16", "fp16", "fp32", "fp8", "bf16-autocast")


def compute_precision(precision: str) -> str:
    """The tensor-core rate a layout's matmuls run at: bf16-autocast's are bf16."""
    return "bf16" if precision == "bf16-autocast" else precision


class LayoutError(ValueError):
    """A layout that cannot run this model on this many ranks; the message says which factor fails."""


@dataclass
class Execution(LayoutSection):
    """The trainer's LayoutSection (inherited as it is) plus what only the cost model reads: how
    the layout is executed, not how the work is spread."""

    precision: str = "bf16"      # parameters and activations; bf16/fp16 keep fp32 master weights
    micro_batch: int = 1         # sequences per micro-batch on one batch rank (the trainer's
                                 # train.global_batch / (dp x ep x train.micro_batches))
    grad_fp32: bool = False      # accumulate and reduce gradients in fp32 (Megatron-LM's main_grad)
    dp_overlap: bool = True      # gradient reduction overlapped with the last micro-batch's backward
    tp_overlap: bool = True      # tp's backward collectives behind the weight-gradient matmuls (Megatron-LM)
    grads_persist: bool = True   # gradient buffers live through forward (DDP buckets, Megatron's grad buffer);
                                 # False: made in backward, freed after the step (zero_grad(set_to_none))
    tp_comm_overlap: bool = False   # every tp/sp collective split and hidden behind its GEMM (Megatron-LM's
                                    # --tp-comm-overlap, userbuffers), forward and backward
    param_gather_overlap: bool = False  # ZeRO >= 1: the next step's parameter all-gather hidden behind the
                                        # forward (Megatron-LM's --overlap-param-gather)
    grad_clip: bool = True       # the optimizer step reads every gradient once more for the global norm
    step_overhead_s: float = 0.0  # host time per optimizer step the GPU waits for (a framework's own loop,
                                  # measured: plan/validate_gpu.py), added to the step
    zero3_unit: str = "layer"    # ZeRO-3 gathers a transformer layer at a time (FSDP's wrapping) or "module":
                                 # one weight matrix at a time (DeepSpeed's per-submodule fetch)
    recompute_keep: tuple[str, ...] = ()  # per-op selective recomputation (recompute "selective"): the ops whose
                                          # outputs are kept (flops.OP_KEYS); every other one is redone in backward

    @classmethod
    def from_section(cls, section: LayoutSection, micro_batch: int = 1, **knobs) -> Execution:
        """The trainer's `[layout]` as the planner's layout: every field as it is, plus the cost
        model's knobs (`micro_batch`: the rows of one micro-batch on one batch rank)."""
        return cls(**{f.name: getattr(section, f.name) for f in fields(LayoutSection)},
                   micro_batch=micro_batch, **knobs)

    def section(self) -> LayoutSection:
        """The trainer's `[layout]` of this layout (the cost model's knobs dropped)."""
        return LayoutSection(**{f.name: getattr(self, f.name) for f in fields(LayoutSection)})

    def __post_init__(self) -> None:
        self.schedule = SCHEDULE_ALIASES.get(self.schedule, self.schedule)
        self.stage_layers = tuple(self.stage_layers)
        self.recompute_keep = tuple(self.recompute_keep)
        if self.zero3_unit not in ("layer", "module"):
            raise ValueError(f"zero3_unit is 'layer' or 'module', got {self.zero3_unit!r}")

    @property
    def virtual(self) -> int:
        """Model chunks per pipeline rank (the trainer's virtual_stages)."""
        return self.virtual_stages

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element."""
        return 4 if self.precision == "fp32" else 2

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision in ("fp32", "bf16-autocast") else 2

    @property
    def grad_bytes(self) -> int:
        return 4 if (self.precision in ("fp32", "bf16-autocast") or self.grad_fp32) else 2

    @property
    def optim_bytes(self) -> int:
        """AdamW state per parameter: two fp32 moments, plus an fp32 master copy under 16-bit."""
        return 8 if self.precision in ("fp32", "bf16-autocast") else 12

    def layers_on(self, layers: int, stage: int) -> int:
        """Transformer layers on pipeline stage `stage`: the explicit `stage_layers` (per chunk), or
        `layers` split as evenly as possible, the chunks with one layer fewer placed first and last
        (they also hold the embedding and the head; Llama 3 405B's 126 layers over 16 stages: 7,
        8 x 14, 7). The trainer splits by the same rule (parallel/pipeline/partition.py)."""
        chunks = self.stage_layers or even_layers(layers, self.pp * self.virtual)
        return sum(chunks[stage::self.pp])   # interleaved: stage s holds chunks s, s + pp, ...

    def stage_layer_counts(self, layers: int) -> list[int]:
        return [self.layers_on(layers, i) for i in range(self.pp)]

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.batch_ranks * self.micro_batch)

    def name(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"cp{self.cp}"] * (self.cp > 1) + [f"ep{self.ep}"] * (self.ep > 1)
        text = " ".join(parts)
        if self.sp:
            text += " sp"
        if self.zero:
            text += f" z{self.zero}"
        if self.dp_mode != "overlap" and self.replicas > 1:
            text += f" {self.dp_mode}"
        if self.pp > 1:
            text += f" {self.schedule}" + (f"/v{self.virtual}" if self.schedule == "interleaved" else "")
        if self.recompute_keep:
            text += " rc-keep:" + "+".join(self.recompute_keep)
        elif self.recompute != "none":
            text += f" rc-{self.recompute[:3]}"
        if self.precision in ("fp8", "bf16-autocast"):
            text += f" {self.precision}"
        return text + f" mb{self.micro_batch}"

    def to_dict(self) -> dict:
        return {**asdict(self), "virtual": self.virtual}

    def check(self, spec, world: int | None = None, global_batch: int | None = None) -> None:
        """Raise LayoutError listing every reason this layout cannot run `spec`."""
        bad = []
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "virtual"):
            if getattr(self, name) < 1:
                bad.append(f"{name} = {getattr(self, name)} must be at least 1")
        if bad:
            raise LayoutError("; ".join(bad))
        if world is not None and self.world != world:
            bad.append(f"dp {self.dp} x tp {self.tp} x pp {self.pp} x cp {self.cp}"
                       + (f" x ep {self.ep}" if self.ep > 1 else "") + f" = {self.world}, not the {world} ranks")
        if self.zero not in (0, 1, 2, 3):
            bad.append(f"ZeRO stage {self.zero} is not 0-3")
        if self.schedule not in SCHEDULES:
            bad.append(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            bad.append(f"recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.recompute_keep:
            unknown = [k for k in self.recompute_keep if k not in OP_KEYS]
            if unknown:
                bad.append(f"recompute_keep {', '.join(unknown)}: not ops of a layer ({', '.join(OP_KEYS)})")
            if self.recompute != "selective":
                bad.append(f"recompute_keep (per-op selective recomputation) needs recompute 'selective', "
                           f"not {self.recompute!r}")
        if self.precision not in PRECISIONS:
            bad.append(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if spec.n_head % self.tp:
            bad.append(f"tp {self.tp} does not divide the {spec.n_head} attention heads")
        elif spec.n_kv_head % self.tp and self.tp % spec.n_kv_head:
            bad.append(f"tp {self.tp} and the {spec.n_kv_head} key-value heads: neither divides the other")
        if spec.d_ff % self.tp:
            bad.append(f"tp {self.tp} does not divide the feed-forward size {spec.d_ff}")
        if spec.vocab_size % self.tp:
            bad.append(f"tp {self.tp} does not divide the vocabulary {spec.vocab_size}")
        if self.stage_layers:
            chunks = self.pp * self.virtual
            if len(self.stage_layers) != chunks or sum(self.stage_layers) != spec.n_layer \
                    or min(self.stage_layers) < 1:
                bad.append(f"stage layers {list(self.stage_layers)} must be {chunks} positive counts summing to "
                           f"the {spec.n_layer} layers" + (" (one per chunk: pp x virtual)" if self.virtual > 1 else ""))
        elif spec.n_layer < self.pp * self.virtual:
            bad.append(f"pp {self.pp} x virtual {self.virtual} exceeds the {spec.n_layer} layers")
        if self.virtual > 1 and self.schedule != "interleaved":
            bad.append(f"virtual {self.virtual} needs the interleaved schedule")
        if self.schedule == "interleaved" and self.pp == 1:
            bad.append("the interleaved schedule needs pp > 1")
        if spec.seq_len % (self.cp * (self.tp if self.sp else 1)):
            bad.append(f"sequence {spec.seq_len} does not divide into cp {self.cp}"
                       + (f" x tp {self.tp} (sp)" if self.sp else ""))
        if self.ep > 1 and spec.mlps_per_layer % self.ep:
            bad.append(f"ep {self.ep} must divide the {spec.mlps_per_layer} experts")
        if self.sp and self.tp == 1:
            bad.append("sequence parallelism needs tp > 1")
        if global_batch is not None:
            if global_batch % (self.batch_ranks * self.micro_batch):
                bad.append(f"global batch {global_batch} does not divide into dp {self.dp} "
                           + (f"x ep {self.ep} " if self.ep > 1 else "") + f"x micro-batch {self.micro_batch}")
            elif self.schedule == "interleaved" and self.micro_batches(global_batch) % self.pp:
                bad.append(f"interleaved: {self.micro_batches(global_batch)} micro-batches must be a multiple "
                           f"of pp {self.pp}")
        if bad:
            raise LayoutError("; ".join(bad))
