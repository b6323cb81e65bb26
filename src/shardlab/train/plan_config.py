"""The planner's layout as a run configuration, and the trainer's rules as the planner's filter.

    cfg = config_from_plan(spec, layout, global_batch)     # a Config `shardlab train --config` runs
    Path("plan.toml").write_text(cfg.to_toml())
    admit = trainer_rules(spec, global_batch)              # layout -> the trainer's reasons (empty: runs)
    result = search(spec, hw, gpus, global_batch, admit=admit)

The planner's layout is the trainer's own `[layout]` section (plan/execution.py's Execution is a
LayoutSection), so the configuration carries it field for field; the model and the batch are the
planner's: the GPT of the spec, `train.global_batch` and `train.micro_batches` (the global batch over
dp x ep batch ranks of `micro_batch` rows each). This module sits in train/, above plan/: the planner
asks the trainer's rules (train/config_check.py) through the `admit` function it is handed, never by
importing them, and keeps no list of its own of what the trainer supports.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import fields

from shardlab.parallel.layout_section import LayoutSection
from shardlab.plan.execution import Execution
from shardlab.plan.models import ModelSpec
from shardlab.train.config import Config

def model_fields(spec: ModelSpec) -> dict[str, object]:
    """`model.*` of shardlab's GPT with the spec's shape (spec_from_config's inverse): the spec is a
    GPTConfig, in the section's words but for `experts` (GPTConfig's n_experts)."""
    return {
        "name": "gpt", "n_layer": spec.n_layer, "d_model": spec.d_model, "n_head": spec.n_head,
        # 0: the section's "same as n_head" and "4 x d_model", as the spec's defaults are written
        "n_kv_head": 0 if spec.n_kv_head == spec.n_head else spec.n_kv_head,
        "d_ff": 0 if spec.d_ff == 4 * spec.d_model else spec.d_ff,
        "vocab_size": spec.vocab_size, "seq_len": spec.seq_len,
        "bias": spec.bias, "mlp": spec.mlp, "norm": spec.norm,
        "tie_embeddings": spec.tie_embeddings, "rotary": spec.rotary, "dropout": spec.dropout,
        "experts": spec.n_experts, "top_k": spec.top_k if spec.moe else 2,
    }


def config_from_plan(spec: ModelSpec, lay: Execution, global_batch: int, base: Config | None = None) -> Config:
    """A run configuration for `lay`: `base` (default: the defaults) with the spec's model, the
    layout's [layout] fields and the batch split the planner assumed. A `base` that came from a
    configuration file keeps its model (the spec was read from it) and its other sections."""
    cfg = copy.deepcopy(base) if base is not None else Config()
    if base is None:
        for key, value in model_fields(spec).items():
            setattr(cfg.model, key, value)
    for f in fields(LayoutSection):
        setattr(cfg.layout, f.name, getattr(lay, f.name))
    cfg.train.global_batch = global_batch
    cfg.train.micro_batches = max(1, lay.micro_batches(global_batch))
    return cfg


BYTE_IDS = 256
"""The default data's vocabulary (the stdlib's sources as bytes)."""


def write_config(spec: ModelSpec, lay: Execution, global_batch: int, path: str, base: Config | None = None,
                 devices_per_node: int = 0) -> list[str]:
    """Write `lay`'s configuration to `path` (TOML, headed by the layout's name and how to launch it);
    return the trainer's reasons to refuse it (empty: `shardlab train --config path` runs it).

    devices_per_node: the plan's machines; the ranks fill whole nodes of that many (layout.nodes), as
    the planner placed its groups. Without a `base`, a model of more ids than bytes gets a data.source
    placeholder naming what to make (the defaults' bytes would leave most of its vocabulary unused):
    `shardlab train --dry-run` refuses it, as a source that does not exist, until it is replaced."""
    cfg = config_from_plan(spec, lay, global_batch, base)
    world = cfg.world_size
    if devices_per_node and world > devices_per_node and world % devices_per_node == 0:
        cfg.layout.nodes = world // devices_per_node
    per_node = world // cfg.layout.nodes
    head = [f"# shardlab plan: {lay.name()}, global batch {global_batch}, {world} ranks: {cfg.layout.nodes} node(s) "
            f"x {per_node} rank(s) per node",
            f"#   torchrun --nnodes {cfg.layout.nodes} --nproc-per-node {per_node} ... -m shardlab train --config {path}"]
    if base is None and spec.vocab_size > BYTE_IDS:
        cfg.data.source = f"REPLACE-ME-with-a-token-file-of-{spec.vocab_size}-ids.tok"
        head += [f"# data.source is a placeholder: the model has {spec.vocab_size:,} ids, the default data (bytes) "
                 f"{BYTE_IDS}. Make a token file",
                 f"# with your tokenizer (shardlab data prepare CORPUS --tokenizer TOKENIZER.json --out FILE.tok) "
                 f"and name it there;",
                 "# `shardlab train --dry-run` refuses this file until then."]
    with open(path, "w") as f:
        f.write("\n".join(head) + "\n")
        f.write(cfg.to_toml())
    return cfg.problems()


def trainer_rules(spec: ModelSpec, global_batch: int, base: Config | None = None) -> Callable[[Execution], list[str]]:
    """`admit` for plan/search.py: the trainer's reasons (Config.validate's problems) for the
    configuration of a layout, remembered per configuration (a search asks about many)."""
    seen: dict[str, list[str]] = {}

    def admit(lay: Execution) -> list[str]:
        cfg = config_from_plan(spec, lay, global_batch, base)
        key = repr(cfg)
        if key not in seen:
            seen[key] = cfg.problems()
        return seen[key]

    return admit
