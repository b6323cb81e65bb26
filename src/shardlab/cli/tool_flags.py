"""The flags of the smaller commands: explain, memory, collectives, topo, viz, checkpoint, generate,
data and doctor. Parsers only, each naming the function that runs its command (main.py says why)."""

from __future__ import annotations

import argparse

from shardlab.cli.common import Run, add_launch_options, int_list, name_list
from shardlab.cli.train_flags import add_config_options
from shardlab.parallel.pipeline.schedules import KINDS

CHECKPOINT_DOC = """`shardlab checkpoint`: look into a checkpoint, or turn it into one whole state dict.

    shardlab checkpoint inspect runs/gpt-small/checkpoints          # the newest one under a root
    shardlab checkpoint inspect runs/gpt-small/checkpoints/step_00000200 --json -
    shardlab checkpoint consolidate runs/gpt-small/checkpoints --out model.pt
    python -c "import torch; m.load_state_dict(torch.load('model.pt', weights_only=True))"
    shardlab checkpoint export runs/gpt-small/checkpoints --hf hf-model    # transformers: GPT-2 or Llama, tokenizer
    python -c "import transformers as t; t.AutoModelForCausalLM.from_pretrained('hf-model')"
    shardlab checkpoint export runs/gpt-small/checkpoints --dcp dcp-ckpt   # torch.distributed.checkpoint

Neither starts ranks nor needs the layout the checkpoint was saved under: the metadata says where
every slice of every tensor is (docs/checkpoints.md).

Both verify every file first (its size and SHA-256 against the metadata, the step stamped in it,
the metadata's step against its step_N directory): inspect lists each problem and exits with 1,
consolidate refuses to write anything (docs/reliability.md).
"""

COLLECTIVES_DOC = """`shardlab collectives`: what each collective does, shown rank by rank.

Every rank starts from [0, 1, ..., n-1] + rank (at world size 4: [0, 1, 2, 3] + rank), so the
results can be checked by hand: all_reduce gives [6, 10, 14, 18] on every rank at world size 4.
"""

DATA_DOC = """`shardlab data`: turn text into a token file the trainer memory-maps, or look into one.

    shardlab data prepare stdlib --train-bpe 4096 --out runs/data/stdlib-bpe.tok
    shardlab data prepare 'corpus/**/*.md' notes.txt --tokenizer bytes --out runs/data/notes.tok
    shardlab data prepare shards/ --jsonl-field text --tokenizer gpt2/tokenizer.json --out owt.tok --workers 8
    shardlab data inspect runs/data/stdlib-bpe.tok
    shardlab train --config configs/gpt-small.toml --set data.source=runs/data/stdlib-bpe.tok

A token file (src/shardlab/data/tokenfile.py) is a 4 KiB JSON header (dtype, vocabulary size,
tokenizer, token count, documents) followed by the ids and the documents' start offsets. The trainer
reads the header: model.vocab_size follows the tokenizer's vocabulary (padded to a multiple of 64 and
of the tp degree) and samples are decoded with the same tokenizer. Nothing is downloaded: tokenizers
are files on disk or trained here.
"""

DOCTOR_DOC = """`shardlab doctor DIR`: read every rank's flight record and name where the ranks parted.

    shardlab doctor /tmp/shardlab-flight-abc123          # the directory a failed launch named
    shardlab doctor runs/flight --json report.json       # also the findings as JSON ('-': stdout only)
    kill -USR1 <launcher pid>                            # a running job: every rank writes its record

Each rank keeps its last operations (SHARDLAB_FLIGHT_SIZE, default 256) and writes them as
rank{R}.json on a collective timeout, on failure, and on SIGUSR1 (docs/reliability.md). The doctor
lines them up by group and sequence number and reports the first operation where ranks differ (another
operation or shape), the first one some rank never started, and the rank(s) everyone else waited on,
with their last operation and call site. It reads files only: no ranks are started.
"""

GENERATE_DOC = """`shardlab generate`: continue a prompt with a trained model, from a checkpoint or a Hugging Face directory.

    shardlab generate runs/gpt-small --prompt "def " --tokens 200
    shardlab generate runs/gpt-small/checkpoints/step_00000200 --temperature 0.7 --top-k 50 --top-p 0.9 --seed 3
    shardlab generate hf-model --prompt "import os" --temperature 0       # greedy (transformers' do_sample=False)
    shardlab generate runs/owt --tokenizer gpt2/tokenizer.json           # a raw-id run names no tokenizer
    shardlab generate runs/gpt-small --tp 2 --pp 2                        # 4 ranks, for a model one cannot hold

A checkpoint saved under any layout is read into the plain model its saved configuration describes,
in one process (checkpoints reshard on load, docs/checkpoints.md), or with --tp/--pp into that layout
over as many ranks (local, or under torchrun), and decoded with the run's own
tokenizer; a Hugging Face directory (GPT-2 or Llama; `checkpoint export --hf` writes one) with the
tokenizer.json beside it. The prompt is printed with its continuation.
"""

TOPO_DOC = """`shardlab topo`: what this machine offers distributed training.

CPU model, sockets, physical and logical cores, NUMA nodes, memory; GPUs with memory and compute
capability; the link between every pair of GPUs (nvidia-smi topo -m: NV# = # bonded NVLinks,
PIX/PXB/PHB/NODE/SYS = PCIe paths of growing distance) with a nominal GB/s; network interfaces;
and the distributed backends this torch build can use.
"""


EXPLAIN_DOC = """\
Derives the plan of a configuration's [sharding] rules (docs/sharding.md) on the model it describes
(built on the meta device: no memory, no ranks) and prints, per module in forward order, where its input
and output live, how its weights are cut, and each collective that reconciles producer and consumer:
the comm.autograd function, its group (the mesh axis, its size and rank 0's members), what it moves
forward and backward (the nccl-tests size of the buffer, per micro-batch) and the planner's predicted
time for it on --hardware (plan/comm.py's alpha-beta model of the group's links). Context parallelism
(seq over cp) shows each attention core's ring: the key/value messages sent to the next cp rank
('sendrecv xN': N steps of one message each way, forward and again backward) and the key/value
gradients passed back in backward, each step timed as one point-to-point exchange (plan/comm.py
p2p_time). Rules that place whole modules show where they go: with layers over pp, each module's
pipeline rank and, at every chunk boundary, the hidden states sent on ('p2p', and their gradient
back); with experts over ep, each mixture's three all-to-alls (per-expert counts, dispatch, combine;
the rows' size is the most that can move, top_k rows per token) and the dense and expert weights'
separate gradient reductions. Totals per step at the end (model-axis and cp collectives x micro-batches, plus the
data-parallel engine's, once per step).

The rules are sharding.compute (how activations and weights in compute are laid out) and
sharding.params (storage where it differs: embed=dp is FSDP), as 'logical=axis' text or TOML tables.

examples:
  shardlab explain --config configs/gpt-small.toml --tp 2 \\
      --set 'sharding.compute={heads="tp", mlp="tp", vocab="tp"}'
  shardlab explain --model mlp --tp 2 --set sharding.compute=mlp=tp --json plan.json
  shardlab explain --config configs/gpt-small.toml --dp 2 --tp 2 \\
      --set 'sharding.compute=heads=tp, mlp=tp, vocab=tp, seq=tp' --set sharding.params=embed=dp
  shardlab explain --model gpt --dp 2 --tp 2 --cp 2 \\
      --set 'sharding.compute=heads=tp, mlp=tp, vocab=tp, seq=cp' --set sharding.params=embed=dp
  shardlab explain --config configs/gpt-moe-rules.toml     # layers over pp, experts over ep
"""


def add_explain_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="the collectives [sharding] rules derive, per module, before launch",
                       description=EXPLAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(p)
    p.add_argument("--hardware", default="h100-sxm", metavar="NAME",
                   help="the planner's hardware preset for predicted times (plan/hardware.py; default h100-sxm)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the plan as JSON to PATH ('-' or no value: to stdout instead of the table)")
    p.set_defaults(func=Run("shardlab.cli.explain"))


MEMORY_DOC = """\
For each ZeRO stage, the bytes of parameters, gradients and optimizer state one rank holds:
predicted by the formulas of the ZeRO paper (Rajbhandari et al. 2020), with Psi parameters, N ranks
and the precision's bytes per parameter (--precision; fp32 AdamW: 4 + 4 + 8; bf16 or fp16 with fp32
master weights: 2 + 2 + 12, the paper's mixed-precision Adam):

  stage 0 (DDP)  (P + G + K) Psi      stage 2  P Psi + (G + K) Psi / N
  stage 1        (P + G) Psi + K Psi / N      stage 3  (P + G + K) Psi / N

and measured on real ranks: the model is wrapped by each stage, trained two steps, and when the second
step's backward has finished the tensors each rank holds are counted by storage (never RSS, which keeps
freed memory). The step's peak of all tensor memory, activations included, is shown beside.
Without --config: the GPT of the default configuration (4 layers, d_model 128, 0.84 M parameters),
global batch 12, sequence 64.

examples:
  shardlab memory --model gpt --dp 4
  shardlab memory --model gpt --dp 4 --precision bf16
  shardlab memory --config configs/mlp-2048.toml --dp 2 --stages 0,1,2 --json mem.json
  shardlab memory --model gpt --dp 8 --predict-only     # formulas only, no ranks started
"""


def add_memory_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="model-state memory per rank by ZeRO stage: formulas beside measurement",
                       description=MEMORY_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(p)
    p.add_argument("--stages", type=int_list, default=[0, 1, 2, 3], help="ZeRO stages to show (default: 0,1,2,3)")
    p.add_argument("--predict-only", action="store_true", help="print the formulas' figures without starting ranks")
    p.add_argument("--json", default=None, metavar="PATH", help="write predicted and measured figures as JSON")
    add_launch_options(p)
    p.set_defaults(func=Run("shardlab.cli.memory"))


COLLECTIVES = ["all_reduce", "reduce_scatter_all_gather", "broadcast", "scatter", "gather", "reduce", "all_to_all"]
"""What `shardlab collectives` demonstrates (--ops), in order."""


def add_collectives_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "collectives",
        help="show what each collective does, rank by rank",
        description=COLLECTIVES_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world-size", "-n", type=int, default=None,
                   help="number of local ranks (default: 4; under torchrun, its WORLD_SIZE)")
    p.add_argument("--impl", default="torch",
                   help="'torch' for the backend's collectives, or one of our algorithms (ring, tree, rd, "
                        "pairwise, hierarchical); operations the algorithm lacks use the backend "
                        "(default: %(default)s)")
    p.add_argument("--ops", type=name_list, default=COLLECTIVES,
                   help=f"comma-separated subset of {','.join(COLLECTIVES)} (default: all)")
    add_launch_options(p)
    p.set_defaults(func=Run("shardlab.cli.collectives"))


def add_topo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topo", help="CPUs, memory, GPUs and their links, NICs, available backends",
                       description=TOPO_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON ('-' for stdout only)")
    p.set_defaults(func=Run("shardlab.cli.topo"))


SCHEDULE_DOC = """\
Draw a pipeline schedule as planned: every rank's action list (schedules as data) simulated with
unit-time forwards and backwards twice as long (split into equal input- and weight-gradient halves
for zb1), no message latency. Prints the theoretical bubble fraction beside the simulated one, the
most microbatches each rank holds in flight, and the chart in text; --out writes it as a PNG.

  naive        one microbatch at a time through the whole pipeline: bubble (p-1)/p
  gpipe        all forwards, then all backwards (Huang et al. 2019): (p-1)/(m+p-1), m in flight
  1f1b         PipeDream-flush (Narayanan et al. 2021): the same bubble, at most p - rank in flight
  interleaved  1F1B over v chunks per rank (Megatron-LM): (p-1)/(v m+p-1); needs m divisible by p
  zb1          ZB-H1 (Qi et al. 2023): backward split, weight gradients fill the bubble: (p-1)/(3m+p-1)
  interleaved-zb  interleaved with ZB-H1's split (Qi et al. 2023): ZB-H1's bubble over v; m divisible by p
  zbv          ZB-V (Qi et al. 2024): two chunks per rank as a V (r and 2p-1-r), B and W split:
               (p-1)/(6m+p-1) at equal times, 2p chunk-microbatches in flight (1F1B's memory)
  dualpipev    DualPipeV (DeepSeek-V3 2024): forwards of one leg paired with backwards of the other,
               m >= 2p; 2p+1 chunk-microbatches in flight

examples:
  shardlab viz schedule --schedule 1f1b --stages 4 --microbatches 8 --out s.png
  shardlab viz schedule --schedule interleaved --stages 4 --microbatches 8 --virtual-stages 2
  shardlab viz schedule --schedule zb1 --stages 4 --microbatches 8 --actions
  shardlab viz schedule --schedule zbv --stages 4 --microbatches 8
"""


MEASURE_DOC = """\
Run real pipeline steps on local ranks (one per stage) and report, per schedule and microbatch count:
the measured bubble fraction (idle share of rank-time between the first compute and the last;
median and best of the timed steps),
the papers' formula with the measured forward/backward times, the plan simulated with those times,
the step time, and the activation memory per stage (peak live tensor storage during forward and
backward above what the step started with; 1F1B holds at most p - rank microbatches, GPipe m).
--trace and --out write the measured timeline (median step) as Chrome-trace JSON and as a chart; with
several cases each file name gets the case appended.

examples:
  shardlab viz measure --schedule 1f1b --stages 2 --microbatches 8 --trace t.json --out t.png
  shardlab viz measure --schedule gpipe,1f1b,zb1 --stages 2 --microbatches 1,4,8 --json bubble.json
"""


def add_viz_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("viz", help="pipeline schedules as Gantt charts: planned (schedule) and measured (measure)",
                       description="Pictures of pipeline schedules. `viz schedule`: the plan, simulated. "
                                   "`viz measure`: real steps on local ranks, timed and drawn.")
    kinds = p.add_subparsers(dest="viz", metavar="WHAT")
    _add_schedule(kinds)
    _add_measure(kinds)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _common(q: argparse.ArgumentParser, many: bool) -> None:
    if many:
        q.add_argument("--schedule", type=name_list, default=["1f1b"], metavar="KIND[,KIND]",
                       help=f"schedules, comma-separated: {', '.join(KINDS)} (default: 1f1b)")
        q.add_argument("--microbatches", type=int_list, default=[8], metavar="M[,M]",
                       help="microbatches per step, comma-separated (default: 8)")
    else:
        q.add_argument("--schedule", choices=KINDS, default="1f1b", help="the schedule (default: 1f1b)")
        q.add_argument("--microbatches", type=int, default=8, help="microbatches per step, m (default: 8)")
    q.add_argument("--stages", type=int, default=4 if not many else 2, help="pipeline stages (ranks), p")
    q.add_argument("--virtual-stages", type=int, default=2, metavar="V",
                   help="chunks per rank for interleaved and interleaved-zb, v (the V schedules always hold 2; "
                        "ignored by the others; default: 2)")
    q.add_argument("--out", default=None, metavar="PNG", help="write the Gantt chart here")
    q.add_argument("--trace", default=None, metavar="JSON", help="write the timeline as Chrome-trace JSON "
                                                                 "(chrome://tracing, ui.perfetto.dev)")
    q.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")


def _add_schedule(kinds: argparse._SubParsersAction) -> None:
    q = kinds.add_parser("schedule", help="draw a schedule as planned, with its theoretical bubble",
                         description=SCHEDULE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(q, many=False)
    q.add_argument("--times", default="F=1,B=2,BI=1,BW=1", metavar="OP=T,...",
                   help="time of each op for one microbatch through a whole stage (default: %(default)s)")
    q.add_argument("--actions", action="store_true", help="also print every rank's full action list")
    q.add_argument("--width", type=int, default=200, help="widest text chart, in characters (default: 200)")
    q.set_defaults(func=Run("shardlab.cli.viz:run_schedule"))


def _add_measure(kinds: argparse._SubParsersAction) -> None:
    q = kinds.add_parser("measure", help="time real pipeline steps: bubble vs theory, activation memory per stage",
                         description=MEASURE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(q, many=True)
    q.add_argument("--model", choices=["mlp", "gpt"], default="mlp", help="model to split (default: mlp)")
    q.add_argument("--d-model", type=int, default=256, help="model width (default: 256)")
    q.add_argument("--layers", type=int, default=8, help="layers (blocks for the GPT; default: 8)")
    q.add_argument("--batch", type=int, default=2048, help="rows per step, split into microbatches (default: 2048)")
    q.add_argument("--seq-len", type=int, default=64, help="GPT sequence length (default: 64)")
    q.add_argument("--steps", type=int, default=3, help="timed steps per case, after one warm-up (default: 3)")
    q.add_argument("--sleep-us", type=float, default=0.0, metavar="US",
                   help="make every layer also sleep US microseconds per row (forward; twice in backward): "
                        "work that does not compete for the CPU, to see the schedule's own bubble on a busy machine")
    add_launch_options(q)
    q.set_defaults(func=Run("shardlab.cli.viz:run_measure"))


def add_checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect a checkpoint, or consolidate it into one state dict",
                       description=CHECKPOINT_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ins = actions.add_parser("inspect", help="what a checkpoint holds (step, ranks, files, every tensor's slices) and "
                                                  "whether every file passes its checks (exit status 1 if not)")
    ins.add_argument("path", help="a checkpoint directory, or a root holding checkpoints (its newest is shown)")
    ins.add_argument("--json", metavar="PATH", help="write the description as JSON ('-' for stdout only)")
    ins.add_argument("--all", action="store_true", help="list every tensor (default: parameters, then a count)")
    con = actions.add_parser("consolidate", help="write the whole model state dict to one file (a checkpoint that "
                                                      "fails its checks is refused)")
    con.add_argument("path", help="a checkpoint directory, or a root holding checkpoints (its newest is used)")
    con.add_argument("--out", required=True, help="the file to write (torch.save; load with weights_only=True)")
    con.add_argument("--optimizer", action="store_true",
                     help="also the optimizer state: writes {'model': ..., 'optimizer': ..., 'step': N}")
    exp = actions.add_parser("export", help="write the model in another library's format: Hugging Face "
                                            "(safetensors + config.json) or torch.distributed.checkpoint")
    exp.add_argument("path", help="a checkpoint directory, or a root holding checkpoints (its newest is used)")
    exp.add_argument("--hf", metavar="OUT",
                     help="write OUT/model.safetensors, config.json, generation_config.json and the run's tokenizer "
                          "(tokenizer.json, tokenizer_config.json: AutoTokenizer.from_pretrained(OUT)), loadable "
                          "with transformers' AutoModelForCausalLM.from_pretrained(OUT) as GPT2LMHeadModel (layernorm, gelu, learned "
                          "positions) or LlamaForCausalLM (rmsnorm, swiglu, rotary); other shapes are refused with "
                          "the reason (checkpoint/hf.py)")
    exp.add_argument("--dcp", metavar="OUT",
                     help="write the model (and the optimizer state, unless --no-optimizer) as a "
                          "torch.distributed.checkpoint directory: {'model': ..., 'optimizer': ..., 'step': N}, "
                          "loadable with torch.distributed.checkpoint.load (checkpoint/dcp.py)")
    exp.add_argument("--no-optimizer", action="store_true", help="--dcp: the model only")
    exp.add_argument("--overwrite", action="store_true",
                     help="write into an OUT that already holds a model, replacing its files (without it, such an "
                          "OUT is refused: a model or tokenizer there would be replaced, or mixed with this one)")
    p.set_defaults(func=Run("shardlab.cli.checkpoint"))


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained model (a checkpoint or a Hugging Face "
                                        "directory), through its tokenizer",
                       description=GENERATE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a run directory (its checkpoints/, newest step), a checkpoint root or step_N "
                                "directory, or a Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("--prompt", "-p", default="", help="the text to continue (default: the tokenizer's end-of-text "
                                                      "token, i.e. the start of a document)")
    p.add_argument("--tokens", "-n", type=int, default=200, metavar="N", help="tokens to generate (default 200)")
    p.add_argument("--temperature", "-t", type=float, default=0.8,
                   help="divides the logits before sampling; 0: greedy, the most likely token each time (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, metavar="K",
                   help="sample among the K most likely tokens only; 0: all (default 40)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="then among the most likely tokens whose probabilities sum to P (nucleus); 1: all (default)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the draws (default 0)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="a tokenizer.json, a tiktoken file or 'bytes' instead of the run's (or the directory's) own")
    p.add_argument("--device", default="cpu", help="one process: where the model runs: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks holding the model (a shardlab checkpoint)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages holding the model (a shardlab checkpoint)")

    add_launch_options(p)
    p.set_defaults(func=Run("shardlab.cli.generate"))


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="tokenize text into a token file (prepare), or describe one (inspect)",
                       description=DATA_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare", help="tokenize text files, directories, globs, JSONL or Parquet into one token file",
        description="Tokenize SOURCEs into one memory-mapped token file, in parallel over files. A run that "
                    "stops leaves OUT.parts/ behind; running the same command again keeps the files already "
                    "encoded and does the rest.")
    prep.add_argument("sources", nargs="+", metavar="SOURCE",
                      help="'stdlib' (this machine's Python standard library sources), a directory (its .py, .md, "
                           ".txt, ... .jsonl and .parquet files, recursively, also as .gz/.zst), a glob in quotes "
                           "('**' recursive) or a file. Content decides how a file is read, whatever its name: "
                           "JSON Lines give one document per line, a JSON array of records one per record, "
                           "Parquet one per row, gzip and zstd are decompressed, anything else is one text")
    prep.add_argument("--out", "-o", required=True, metavar="FILE", help="the token file to write")
    prep.add_argument("--tokenizer", default="bytes", metavar="bytes|FILE",
                      help="'bytes' (one id per byte, vocabulary 256; the default), a Hugging Face tokenizer.json, "
                           "or a tiktoken rank file (.tiktoken); never downloaded")
    prep.add_argument("--train-bpe", type=int, default=0, metavar="VOCAB_SIZE",
                      help="first train a byte-level BPE of VOCAB_SIZE ids on the sources (Hugging Face tokenizers), "
                           "save it as --tokenizer-out and encode with it (replaces --tokenizer)")
    prep.add_argument("--tokenizer-out", default=None, metavar="FILE",
                      help="where --train-bpe saves its tokenizer (default: beside --out, named after it: "
                           "c.tok -> c.tokenizer.json); an existing file that is not --out's own tokenizer is refused")
    prep.add_argument("--jsonl-field", "--field", dest="field", default="text", metavar="NAME",
                      help="the text field of JSONL records and the text column of Parquet files (default: text)")
    prep.add_argument("--workers", type=int, default=0, metavar="N",
                      help="processes encoding files in parallel (default: one per core; 1: no pool)")
    prep.add_argument("--max-bytes", type=int, default=0, metavar="N",
                      help="read whole files, in order, until their sizes reach N bytes (default: all)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    ins = actions.add_parser("inspect", help="a token file's header, its first ids and their text")
    ins.add_argument("path", help="a token file written by `shardlab data prepare`")
    ins.add_argument("--json", action="store_true", help="the header as JSON")
    ins.add_argument("--show", type=int, default=32, metavar="N", help="decode the first N ids (0: none)")
    p.set_defaults(func=Run("shardlab.cli.data"))


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="explain a hang or divergence from the ranks' flight records",
                       description=DOCTOR_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="directory holding the ranks' flight records (rank0.json, rank1.json, ...)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks the job had, when no record says it (ranks without a record are reported)")
    p.add_argument("--json", metavar="PATH", help="write the diagnosis as JSON ('-' for stdout only)")
    p.set_defaults(func=Run("shardlab.cli.doctor"))
