"""What a strategy step is: a name, when it applies, and what it does to the model being built.

    STEP = Step("cp", lambda s: s.layout.cp > 1, apply_cp)   # in the strategy's own folder
    STEPS = (..., STEP, ...)                                  # parallel/layout.py: the one order

parallel/layout.py's `apply_layout` runs the layout's steps, in the order of its `STEPS`, over one
`Applying`: the model as the steps so far left it, its placement record, and what every step reads
(the layout, the mesh, the [sharding] section). A step converts the model in place or replaces it,
and writes what it did to the parameters into the record. Which steps apply is decided once, on
the plain model, before the first one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from shardlab.comm.dispatch import Group
from shardlab.dist.mesh import DeviceMesh
from shardlab.parallel.placement import Placement

if TYPE_CHECKING:
    from shardlab.parallel.layout_section import LayoutSection
    from shardlab.parallel.sharding.section import ShardingSection


@dataclass
class Applying:
    """A layout being applied to one rank's model."""

    model: nn.Module
    """The model as the steps so far left it (the plain one before the first)."""
    record: Placement
    """What every mesh axis does to every parameter, by plain name (parallel/placement.py): each
    step adds its axis; apply_layout sets the last one on the returned module as `placement`."""
    layout: "LayoutSection"
    """The [layout] section; a step may hand the later ones a changed copy ([sharding] rules that
    store weights over dp set zero = 3)."""
    mesh: DeviceMesh | None
    """None: data parallelism alone over every rank (a step that needs groups refuses to run)."""
    sharding: "ShardingSection | None" = None
    tp_group: Group | None = None
    """The tensor-parallel group, once a step has made the model tensor-parallel (a pipeline's stages
    run their tp inside, over it)."""
    plans: dict[str, Any] = field(default_factory=dict)
    """What a step planned on the plain model (Step.prepare), by step name."""
    around: list[Callable[["Applying"], None]] = field(default_factory=list)
    """Wrappers a step leaves to close around what the later steps made (the pipeline's schedule
    around its stage and the stage's data-parallel engine), run after the last step, last first."""

    @property
    def rules(self) -> "ShardingSection | None":
        """The [sharding] section when it has rules (tp and seq over cp derived from them), else None."""
        return self.sharding if self.sharding is not None and self.sharding.active() else None

    def group(self, axes: str | tuple[str, ...]) -> Group:
        """The mesh's group over `axes` (a step that calls it has `needs_mesh`)."""
        assert self.mesh is not None, "apply_layout refuses a step that needs a mesh without one"
        return self.mesh.group(axes)


@dataclass(frozen=True)
class Step:
    """One strategy's place in the order: `applies` reads the plain state (the layout, the
    [sharding] section), `apply` converts `state.model` and writes `state.record`."""

    name: str
    """The layout field or word that names the strategy ("tp", "cp", "pp", "recompute", "dp", ...)."""
    applies: Callable[[Applying], bool]
    apply: Callable[[Applying], None]
    prepare: Callable[[Applying], None] | None = None
    """Run on the plain model before any step applies (the pipeline plans its split there)."""
    needs_mesh: bool = True
    """Whether the step needs the mesh's groups (only data parallelism runs without: every rank)."""
