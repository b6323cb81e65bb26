"""The flags of `train` and `verify`, and the configuration, layout, pipeline and checkpoint groups
that `explain`, `memory` and `bench train` share with them. Parsers only: argparse and the names the
choices list, nothing a run needs (see main.py)."""

from __future__ import annotations

import argparse

from shardlab.cli.common import Run, add_launch_options
from shardlab.train.presets import model_names


TRAIN_DOC = """\
Train the GPT (on text, by default the Python standard library's sources on this machine, as bytes or
through a tokenizer; or on a token file from `shardlab data prepare`) or the lecture's deep MLP, with
the parallel layout the configuration or the flags give. model.vocab_size follows the data.

The configuration is resolved in order: built-in defaults, --config FILE, --model (its model.*
assignments), --set overrides, then the shortcut flags (--dp, --steps, ...). It is validated before any rank starts; errors name the fields.
Every logged step prints loss, learning rate, tokens/s, MFU (where the device's peak is known),
step time, the share of it spent waiting on communication, and peak tensor memory per rank.
Outputs in log.out_dir: config.toml, metrics.jsonl (every step), tb/ (TensorBoard), loss.png,
samples.txt (GPT) and summary.json. Steps are counted from 1 everywhere (step N: N optimizer steps done,
as checkpoint step_N holds). One run at a time: a second run into a log.out_dir in use is refused,
naming the first's pid and host; a directory that holds a run (metrics.jsonl, checkpoints) needs
--resume (continue it) or --overwrite (start afresh, deleting its checkpoints).

examples:
  shardlab train --config configs/gpt-small.toml --dp 2
  shardlab train --config configs/gpt-small.toml --set train.steps=50 --set optim.lr=3e-4
  shardlab train --model mlp --set model.d_model=512 --dp 2 --dp-mode naive
  shardlab train --config configs/gpt-small.toml --dp 2 --tp 2 --sp       # 4 ranks: dp 2 x tp 2
  shardlab train --config configs/gpt-small.toml --pp 2 --schedule 1f1b --microbatches 4
  shardlab train --config configs/gpt-small.toml --pp 2 --dp 2 --schedule interleaved \\
      --virtual-stages 2 --microbatches 4                                    # 4 ranks: pp 2 x dp 2
  shardlab train --config configs/gpt-small.toml --dp 2 --zero 3 --save-every 50   # sharded checkpoints
  shardlab train --config configs/gpt-small.toml --tp 2 --resume    # continue under another layout
  shardlab train --config configs/gpt-small.toml --dry-run
  shardlab train --model llama3-8b --dry-run        # a planner preset's shape in the trainer (docs/models.md)
  shardlab train --init-from-hf ./hf-model --set model.seq_len=128   # from a local GPT-2 or Llama checkpoint
  shardlab train --config configs/gpt-bpe.toml              # a BPE trained on the stdlib first (cached)
  shardlab train --config configs/gpt-small.toml --set data.source=runs/data/owt.tok   # a token file
  shardlab train --set data.source=train.bin --set data.val_source=val.bin --set data.vocab_size=50257  # nanoGPT's
  shardlab train --config configs/gpt-small.toml --steps 10       # a short try: the warm-up is capped to it
  shardlab train --help-config                      # every configuration field, documented
  torchrun --standalone --nproc-per-node 2 -m shardlab train --config configs/gpt-small.toml --dp 2
  torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m shardlab train --config \\
      configs/gpt-small.toml --dp 2 --save-every 20 --resume        # a restarted job resumes itself
"""


def add_config_options(p: argparse.ArgumentParser) -> None:
    """The configuration and layout flags shared by `train`, `verify` and `bench train`."""
    g = p.add_argument_group("configuration")
    g.add_argument("--config", "-c", default=None, metavar="FILE", help="TOML configuration (see configs/)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field, e.g. --set optim.lr=3e-4 (repeatable; values are TOML literals)")

    g.add_argument("--model", choices=model_names(), default=None, metavar="NAME",
                   help="gpt, mlp (model.name), llama (the GPT with RMSNorm, SwiGLU, no biases, rotary positions, "
                        "grouped-query attention, untied head), gpt2 (LayerNorm, tanh GELU, biases, learned positions, "
                        "tied head), or a planner preset at full size: " + ", ".join(model_names()[4:])
                        + " (train/presets.py); expands to --set model.* assignments that --set can still change")
    g.add_argument("--steps", type=int, default=None, help="shortcut for --set train.steps=...")
    g.add_argument("--loss", choices=["full", "chunked"], default=None,
                   help="GPT: full (the head's whole tokens x vocab logits, then the cross-entropy) or chunked "
                        "(head and cross-entropy fused over model.loss_chunk tokens at a time: the logits never "
                        "exist whole; same loss and gradients up to rounding, less memory) (model.loss)")
    lay = p.add_argument_group("layout")
    lay.add_argument("--dp", type=int, default=None, help="data-parallel degree (ranks); layout.dp")
    lay.add_argument("--tp", type=int, default=None,
                     help="tensor-parallel degree: ranks splitting every layer, innermost on a dp x tp mesh; world "
                          "size = dp x tp (layout.tp)")
    lay.add_argument("--sp", action="store_true", default=None,
                     help="sequence parallelism on top of tensor parallelism: norms and the residual stream hold "
                          "1/tp of the tokens (layout.sp)")
    lay.add_argument("--tp-plan", choices=["megatron", "lecture"], default=None,
                     help="megatron (every model: column/row pairs, GPT vocabulary and heads) or lecture (the MLP: "
                          "every layer d x d/tp, gathered after each) (layout.tp_plan)")
    lay.add_argument("--dp-mode", choices=["naive", "bucketed", "overlap"], default=None,
                     help="naive: one all-reduce per gradient after backward; bucketed: flat buckets after "
                          "backward; overlap: buckets reduced during backward (layout.dp_mode)")
    lay.add_argument("--bucket-mb", type=float, default=None, help="gradient bucket size in MiB (layout.bucket_mb)")
    lay.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                     help="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters (FSDP) "
                          "(layout.zero)")
    lay.add_argument("--comm-impl", default=None,
                     help="all-reduce used for gradients: torch or one of ours, e.g. ring (layout.comm_impl)")
    lay.add_argument("--precision", choices=["fp32", "bf16", "fp16", "bf16-autocast"], default=None,
                     help="fp32, or mixed precision: bf16/fp16 weights, activations and gradient communication "
                          "with fp32 master weights and optimizer state; fp16 adds dynamic loss scaling; "
                          "bf16-autocast keeps fp32 weights, gradients and optimizer and runs the matmuls in bf16 "
                          "under torch.autocast (layout.precision)")
    lay.add_argument("--mesh-order", default=None, metavar="AXES",
                     help="the mesh's axes outermost first, a permutation of pp,dp,ep,cp,tp (layout.mesh_order; "
                          "docs/mesh.md)")
    lay.add_argument("--nodes", type=int, default=None,
                     help="nodes the ranks are on (simulated locally: consecutive blocks of ranks); "
                          "comm_impl hierarchical reduces within a node first (layout.nodes)")
    lay.add_argument("--cp", type=int, default=None,
                     help="context-parallel degree: ranks splitting every sequence (2 zigzag chunks each, "
                          "attention by a ring); model.seq_len must divide by 2 x cp (layout.cp; "
                          "docs/context-parallel.md)")
    lay.add_argument("--ep", type=int, default=None,
                     help="expert-parallel degree: ranks each holding experts / ep of every MoE layer, tokens "
                          "moved by all-to-all; they take different rows (layout.ep; docs/expert-parallel.md)")
    lay.add_argument("--deterministic", action="store_true", default=None, help="dp, ZeRO, pp bit-identical to "
                     "one process on the same micro-batches (docs/deterministic.md) (train.deterministic)")
    lay.add_argument("--experts", type=int, default=None,
                     help="GPT: a mixture-of-experts MLP of this many experts in every block (model.experts)")
    lay.add_argument("--top-k", type=int, default=None, help="GPT with experts: experts per token (model.top_k)")


def add_recompute_options(p: argparse.ArgumentParser) -> None:
    """--recompute, for `train` and `verify` (through add_pipeline_options): the commands that build
    the model through parallelize, so that no benchmark takes the flag and ignores it."""
    p.add_argument_group("activation recomputation (docs/recompute.md)").add_argument(
        "--recompute", choices=["none", "selective", "full"], default=None,
        help="selective: recompute the attention core (softmax(QK^T)V) in backward; full: each block from its "
             "input (the MLP: each pair of layers); less activation memory for more compute, the same numbers "
             "(layout.recompute)")


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """The pipeline flags of `train` and `verify` (and --recompute, which the same two take)."""
    add_recompute_options(p)
    g = p.add_argument_group("pipeline parallelism (docs/pipeline.md)")
    g.add_argument("--pp", type=int, default=None,
                   help="pipeline-parallel degree: ranks each holding a contiguous slice of the layers (a stage), "
                        "outermost on a pp x dp x tp mesh; world size = dp x tp x pp (layout.pp)")
    g.add_argument("--schedule", choices=["naive", "gpipe", "1f1b", "interleaved", "zb1", "interleaved-zb", "zbv",
                                          "dualpipev"], default=None,
                   help="order of the stages' forwards and backwards: naive (one microbatch through the whole "
                        "pipeline at a time), gpipe (all forwards, then all backwards), 1f1b (default: one forward, "
                        "one backward; activations of at most pp microbatches), interleaved (1F1B over "
                        "--virtual-stages chunks per rank: smaller bubble, more messages; needs --microbatches "
                        "divisible by --pp), zb1 (zero-bubble ZB-H1: weight gradients deferred into the bubbles), "
                        "interleaved-zb (interleaved with zb1's split), zbv and dualpipev (ZB-V, DualPipeV: two chunks "
                        "per rank placed as a V, r and 2 pp - 1 - r; dualpipev needs --microbatches >= 2 --pp) "
                        "(layout.schedule)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step per data-parallel rank: its rows are split into this many; with "
                        "--pp they flow through the stages, the more the smaller the bubble; without, they are "
                        "gradient accumulation (train.micro_batches)")
    g.add_argument("--virtual-stages", type=int, default=None,
                   help="chunks of layers per pipeline rank for --schedule interleaved or interleaved-zb (>= 2; "
                        "chunk c on rank c mod pp; zbv and dualpipev always hold 2) (layout.virtual_stages)")


def add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    """The checkpoint flags of `train` (docs/checkpoints.md)."""
    g = p.add_argument_group("checkpoints (docs/checkpoints.md)")
    g.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="save a sharded checkpoint every N steps and after the last one (checkpoint.every; 0: never)")
    g.add_argument("--keep", type=int, default=None, metavar="K",
                   help="keep the K newest checkpoints (checkpoint.keep, default 3; 0: all)")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where step_N/ checkpoints go (checkpoint.dir; default: <log.out_dir>/checkpoints)")
    g.add_argument("--no-async-save", dest="async_save", action="store_false", default=None,
                   help="write checkpoints on the training thread (default: in the background after a copy to "
                        "host memory) (checkpoint.async_save)")
    g.add_argument("--init-from-hf", default=None, metavar="DIR",
                   help="start from a local Hugging Face GPT-2 or Llama checkpoint (config.json + *.safetensors, as "
                        "save_pretrained writes; nothing is downloaded): the model.* shape fields are set from its "
                        "config.json (before --set, so --set model.seq_len=N can shorten the sequence) and its weights "
                        "replace the seed's (model.init_from_hf)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="latest|DIR",
                   help="continue from the newest complete checkpoint that passes its integrity checks (newer "
                        "damaged ones are skipped, each named with the check it failed), or the step_N directory "
                        "given (refused if damaged): same losses and parameters as an uninterrupted run; any "
                        "layout loads any other's. 'latest' starts afresh when there is none, so a job restarted "
                        "by torchrun --max-restarts resumes by itself (checkpoint.resume)")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in a log.out_dir that holds a run (metrics.jsonl or checkpoints): its "
                        "checkpoints and TensorBoard events are deleted first (without it, or --resume, such a "
                        "directory is refused; train/run_dir.py)")
    g.add_argument("--save-on-signal", action="store_true", default=None,
                   help="on SIGTERM, SIGHUP or Ctrl-C, stop at the next step boundary and save a checkpoint of the "
                        "steps done before exiting, as preemptible clusters need (without it the run still stops "
                        "there and writes its summary, metrics and plot) (checkpoint.save_on_signal)")


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the GPT or the deep MLP with a parallel layout",
                       description=TRAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(p)
    add_pipeline_options(p)
    add_checkpoint_options(p)
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the whole GPT where the layout leaves it plain (dp, ZeRO-1/2), else every "
                        "transformer block (faster GPU steps after a compilation; every layout but the zb1 schedule; "
                        "backend: train.compile_backend) (train.compile)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate, print the resolved configuration, parameter count and FLOPs per token, and stop")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the run's summary (losses, tokens/s, MFU with its FLOP conventions and peak, "
                        "memory) as JSON")
    p.add_argument("--help-config", action="store_true", help="print every configuration field with its documentation")
    add_launch_options(p)
    p.set_defaults(func=Run("shardlab.cli.train"))


VERIFY_DOC = """\
Run a parallel layout and a single-process reference from the same initial weights on the same
global batches for K steps (train.steps), and report per step the loss difference and the largest
gradient and parameter differences (absolute, and relative to each tensor's scale) over all ranks.
Exit status 0 when the loss is within --tol relative, every parameter within --atol + --tol x its
tensor's scale and every gradient (and the gradient norm clipped with) within --grad-tol x its
scale, at every step; 1 otherwise. Sharded layouts (ZeRO, tensor parallelism) are compared whole,
by the plain model's parameter names.

Mixed precision (--precision bf16|fp16): the reference runs in the same precision, and a third copy
runs it in fp32. What the precision itself changes (G: the largest relative difference of any tensor
between the reference and the fp32 copy so far; for the loss, their difference) is added to the
allowances, times --mp-factor (default 2: two runs of one precision are each about G from the exact
run, so up to 2G apart; a 16-bit gradient average over dp > 1 replicas rounds more often, and the
default counts those roundings: 5 at fp16 dp 3). Without --config, mixed precision also uses AdamW eps 1e-3 and, for fp16,
an initial loss scale of 2^13.

The noise floor (--noise-floor, fp32; on by default with --config): with a small AdamW eps (1e-8 in
configs/gpt-small.toml) Adam turns a few ulps of difference in a near-zero gradient element into a
step of order lr, so no layout's trajectory stays within the fp32 bars. verify then starts every
step after the first from the layout's own parameters (loss, gradients and gradient norm keep the
strict bars at every step) and allows each parameter element, on top of its strict bar, what
AdamW's arithmetic makes of the two runs' actual gradient differences (the moments' intervals
through m / (sqrt(v) + eps), capped by the largest update AdamW can make): a bound, not a sample,
so the verdict does not depend on the CPU's rounding. The report lists the parameters that needed it.

Without --config, a small model is used (2 layers, d_model 64, global batch 12, 5 steps, AdamW with
eps 1e-4, which bounds how much Adam magnifies rounding noise on near-zero gradients) so that world
sizes 1 to 4 verify in seconds; the global batch grows to a multiple of dp x microbatches when 12 is
not one (16 for 8 microbatches); --set and the flags change any of it.

examples:
  shardlab verify --model gpt --dp 2 --json v.json
  shardlab verify --model mlp --dp 3 --dp-mode naive
  shardlab verify --model gpt --dp 4 --set train.micro_batches=3 --set model.freeze='pos_emb.*'
  shardlab verify --model gpt --dp 2 --comm-impl ring --set model.skip_layer_every=2
  shardlab verify --model gpt --dp 2 --zero 3 --precision bf16
  shardlab verify --model gpt --tp 4 --sp                  # tensor + sequence parallel, 4 ranks
  shardlab verify --model llama --tp 2 --sp                # Llama shape: RMSNorm, SwiGLU, rotary, GQA, no biases
  shardlab verify --model mlp --tp 2 --tp-plan lecture     # the lecture's MLP form
  shardlab verify --model gpt --dp 2 --tp 2 --zero 2       # ZeRO-2 over each dp group of a dp x tp mesh
  shardlab verify --model gpt --pp 2 --schedule 1f1b --microbatches 4 --json v.json
  shardlab verify --model gpt --pp 4 --schedule interleaved --virtual-stages 2 --microbatches 4 \\
      --set model.n_layer=6                                # 8 chunks: the GPT needs 6 blocks + 2
  shardlab verify --model mlp --pp 2 --dp 2 --schedule zb1 --microbatches 3   # 4 ranks: pp 2 x dp 2
  shardlab verify --model gpt --tp 2 --sp --set train.compile=true     # compiled blocks against eager

With --set train.compile=true the layout's blocks are compiled as `shardlab train --compile`
compiles them (train/compile.py; --set train.compile_backend=aot_eager needs no C++ compiler)
and the reference stays eager; the report gives each rank's compiled graphs and graph breaks.

Under a pipeline (--pp), the stages' parameters and gradients are gathered by their original names
over the pipeline group, tied copies (the GPT's embedding and head) counted once. Without --config
and with --pp 4, the small model gets as many layers as the pipeline needs pieces (GPT: pp x
virtual - 2 blocks, at least 2; MLP: pp x virtual layers).
"""


def add_verify_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a layout against a single-process run, step by step",
                       description=VERIFY_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(p)
    add_pipeline_options(p)
    p.add_argument("--tol", type=float, default=1e-6,
                   help="largest relative difference allowed for the loss and the parameters (default %(default)s, fp32)")
    p.add_argument("--grad-tol", type=float, default=1e-5,
                   help="largest relative difference allowed for gradients, which are sums over the batch in "
                        "another order and lose more to cancellation (default %(default)s)")
    p.add_argument("--atol", type=float, default=1e-7,
                   help="absolute allowance for parameters on top of --tol x the tensor's scale (default %(default)s: "
                        "one fp32 rounding unit at 1.0, for tensors that start at zero)")
    p.add_argument("--mp-factor", type=float, default=None,
                   help="mixed precision: allowed multiple of the precision's own error (default: 2, two runs of one "
                        "precision; under fp16/bf16 with dp > 1, 1 + the roundings a 16-bit gradient average adds: "
                        "2 x micro-batches - 1, dp - 1 additions, and the division unless dp is a power of two)")
    p.add_argument("--noise-floor", choices=("auto", "on", "off"), default="auto",
                   help="fp32: start every step after the first from the layout's own parameters and allow each "
                        "parameter element, on top of its strict bar, the bound AdamW's arithmetic puts on the update "
                        "given the two runs' gradient differences (a small eps magnifies rounding); loss, gradients and "
                        "norm keep the strict bars. auto (default): on with --config (a configuration verified as "
                        "written), off for verify's own small model, whose eps 1e-4 keeps rounding under the strict bars")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    add_launch_options(p)
    p.set_defaults(func=Run("shardlab.cli.verify"))
