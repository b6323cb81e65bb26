"""A run resolved once: the configuration turned into a description of what will run.

    resolve_data(cfg)     # before launch, once: text encoded for its tokenizer (cached), model.vocab_size set
    run = resolve_run(cfg)  # in every process, before anything is built
    run.data.kind, run.data.header, run.data.tokenizer, run.vocab, run.strategies, run.mesh_shape
    model = run.build_model(); task = run.build_task(model)

`Config` (train/config.py) is what the user wrote: TOML and flags, checked field by field. `Run` is what
the trainer will do with it: the data source and its kind decided (a token file's header read once), the
model's vocabulary, the mesh and the strategies in the order they are applied, the precision. Everything
below the entry points (train/loop.py's train_rank, verify, the CLI) takes the narrow values it needs from
here (a DataSource, a section, a StepSetup), never the whole configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.nn as nn

from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.layout import mesh_order
from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.parallelize import parallelize, strategies
from shardlab.parallel.sharding.section import ShardingSection
from shardlab.train.config import Config
from shardlab.train.corpus import DataSource, adopt_hf_tokenizer, encode_text, model_vocab
from shardlab.train.corpus_checks import check_hf_vocabulary
from shardlab.train.sections import CheckpointSection, LogSection, ModelSection, OptimSection, TrainSection
from shardlab.train.task import Batches, Task, build_task, prepare_model


def resolve_data(cfg: Config, progress: bool = True) -> None:
    """Before launch, in one process: a text source with a tokenizer other than bytes is encoded into
    a token file (once; later runs find it under data.cache_dir) and becomes data.source; then
    model.vocab_size is set from the data when 0. The ranks then all read the same file."""
    adopt_hf_tokenizer(cfg.data, cfg.model.init_from_hf)
    if DataSource(cfg.data).needs_preparing:
        encode_text(cfg.data, progress)
    src = DataSource(cfg.data)  # the prepared source, if it changed
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = model_vocab(0, src, cfg.layout.tp)
    check_hf_vocabulary(src, cfg.model)


def describe_strategies(lay: LayoutSection, sharding: ShardingSection) -> tuple[str, ...]:
    """The strategies the layout applies, in the one order parallelize applies them
    (parallel/parallelize.py's `strategies`), each with its degree and options."""
    said = {"sharding": "sharding rules", "tp": f"tp {lay.tp}{' + sp' if lay.sp else ''} ({lay.tp_plan})",
            "ep": f"ep {lay.ep}", "cp": f"cp {lay.cp}", "pp": f"pp {lay.pp} ({lay.schedule})",
            "recompute": f"recompute ({lay.recompute})",
            "dp": f"dp {lay.dp} ({'ZeRO-' + str(lay.zero) if lay.zero else lay.dp_mode})"}
    return tuple(said[name] for name in strategies(lay, sharding))


@dataclass(frozen=True)
class Run:
    """What a configuration will run, decided once (`resolve_run`)."""

    model: ModelSection
    """The model's shape and options (model.*)."""
    vocab: int
    """The GPT's vocabulary: model.vocab_size, or the data's padded for layout.tp; 0 for the MLP."""
    data: DataSource | None
    """The training ids (kind, file, header, tokenizer, bytes per token; `data.val()` the validation
    file's); None for the MLP, which trains on a synthetic regression."""
    layout: LayoutSection
    sharding: ShardingSection
    train: TrainSection
    optim: OptimSection
    log: LogSection
    checkpoint: CheckpointSection
    mesh_shape: tuple[tuple[str, int], ...]
    """The mesh's axes and degrees, outermost first (layout.mesh_order)."""
    strategies: tuple[str, ...]
    """The strategies applied, in order (`describe_strategies`)."""

    @property
    def precision(self) -> str:
        return self.layout.precision

    @property
    def world_size(self) -> int:
        return int(np.prod([size for _, size in self.mesh_shape]))

    @property
    def batches(self) -> Batches:
        return Batches(self.train.global_batch, self.train.seed, self.model.seq_len)

    def build_model(self) -> nn.Module:
        """The plain model, seeded, frozen and cast as configured (train/task.py's prepare_model)."""
        return prepare_model(self.model, self.vocab, self.train.seed, self.precision)

    def build_task(self, model: nn.Module, tokens: np.ndarray | None = None) -> Task:
        """The samplers over the resolved data for the plain `model` (train/task.py's build_task)."""
        return build_task(model, self.data, self.batches, tokens)

    def apply(self, plain: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """The strategies applied to the plain model on this rank's `mesh` (parallel/parallelize.py): the
        trainer's and generate's call into the apply path, so a change of its signature is made here
        (and in verify.py, whose call tests replace with a faulty layout)."""
        return parallelize(plain, self.layout, mesh, self.sharding)


def resolve_run(cfg: Config) -> Run:
    """The run `cfg` describes. Reads only headers and tokenizer files (never the ids); a source that
    cannot say its vocabulary raises the ValueError that names it."""
    gpt = cfg.model.name == "gpt"
    data = DataSource(cfg.data) if gpt else None
    lay = cfg.layout
    return Run(
        model=cfg.model, vocab=model_vocab(cfg.model.vocab_size, data, lay.tp) if data is not None else 0,
        data=data, layout=lay, sharding=cfg.sharding, train=cfg.train, optim=cfg.optim, log=cfg.log,
        checkpoint=cfg.checkpoint, mesh_shape=tuple((axis, getattr(lay, axis)) for axis in mesh_order(lay)),
        strategies=describe_strategies(lay, cfg.sharding),
    )
