"""What a run trains: the model built from the configuration, and the batches it trains on.

A Task pairs a model with its data so that the loop, `verify` and `bench train` never need to know
which model they drive: `task.batch(step, dp_rank, dp_size, micro_batches, micro)` gives a rank's
(inputs, targets), `task.global_batch(step)` the whole batch a single process would see, and
`tokens_per_row` / `flops_per_token` turn step times into tokens/s and MFU.

  gpt  text as bytes or a token file's ids (train/batches.py, train/corpus.py), held-out tail for
       validation loss; the vocabulary comes from the data (model.vocab_size = 0).
  mlp  the lecture's deep MLP regressing a fixed random "teacher" network's output on Gaussian
       inputs: synthetic (the lecture's model has no natural dataset) but learnable, so the loss
       falls, and drawn per (seed, step) like the text sampler so ranks split it exactly.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn as nn

from shardlab.checkpoint.hf import read_hf
from shardlab.data.tokenizer import Tokenizer
from shardlab.models import GPT, DeepMLP, GPTConfig, MLPConfig
from shardlab.parallel.precision import apply_precision
from shardlab.train.corpus import DataSource, load_corpus
from shardlab.train.corpus_checks import check_token_ids
from shardlab.train.batches import VOCAB_SIZE, BatchSampler, FileStamp, split_tokens
from shardlab.train.sections import ModelSection

Batch = tuple[torch.Tensor, torch.Tensor]


def build_model(m: ModelSection, vocab_size: int = 0) -> nn.Module:
    """The plain model a configuration describes (no parallelism applied). The GPT's vocabulary:
    vocab_size, else model.vocab_size, else bytes' 256 (train/resolve.py's Run.vocab is the data's, resolved)."""
    if m.name == "mlp":
        return DeepMLP(MLPConfig(d_model=m.d_model, n_layer=m.n_layer, bias=m.bias))
    return GPT(gpt_config(m, vocab_size))


_META_MODELS: dict[tuple[str, int], nn.Module] = {}


def meta_model(m: ModelSection, vocab_size: int = 0) -> nn.Module:
    """build_model on the meta device (no memory), remembered per model section: building a large
    GPT takes seconds even there, and a planner's search has config_check look at many layouts of
    one model (train/plan_config.py). Shared and read-only: callers must not change it."""
    key = (repr(m), vocab_size)
    if key not in _META_MODELS:
        if len(_META_MODELS) >= 8:
            _META_MODELS.clear()
        _META_MODELS[key] = empty_model(m, vocab_size)
    return _META_MODELS[key]


def empty_model(m: ModelSection, vocab_size: int = 0) -> nn.Module:
    """build_model on the meta device, without initialising (there is nothing to fill): the shapes,
    names and tying of a model of any size, allocated nowhere. A fresh one, for callers that change it."""
    with torch.device("meta"), _fills_skipped():
        return build_model(m, vocab_size)


# torch.nn.init's in-place fills, as modules' constructors and the models' own init call them.
_FILLS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
          "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


@contextmanager
def _fills_skipped() -> Iterator[None]:
    """torch.nn.init's fills made no-ops while a meta model is built: a meta tensor has no values to
    fill, and meta's random fills run as Python decompositions (about 3 ms each, 4 s of GPT-3's 8 s
    search in `shardlab plan --gpus 1024`). Only shapes, dtypes and parameter identity (tying) are
    read from a meta model, and none of them depends on the fills."""
    saved = {name: getattr(nn.init, name) for name in _FILLS}
    for name in saved:
        setattr(nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def gpt_config(m: ModelSection, vocab_size: int = 0) -> GPTConfig:
    """The GPT's configuration for a model section (one mapping, used by the trainer, the Hugging
    Face export and import, and the planner's presets)."""
    return GPTConfig.from_section(m, vocab_size or m.vocab_size or VOCAB_SIZE)


def prepare_model(m: ModelSection, vocab: int, seed: int, precision: str) -> nn.Module:
    """Build the model from the run's seed and apply the model options that are not architecture:
    frozen parameters (model.freeze) and the compute precision (layout.precision). Every rank and every
    reference built this way starts from identical weights. `vocab`: the GPT's resolved vocabulary
    (train/resolve.py's Run.vocab)."""
    torch.manual_seed(seed)
    model = build_model(m, vocab if m.name == "gpt" else 0)
    if m.init_from_hf:
        load_hf_weights(model, m.init_from_hf)
    for name, p in model.named_parameters():
        if m.frozen(name):
            p.requires_grad_(False)
    return apply_precision(model, precision)


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str) -> None:
    """Copy the Hugging Face checkpoint in `path` into the plain GPT `model` (checkpoint/hf.py maps
    the names); a ValueError names the tensors whose shapes or names do not fit the model.*
    fields (`shardlab train --init-from-hf` sets them from the checkpoint's config.json)."""
    if not isinstance(model, GPT):
        raise ValueError(f"model.init_from_hf = {path!r}: only the GPT loads Hugging Face weights")
    state = read_hf(path, model.cfg)
    problem = hf_misfit(model, state, path)
    if problem:
        raise ValueError(problem)
    model.load_state_dict({n: state[n] for n in model.state_dict()})


def hf_misfit(model: GPT, state: dict[str, torch.Tensor], path: str) -> str | None:
    """Why the state dict read_hf made of the checkpoint in `path` does not fit `model` (None: it
    fits): the tensors of another shape and those missing. Also run before launch on meta tensors."""
    own = model.state_dict()
    wrong = [f"{n} {tuple(t.shape)} (model {tuple(own[n].shape)})" for n, t in state.items()
             if n in own and own[n].shape != t.shape]
    missing = sorted(set(own) - set(state))
    if not (wrong or missing):
        return None
    return (f"model.init_from_hf = {path!r} does not fit model.* ({model.cfg.n_layer} layers, d_model "
            f"{model.cfg.d_model}): " + "; ".join(wrong + [f"{n} not in the checkpoint" for n in missing]))


def first_layer(model: nn.Module) -> nn.Module:
    """Layer 0 of a GPT (its first block) or of the MLP."""
    return model.blocks[0] if isinstance(model, GPT) else model.layers[0]


def skip_layer(model: nn.Module) -> Callable[[], None]:
    """Bypass layer 0 until the returned function is called: its output becomes its input, so its
    parameters take no part in the loss and get no gradient this step (LayerDrop-style)."""
    handle = first_layer(model).register_forward_hook(lambda mod, args, out: args[0])
    return handle.remove


class RegressionSampler:
    """Rows x ~ N(0, 1) in d dims, targets y = teacher(x): a fixed random two-layer network."""

    def __init__(self, d_model: int, global_batch: int, seed: int, teacher_seed: int | None = None) -> None:
        self.d, self.global_batch_size, self.seed = d_model, global_batch, seed
        gen = torch.Generator().manual_seed((seed if teacher_seed is None else teacher_seed) + 7919)
        self.w1 = torch.randn(d_model, d_model, generator=gen) / math.sqrt(d_model)
        self.w2 = torch.randn(d_model, d_model, generator=gen) / math.sqrt(d_model)

    def _rows(self, step: int, start: int, stop: int) -> Batch:
        # The whole batch is drawn so every rank sees the same stream; each keeps its rows.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(self.global_batch_size, self.d, generator=gen)[start:stop]
        return x, torch.tanh(x @ self.w1) @ self.w2

    def global_batch(self, step: int) -> Batch:
        return self._rows(step, 0, self.global_batch_size)

    def batch(self, step: int, dp_rank: int, dp_size: int, micro_batches: int = 1, micro: int = 0) -> Batch:
        per_rank = self.global_batch_size // dp_size
        per_micro = per_rank // micro_batches
        start = dp_rank * per_rank + micro * per_micro
        return self._rows(step, start, start + per_micro)


@dataclass
class Task:
    """A configuration's training and validation batches, and its cost per row."""

    train: BatchSampler | RegressionSampler
    val: BatchSampler | RegressionSampler
    tokens_per_row: int
    flops_per_token: float
    tokenizer: Tokenizer | None = None
    """The GPT's: prompts are encoded and samples decoded with it (None: a raw id file naming none)."""
    bytes_per_token: float | None = None
    """Bytes of text per token (1 for bytes; a token file's header says): turns loss into bits per byte."""
    files: list[FileStamp] = field(default_factory=list)
    """The raw .bin files the samplers map, as opened (check_files() says if one changed); a token file is
    replaced by a rename (`data prepare`), so the run keeps reading the one it opened."""

    def check_files(self) -> None:
        """RuntimeError naming a data file rewritten since the run opened it (one stat each)."""
        for f in self.files:
            f.check()

    def batch(self, step: int, dp_rank: int, dp_size: int, micro_batches: int = 1, micro: int = 0) -> Batch:
        return self.train.batch(step, dp_rank, dp_size, micro_batches, micro)

    def global_batch(self, step: int) -> Batch:
        return self.train.global_batch(step)


@dataclass(frozen=True)
class Batches:
    """What the samplers need from the schedule: sequences (or rows) per step over all ranks, the seed
    that orders them, and the GPT's window (model.seq_len)."""

    global_batch: int
    seed: int
    seq_len: int = 0


def build_task(model: nn.Module, data: DataSource | None, batches: Batches,
               tokens: np.ndarray | None = None) -> Task:
    """Samplers for the plain model: the GPT's over `data` (its ids checked against the model's
    vocabulary), the MLP's synthetic rows (data None). `tokens` may be passed in (already loaded) to skip reading the
    corpus again."""
    if isinstance(model, DeepMLP):
        # Validation rows use another seed: fresh inputs from the same teacher.
        d, b = model.cfg.d_model, batches
        train = RegressionSampler(d, b.global_batch, b.seed)
        val = RegressionSampler(d, b.global_batch, b.seed + 1_000_000, teacher_seed=b.seed)
        return Task(train, val, tokens_per_row=1, flops_per_token=model.flops_per_sample())
    assert data is not None, "a GPT trains on data (DataSource)"
    d = data.section
    if data.needs_preparing:
        raise ValueError(f"data.source = {d.source!r} with data.tokenizer = {d.tokenizer!r} must be "
                         f"encoded first (a tokenizer other than bytes, records or compressed files): shardlab train "
                         f"does it before launch (train.resolve's Run.prepared), or make a token file with "
                         f"`shardlab data prepare`")
    seq = batches.seq_len
    if tokens is None:
        tokens = load_corpus(data, seq, split=not d.val_source)
    # A token file's header; raw ids are scanned.
    check_token_ids(data, model.cfg.vocab_size, tokens, scan=False)
    val_src = data.val()
    if val_src is not None:  # a separate validation file: the training source is used whole
        train_tokens, val_tokens = tokens, load_corpus(val_src, seq, split=False)
    else:
        train_tokens, val_tokens = split_tokens(tokens, d.val_fraction)
    return Task(
        BatchSampler(train_tokens, seq, batches.global_batch, seed=batches.seed),
        BatchSampler(val_tokens, seq, batches.global_batch, seed=batches.seed + 1),
        tokens_per_row=seq,
        flops_per_token=model.flops_per_token(seq),
        tokenizer=data.tokenizer,
        bytes_per_token=data.bytes_per_token,
        files=[FileStamp(s.path, s.field) for s in (data, val_src) if s is not None and s.kind == "bin"],
    )
