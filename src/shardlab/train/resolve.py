"""A run resolved once: the configuration turned into a frozen description of what will run.

    run = resolve_run(cfg)                  # the launcher, once, before any rank starts; cfg is never written
    run = run.prepared()                    # before launch: text encoded for its tokenizer (cached)
    launch(train_rank, run.world_size, run) # the ranks receive it (pickled as its resolved configuration)
    run.data.kind, run.data.header, run.data.tokenizer, run.vocab, run.strategies, run.mesh_shape
    model = run.build_model(); task = run.build_task(model)

`Config` (train/config.py) is what the user wrote: TOML and flags, checked field by field, and it stays
so. `Run` is what the trainer will do with it: the data source and its kind decided (a token file's
header read once), the model's vocabulary, the mesh and the strategies in the order they are applied,
the precision; `run.config` is the configuration as resolved (a copy: model.vocab_size from the data, a
prepared data.source), which the run records (config.toml, metrics, checkpoints). Everything below
the entry points (train/loop.py's train_rank, verify, the CLI) takes the narrow values it needs from
here (a DataSource, a section, a StepSetup), never the whole configuration.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

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


def describe_strategies(lay: LayoutSection, sharding: ShardingSection) -> tuple[str, ...]:
    """The strategies the layout applies, in the one order parallelize applies them
    (parallel/parallelize.py's `strategies`), each with its degree and options (LayoutSection.strategy_text)."""
    return tuple(lay.strategy_text(name) for name in strategies(lay, sharding))


@dataclass(frozen=True)
class Run:
    """What a configuration will run, decided once (`resolve_run`). Picklable: it travels to the ranks
    as its resolved configuration, from which each rank describes it again (`described`: headers read,
    nothing prepared or decided anew)."""

    config: Config
    """The configuration as resolved: the user's, copied, with what the data decided (model.vocab_size,
    a prepared data.source and its tokenizer). The sections below are its own; what the run records."""
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

    def prepared(self, progress: bool = True) -> "Run":
        """This run with its data made readable by every rank, before launch, in one process: a Hugging
        Face checkpoint's tokenizer adopted (model.init_from_hf), text for a tokenizer other than bytes
        encoded into a token file (once; later runs find it under data.cache_dir), the vocabulary
        checked against the checkpoint's. A new Run; this one and the user's configuration unchanged."""
        if self.data is None:
            return self
        d = adopt_hf_tokenizer(self.config.data, self.model.init_from_hf)
        if DataSource(d).needs_preparing:
            d = encode_text(d, progress)
        run = described(replace(self.config, data=d))
        check_hf_vocabulary(run.data, run.model)
        return run

    def __reduce__(self):
        # Sent to the ranks as the resolved configuration: sections, not cached headers or tokenizers.
        return (run_from_dict, (self.config.to_dict(),))

    def apply(self, plain: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """The strategies applied to the plain model on this rank's `mesh` (parallel/parallelize.py): the
        trainer's and generate's call into the apply path, so a change of its signature is made here
        (and in verify.py, whose call tests replace with a faulty layout)."""
        return parallelize(plain, self.layout, mesh, self.sharding)


def resolve_run(cfg: Config) -> Run:
    """The run `cfg` describes, resolved once (the launcher's call): `cfg` is read, never written, and what
    the data decides is the Run's (`run.config`). Reads only headers and tokenizer files (never the ids);
    a source that cannot say its vocabulary raises the ValueError that names it."""
    resolved = copy.deepcopy(cfg)
    data = DataSource(resolved.data) if resolved.model.name == "gpt" else None
    if data is not None and not resolved.model.vocab_size:
        # The data's vocabulary, padded for tp: what every rank builds, and what the run records.
        resolved.model.vocab_size = model_vocab(0, data, resolved.layout.tp)
    return described(resolved, data)


def described(resolved: Config, data: DataSource | None = None) -> Run:
    """The Run of a configuration already resolved (`resolve_run`'s, or one a rank received): nothing is
    decided here, only read (a token file's header, when first asked). `data`: resolved.data's source,
    when already asked (its header read once)."""
    if data is None and resolved.model.name == "gpt":
        data = DataSource(resolved.data)
    lay = resolved.layout
    return Run(
        config=resolved, model=resolved.model,
        vocab=model_vocab(resolved.model.vocab_size, data, lay.tp) if data is not None else 0,
        data=data, layout=lay, sharding=resolved.sharding, train=resolved.train, optim=resolved.optim,
        log=resolved.log, checkpoint=resolved.checkpoint,
        mesh_shape=tuple((axis, getattr(lay, axis)) for axis in mesh_order(lay)),
        strategies=describe_strategies(lay, resolved.sharding),
    )


def run_from_dict(resolved: dict) -> Run:
    """A Run sent to a rank (`Run.__reduce__`): its resolved configuration's sections, described again."""
    return described(Config.from_dict(resolved))
