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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
import torch.nn as nn

from shardlab.models import GPT, DeepMLP, GPTConfig, MLPConfig
from shardlab.parallel.precision import apply_precision
from shardlab.train.config import Config, ModelSection
from shardlab.train.batches import VOCAB_SIZE, BatchSampler, load_tokens, split_tokens

if TYPE_CHECKING:
    from shardlab.data.tokenizer import Tokenizer

Batch = tuple[torch.Tensor, torch.Tensor]


def build_model(m: ModelSection, vocab_size: int = 0) -> nn.Module:
    """The plain model a configuration describes (no parallelism applied). The GPT's vocabulary:
    vocab_size, else model.vocab_size, else bytes' 256 (train/corpus.py's model_vocab reads the data's)."""
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


def prepare_model(cfg: Config) -> nn.Module:
    """Build the model from the run's seed and apply the model options that are not architecture:
    frozen parameters and the compute precision (layout.precision). Every rank and every reference built
    this way starts from identical weights."""
    from shardlab.train.corpus import model_vocab

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, model_vocab(cfg) if cfg.model.name == "gpt" else 0)
    if cfg.model.init_from_hf:
        load_hf_weights(model, cfg.model.init_from_hf)
    for name, p in model.named_parameters():
        if cfg.frozen(name):
            p.requires_grad_(False)
    return apply_precision(model, cfg.layout.precision)


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str) -> None:
    """Copy the Hugging Face checkpoint in `path` into the plain GPT `model` (checkpoint/hf.py maps
    the names); a ValueError names the tensors whose shapes or names do not fit the model.*
    fields (`shardlab train --init-from-hf` sets them from the checkpoint's config.json)."""
    from shardlab.checkpoint.hf import read_hf

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

    def batch(self, step: int, dp_rank: int, dp_size: int, micro_batches: int = 1, micro: int = 0) -> Batch:
        return self.train.batch(step, dp_rank, dp_size, micro_batches, micro)

    def global_batch(self, step: int) -> Batch:
        return self.train.global_batch(step)


def build_task(cfg: Config, model: nn.Module, tokens: np.ndarray | None = None) -> Task:
    """Samplers for the configuration. `tokens` may be passed in (already loaded) to skip reading
    the corpus again; otherwise it is read from cfg.data."""
    t = cfg.train
    if isinstance(model, DeepMLP):
        # Validation rows use another seed: fresh inputs from the same teacher.
        train = RegressionSampler(cfg.model.d_model, t.global_batch, t.seed)
        val = RegressionSampler(cfg.model.d_model, t.global_batch, t.seed + 1_000_000, teacher_seed=t.seed)
        return Task(train, val, tokens_per_row=1, flops_per_token=model.flops_per_sample())
    from shardlab.train.corpus import bytes_per_token, check_token_ids, corpus_tokenizer, needs_preparing

    if needs_preparing(cfg):
        raise ValueError(f"data.source = {cfg.data.source!r} with data.tokenizer = {cfg.data.tokenizer!r} must be "
                         f"encoded first (a tokenizer other than bytes, or JSONL/Parquet records): shardlab train "
                         f"does it before launch (train.corpus.resolve_data), or make a token file with "
                         f"`shardlab data prepare`")
    if tokens is None:
        tokens = load_corpus(cfg)
    check_token_ids(cfg, tokens, scan=False)  # a token file's header; raw ids are scanned (they have none)
    if cfg.data.val_source:  # a separate validation file: the training source is used whole
        train_tokens, val_tokens = tokens, load_val_corpus(cfg)
    else:
        train_tokens, val_tokens = split_tokens(tokens, cfg.data.val_fraction)
    seq = cfg.model.seq_len
    return Task(
        BatchSampler(train_tokens, seq, t.global_batch, seed=t.seed),
        BatchSampler(val_tokens, seq, t.global_batch, seed=t.seed + 1),
        tokens_per_row=seq,
        flops_per_token=model.flops_per_token(seq),
        tokenizer=corpus_tokenizer(cfg),
        bytes_per_token=bytes_per_token(cfg),
    )


def load_val_corpus(cfg: Config) -> np.ndarray:
    """The ids of data.val_source, read as data.source is (train/corpus.py's val_config)."""
    from shardlab.train.corpus import val_config

    return load_corpus(val_config(cfg), split=False, field="data.val_source")


def load_corpus(cfg: Config, split: bool | None = None, field: str = "data.source") -> np.ndarray:
    """The ids of data.source. split (default: unless data.val_source is set): the validation
    split is this corpus's tail, so both parts need a window."""
    from shardlab.train.corpus import bin_dtype, source_kind

    source = None if cfg.data.source in ("", "stdlib") else cfg.data.source
    split = not cfg.data.val_source if split is None else split
    # Enough tokens that both splits (or the one corpus) hold at least one window.
    min_tokens = int((cfg.model.seq_len + 2) / min(cfg.data.val_fraction, 1 - cfg.data.val_fraction)) + 1 \
        if split else cfg.model.seq_len + 2
    dtype = bin_dtype(cfg) if source_kind(cfg) == "bin" else None
    if cfg.data.max_bytes:
        tokens = load_tokens(source, max_bytes=cfg.data.max_bytes, token_dtype=dtype, min_tokens=0)
    else:
        tokens = load_tokens(source, token_dtype=dtype, min_tokens=0)
    if len(tokens) < min_tokens:  # named in the fields that set both numbers, not in load_tokens' terms
        capped = f" (read up to data.max_bytes = {cfg.data.max_bytes:,})" if 0 < cfg.data.max_bytes <= tokens.nbytes else ""
        where = (f"in both the training and the validation split (data.val_fraction = {cfg.data.val_fraction})"
                 if split else "")
        raise ValueError(f"{field} = {cfg.data.source!r} holds {len(tokens):,} tokens{capped}, fewer than the "
                         f"{min_tokens:,} needed for a window of model.seq_len = {cfg.model.seq_len} tokens and its "
                         f"targets {where}: use more data or a shorter model.seq_len".replace(" :", ":"))
    return tokens
