"""The trainer's own configuration sections (model, data, optim, train, log, checkpoint): typed
dataclasses, each field documented by the string right after it (what `shardlab train --help-config`
prints). train/config.py composes them with [layout] and [sharding] into one Config.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass


@dataclass
class ModelSection:
    """Which model to build and its size."""

    name: str = "gpt"
    """'gpt' (a decoder on text: bytes or any tokenizer's ids) or 'mlp' (the lecture's deep MLP on a regression task)."""
    n_layer: int = 4
    """Blocks (GPT) or d x d layers (MLP)."""
    d_model: int = 128
    """Width of the residual stream (GPT) or of every layer (MLP)."""
    n_head: int = 4
    """GPT attention heads; d_model must divide by it."""
    n_kv_head: int = 0
    """GPT key/value heads (grouped-query attention); 0: same as n_head, 1: multi-query."""
    d_ff: int = 0
    """GPT feed-forward width; 0: 4 x d_model."""
    seq_len: int = 128
    """GPT context length: tokens per training sequence."""
    vocab_size: int = 0
    """GPT token ids (embedding and output rows); 0: the data's vocabulary (256 for bytes, a token file's
    header, data.vocab_size for a raw .bin) padded up to a multiple of 64 and of layout.tp, as Megatron-LM
    does. A corpus with an id at or past it is refused before launch; larger than the data's ids is
    allowed (a Hugging Face model's vocabulary, a preset's)."""
    rotary: bool = False
    """GPT: rotary position embedding instead of a learned position table."""
    tie_embeddings: bool = True
    """GPT: the output head shares the token embedding's weight."""
    bias: bool = False
    """Biases in linear layers. Off by default: a key bias gets an exactly-zero gradient (softmax
    ignores a shift shared by all keys), which Adam turns into noise-driven steps."""
    dropout: float = 0.0
    """GPT dropout probability (0 keeps runs deterministic and comparable)."""
    freeze: str = ""
    """Comma-separated glob patterns of parameter names to freeze, e.g. 'pos_emb.*,blocks.0.*'."""
    skip_layer_every: int = 0
    """Stress test for gradient sync: on every K-th step layer 0 is bypassed, so its parameters
    get no gradient on that step (as with LayerDrop); 0 disables."""
    experts: int = 0
    """GPT: experts per mixture-of-experts MLP (every block's MLP becomes one, models/moe.py); 0: dense
    MLPs. With layout.ep > 1 they are spread over the ep ranks (docs/expert-parallel.md)."""
    top_k: int = 2
    """GPT with experts: experts each token is sent to (its k most probable under the router)."""
    capacity_factor: float = 1.25
    """GPT with experts: an expert takes at most ceil(factor x seq_len x top_k / experts) of one
    sequence's assignments, the rest dropped (first choices, then earlier positions, kept first);
    <= 0: no limit."""
    aux_loss_coef: float = 0.01
    """GPT with experts: weight of the load-balancing loss (Switch Transformer's, per sequence)."""
    norm: str = "layernorm"
    """GPT: 'layernorm' (gain and bias: GPT-2) or 'rmsnorm' (gain only: Llama)."""
    mlp: str = "gelu"
    """GPT: the feed-forward MLP: 'gelu' (exact, erf GELU), 'gelu_tanh' (GPT-2's tanh approximation,
    Hugging Face's gelu_new) or 'swiglu' (Llama: gate and up projections, SiLU, down projection;
    model.d_ff is then the width of each of the three matrices)."""
    norm_eps: float = 1e-5
    """GPT: epsilon of every norm (GPT-2 and Llama 3 use 1e-5)."""
    rope_theta: float = 10000.0
    """GPT with model.rotary: the rotary base (10000: RoFormer, Llama 2; 500000: Llama 3)."""
    loss: str = "full"
    """GPT: how the head and the cross-entropy run. 'full': the head's logits for every token (tokens x
    vocab, and their fp32 copy), then the cross-entropy; 'chunked': the two fused over model.loss_chunk
    tokens at a time, the gradients made in the same pass, so the whole logits never exist (the same
    loss and gradients up to rounding; less memory, models/fused_loss.py; `--loss`)."""
    loss_chunk: int = 1024
    """GPT with model.loss = 'chunked': tokens per chunk (one chunk's logits, chunk x vocab, exist at a time)."""
    init_from_hf: str = ""
    """GPT: start from the weights of a local Hugging Face GPT-2 or Llama checkpoint (a directory with
    config.json and *.safetensors, as save_pretrained writes; nothing is downloaded). `shardlab train
    --init-from-hf DIR` also sets the model.* shape fields from its config.json; a seq_len below the
    checkpoint's keeps the first rows of GPT-2's position table. '': the seed's random weights."""

    def frozen(self, parameter_name: str) -> bool:
        """Whether model.freeze's patterns name the parameter."""
        patterns = [p.strip() for p in self.freeze.split(",") if p.strip()]
        return any(fnmatch.fnmatchcase(parameter_name, p) for p in patterns)


@dataclass
class DataSection:
    """Where the training tokens come from (GPT). The MLP trains on a synthetic regression task."""

    source: str = "stdlib"
    """'stdlib' (the Python standard library's sources on this machine), a directory, a glob, a
    text file, a token file from `shardlab data prepare` (its header names vocabulary and tokenizer),
    or a raw id file (.bin, nanoGPT's format; see data.vocab_size)."""
    tokenizer: str = "bytes"
    """For a text source: 'bytes' (one id per byte, read directly), 'bpe' (a byte-level BPE of
    data.bpe_vocab ids trained on the source) or a tokenizer.json / .tiktoken file; other than bytes,
    the text is first encoded into a token file under data.cache_dir, once, and reused. For a raw
    .bin: the tokenizer it was made with, to sample text. Nothing is downloaded."""
    bpe_vocab: int = 4096
    """Ids of the BPE that data.tokenizer = 'bpe' trains."""
    cache_dir: str = "runs/data"
    """Where text encoded for data.tokenizer (other than bytes) is kept, named by source and tokenizer."""
    vocab_size: int = 0
    """A raw .bin's vocabulary (e.g. 50257 for GPT-2's ids), which the file cannot say; above 256 it
    also states its id type: uint16 up to 65,536 ids, uint32 beyond. 0: from a nanoGPT meta.pkl
    beside it, data.tokenizer's vocabulary, or 256 for uint8 ids."""
    token_dtype: str = ""
    """A raw .bin's id type ('uint8', 'uint16', 'uint32'); '': stated by data.vocab_size above 256,
    data.tokenizer's vocabulary, the name (*.u8.bin, *.u16.bin, *.u32.bin) or a nanoGPT meta.pkl
    beside it (uint16); a raw .bin that nothing states is refused."""
    jsonl_field: str = "text"
    """The text field of JSONL records and the text column of Parquet files (`data prepare
    --jsonl-field`): a source naming such files is parsed, record by record, into a token file under
    data.cache_dir before launch, whatever data.tokenizer (their bytes are not text)."""
    max_bytes: int = 0
    """Read at most this many bytes of text (for a token file or .bin: of ids); 0: 64 MiB of text,
    token files whole."""
    val_fraction: float = 0.05
    """Fraction of the corpus held out (its tail) for validation loss (unused with data.val_source)."""
    val_source: str = ""
    """A separate validation file (nanoGPT's val.bin, or a token file), read as data.source is (the
    same kind, dtype and tokenizer); then data.source is trained on whole. '': the tail of data.source."""


@dataclass
class OptimSection:
    """AdamW (decoupled weight decay, Loshchilov & Hutter 2019)."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warm-up."""
    min_lr: float = 1e-4
    """Learning rate at the end of decay."""
    beta1: float = 0.9
    """Decay of the gradient's running mean (Adam's first moment)."""
    beta2: float = 0.95
    """Decay of the squared gradient's running mean (second moment); 0.95 rather than 0.999 is the
    usual choice for transformers, steadier when gradients spike."""
    eps: float = 1e-8
    """Added to the second moment's root: bounds the step of elements whose gradients are ~0."""
    weight_decay: float = 0.1
    """Applied to matrices (2-D and larger) only; biases, norms and 1-D parameters get none."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    loss_scale: float = 65536.0
    """fp16 only: the initial dynamic loss scale (halved on every step whose gradients overflow,
    which is then skipped; doubled after loss_scale_window clean steps)."""
    loss_scale_window: int = 1000
    """fp16 only: clean steps before the loss scale doubles."""
    on_nonfinite: str = "stop"
    """A step whose gradient norm is inf or nan (outside fp16, whose loss scaling skips such steps
    itself): 'stop' the run with an error naming the step and the parameters at fault, or 'skip'
    the update (the gradients are dropped, the weights and optimizer state stay as they were)."""


@dataclass
class TrainSection:
    """The schedule: how long, how big a batch, how the learning rate moves."""

    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 32
    """Sequences (GPT) or rows (MLP) per optimizer step, over all data-parallel ranks."""
    micro_batches: int = 1
    """Micro-batches per step per data-parallel rank: the rank's rows (global_batch / layout.dp)
    are split into this many forward/backward passes. Without a pipeline that is gradient
    accumulation, communicating only after the last; with layout.pp > 1 they are the schedule's
    microbatches (m), the units that flow through the stages (`--microbatches`)."""
    warmup_steps: int = 20
    """Linear warm-up from 0 to optim.lr."""
    decay: str = "cosine"
    """After warm-up: 'cosine' or 'linear' decay to optim.min_lr at the last step, or 'constant'."""
    seed: int = 0
    """Seeds the initial weights and the batch order; the same seed gives the same run."""
    log_every: int = 10
    """Print and record metrics every this many steps (and on the first and last)."""
    eval_every: int = 50
    """Validation loss every this many steps and at the end; 0: only at the end."""
    eval_batches: int = 4
    """Global batches of held-out data per validation."""
    compile: bool = False
    """torch.compile the whole GPT (embedding, blocks, head and loss) where the layout leaves its modules
    as they are (data parallelism, ZeRO-1/2), else every transformer block (train/compile.py): faster
    steps on a GPU after a compilation of some seconds to a minute, under every layout but the zb1
    schedule (`--compile`)."""
    compile_backend: str = "inductor"
    """torch.compile's backend for train.compile: 'inductor' (generated kernels; a C++ compiler on
    CPU, Triton on a GPU), 'aot_eager' (dynamo's capture and AOTAutograd's forward and backward
    graphs, run with eager kernels: what the CPU tests verify) or 'eager' (dynamo's capture only)."""
    deterministic: bool = False
    """The same bits on every layout: losses, gradient norms and parameters of dp (any degree), ZeRO
    and pp (schedules with a whole backward) bit-identical to one process running the same
    micro-batches, and to each other (docs/deterministic.md): micro-batch gradients summed in one canonical tree, the ranks' sums by the
    canonical collective, the gradient norm exact; torch's deterministic algorithms and equal threads
    per rank (SHARDLAB_THREADS, else 1). Layouts it cannot make exact (tp, cp, ep, compile) are refused
    (`--deterministic`)."""


@dataclass
class LogSection:
    """Outputs of a run."""

    out_dir: str = ""
    """Directory for metrics.jsonl, TensorBoard events, loss.png, samples.txt, config.toml;
    '': runs/<config file name> (runs/default without a file)."""
    tensorboard: bool = True
    """Write TensorBoard event files under out_dir/tb."""
    plot: bool = True
    """Write the loss curve as out_dir/loss.png at the end."""
    sample_tokens: int = 300
    """GPT: tokens of text to sample at the end, through the corpus's tokenizer (0: none)."""
    sample_prompt: str = "def "
    """GPT: the text the sample continues."""
    sample_temperature: float = 0.8
    """GPT: softmax temperature of the sample (lower: more likely tokens, less variety)."""
    peak_tflops: float = 0.0
    """Peak throughput per rank for MFU; 0: from the device table (known GPUs), else MFU is not shown."""
    memory: bool = True
    """Measure peak tensor memory per rank on logged steps (on CPU this traces every op of those steps)."""
    wandb: bool = False
    """Also log to Weights & Biases (pip install 'shardlab[wandb]'): TensorBoard's scalars, names and steps,
    and the configuration as the run's config (train/trackers.py)."""
    wandb_project: str = "shardlab"
    """The W&B project; the run is named and grouped after log.out_dir."""
    wandb_mode: str = ""
    """'online', 'offline' (written under out_dir/wandb with no network; `wandb sync` uploads it later) or
    'disabled'; '': wandb's own default (WANDB_MODE, else online)."""
    mlflow: bool = False
    """Also log to MLflow (pip install 'shardlab[mlflow]'): TensorBoard's scalars, names and steps, the
    configuration as parameters and config.toml as an artifact."""
    mlflow_uri: str = ""
    """The MLflow tracking URI ('http://host:5000', 'sqlite:///mlflow.db' with the full mlflow package); '':
    a local file store, out_dir/mlruns (`mlflow ui --backend-store-uri file:OUT/mlruns` shows it)."""
    mlflow_experiment: str = "shardlab"
    """The MLflow experiment the run goes into."""


@dataclass
class CheckpointSection:
    """Sharded checkpoints (docs/checkpoints.md): every rank writes its own slices, published atomically."""

    dir: str = ""
    """Where step_N/ checkpoints go; '': <log.out_dir>/checkpoints."""
    every: int = 0
    """Save every N steps and after the last step; 0: never (but see final)."""
    final: bool = False
    """Save one checkpoint after the last step, even when every is 0: what `shardlab generate` and
    `checkpoint export` read. The shipped configurations set it, so that a run leaves with a model."""
    keep: int = 3
    """How many of the newest checkpoints to keep; 0: all."""
    async_save: bool = True
    """Write in the background: training stalls only for the copy to host memory."""
    save_on_signal: bool = False
    """On SIGTERM, SIGHUP or Ctrl-C, save a checkpoint of the steps done before exiting (preemptible
    clusters warn with SIGTERM), even when every is 0."""
    resume: str = ""
    """'' (start afresh), 'latest' (the newest complete checkpoint under dir that passes its
    integrity checks, newer damaged ones skipped and named; afresh when there is none, so a
    restarted job resumes by itself) or a step_N directory. Any layout loads any other's."""
