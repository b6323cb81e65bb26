"""The `[layout]` section of a configuration: how the work is spread over ranks (the layout's options,
here below the trainer so that parallel/layout.py reads them without importing train/; train/config.py
holds the other sections and the loading; config_check.py the rules that refuse a layout)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayoutSection:
    """How the work is spread over ranks. World size = the product of the degrees."""

    dp: int = 1
    """Data-parallel degree: ranks that each take a slice of every global batch."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split every layer's matmuls (Megatron-LM) and take the same
    rows. The ranks form a (pp x) dp x tp mesh, tp innermost (a tp group's ranks are consecutive: the
    closest ones, since it talks on every layer); data parallelism and ZeRO run over the dp groups."""
    sp: bool = False
    """Sequence parallelism (Korthikanti et al. 2022) on top of tensor parallelism: norms and the
    residual stream hold 1/tp of the tokens (GPT: model.seq_len must divide by tp; MLP: its rows per
    micro-batch). With tp 1 it runs the tensor-parallel code on one-rank groups (a check of that code)."""
    tp_plan: str = "megatron"
    """Tensor-parallel plan: 'megatron' (GPT: embedding and head split by vocabulary, attention by
    heads, MLP column then row; deep MLP: layers paired column then row, one all-reduce per pair) or
    'lecture' (deep MLP only: every layer d x d/tp, all-gathered after each). docs/tensor-parallel.md."""
    pp: int = 1
    """Pipeline-parallel degree: ranks that each hold a contiguous slice of the layers (a stage) and
    pass activations forward and gradients back, microbatch by microbatch. Ranks form a mesh in
    layout.mesh_order (default pp x dp x ep x cp x tp, pp outermost); world size = pp x dp x ep x cp x tp.
    docs/pipeline.md, docs/mesh.md."""
    schedule: str = "1f1b"
    """Pipeline schedule (layout.pp > 1): 'naive' (one microbatch at a time through the whole
    pipeline, one stage busy at a time; with m > 1 that is gradient accumulation with no overlap),
    'gpipe' (all forwards, then all backwards), '1f1b' (one forward one backward: GPipe's bubble,
    at most pp microbatches of activations), 'interleaved' (1F1B over layout.virtual_stages chunks
    per rank: a bubble v times smaller; m must divide by pp), 'zb1' (ZB-H1: backward split into
    input and weight gradients, the latter filling the bubbles), 'interleaved-zb' (interleaved with
    zb1's split), 'zbv' (ZB-V) or 'dualpipev' (DualPipeV, m >= 2 pp): two chunks per rank placed as a
    V, chunks r and 2 pp - 1 - r on rank r (docs/pipeline.md)."""
    virtual_stages: int = 1
    """Chunks of layers per pipeline rank (v): 1, or >= 2 with schedule 'interleaved' or
    'interleaved-zb' (chunk c on rank c mod pp); 'zbv' and 'dualpipev' hold 2 (1 or 2 accepted).
    pp x v must not exceed the model's pieces (GPT: n_layer + 2, MLP: n_layer)."""
    stage_layers: tuple[int, ...] = ()
    """Layers (GPT: blocks; MLP: layers) per pipeline chunk, first to last: pp x virtual_stages
    positive counts summing to model.n_layer, e.g. [3, 2] (TOML list, or --set layout.stage_layers=3,2).
    The GPT's embedding rides with the first chunk and its head with the last. Empty (default): as
    even as possible, a count the chunks do not divide (126 layers over 16) giving the edge chunks,
    which also hold the embedding and the head, one layer fewer (7, 8 x 14, 7): the planner's split."""
    dp_mode: str = "overlap"
    """'naive' (one all-reduce per gradient after backward), 'bucketed' (flat buckets after
    backward) or 'overlap' (buckets reduced during backward). A pipeline stage (layout.pp > 1 with
    layout.dp > 1) syncs once per step, at the schedule's end: 'naive' or 'bucketed' (the command
    line turns the default 'overlap' into 'bucketed' and says so)."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB (bucketed and overlap modes)."""
    comm_impl: str = "torch"
    """Which collectives reduce gradients (and gather ZeRO's shards): 'torch' (the backend's) or
    one of ours ('ring', ...)."""
    zero: int = 0
    """ZeRO stage over the data-parallel ranks: 0 (plain data parallelism), 1 (optimizer state
    sharded, gradients reduce-scattered after backward), 2 (gradients too, reduce-scattered during
    backward), 3 (parameters too: FSDP, gathered per unit for forward and backward). dp_mode
    applies to stage 0 only."""
    precision: str = "fp32"
    """'fp32', or mixed precision: 'bf16' or 'fp16' parameters, activations and gradient
    communication, with fp32 master weights and optimizer state (fp16 adds dynamic loss scaling);
    or 'bf16-autocast': fp32 parameters, gradients and optimizer, matmuls in bf16 under torch.autocast."""
    cp: int = 1
    """Context-parallel degree: ranks that each hold a share of every sequence's tokens (ring
    attention) and take the same rows."""
    ep: int = 1
    """Expert-parallel degree: ranks that each hold a share of every MoE layer's experts; they take
    different rows (the batch is split over dp x ep "batch ranks")."""
    mesh_order: str = "pp,dp,ep,cp,tp"
    """The mesh's axes, outermost to innermost (a permutation of pp, dp, ep, cp, tp): the innermost
    axis's ranks are consecutive, the closest ones. The default puts tp, which talks on every layer,
    innermost and pp, which sends one activation per microbatch, outermost. docs/mesh.md."""
    nodes: int = 1
    """How many nodes the ranks are on (a local launch simulates them: consecutive blocks of
    world_size / nodes ranks); hierarchical collectives (comm_impl 'hierarchical') reduce within a node
    first. Must divide the world size."""
    recompute: str = "none"
    """Activation recomputation (checkpointing), applied after tp/ep/cp and before dp/ZeRO: 'none',
    'selective' (the attention core softmax(QK^T)V recomputed, the linear layers' outputs kept;
    Korthikanti et al. 2022) or 'full' (each transformer block keeps only its input and is rerun in
    backward; the deep MLP: each pair of layers). Same numbers, less memory, more compute:
    docs/recompute.md."""

    @property
    def world(self) -> int:
        """Ranks the layout needs: pp x dp x ep x cp x tp (dp does not count ep)."""
        return self.dp * self.ep * self.tp * self.pp * self.cp

    @property
    def batch_ranks(self) -> int:
        """Ranks that take different rows of the batch: dp x ep."""
        return self.dp * self.ep

    @property
    def replicas(self) -> int:
        """Ranks holding the same dense parameters, over which their gradients are reduced and ZeRO
        shards: dp x ep x cp."""
        return self.dp * self.ep * self.cp

    def strategy_text(self, name: str, micro_batches: int | None = None, comm_impl: bool = False) -> str:
        """One strategy of the layout (a name of parallel/parallelize.py's `strategies`) with its degree
        and options: 'pp 4 (1f1b, m 8)', 'dp 2 (ZeRO-1)', 'tp 2 + sp (megatron)', 'ep 2', 'recompute
        (full)'. micro_batches: a pipeline's m, when given; comm_impl: the data-parallel collectives'
        implementation beside the reduction."""
        if name == "pp":
            options = [self.schedule] + [f"m {micro_batches}"] * (micro_batches is not None)
            return f"pp {self.pp} ({', '.join(options + [f'v {self.virtual_stages}'] * (self.virtual_stages > 1))})"
        if name == "dp":
            reduction = f"ZeRO-{self.zero}" if self.zero else self.dp_mode
            return f"dp {self.dp} ({reduction}{', ' + self.comm_impl if comm_impl else ''})"
        if name == "tp":
            return f"tp {self.tp}{' + sp' if self.sp else ''} ({self.tp_plan})"
        if name == "recompute":
            return f"recompute ({self.recompute})"
        if name == "sharding":
            return "sharding rules"
        return f"{name} {getattr(self, name)}"

    def describe(self, micro_batches: int | None = None, comm_impl: bool = False) -> str:
        """The layout in one line, its axes outermost first: 'pp 4 (1f1b, m 8) x dp 2 (ZeRO-2) x ep 2 x tp
        2 + sp (megatron)'. The one description of a layout the trainer's header and plot title and
        verify's report print (arguments as in `strategy_text`)."""
        axes = ["pp"] * (self.pp > 1) + ["dp"] + [a for a in ("ep", "cp") if getattr(self, a) > 1]
        axes += ["tp"] * (self.tp > 1 or self.sp)
        return " x ".join(self.strategy_text(a, micro_batches, comm_impl) for a in axes)
