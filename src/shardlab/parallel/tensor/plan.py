"""apply_tensor_parallel: a plain model, a group and a visible plan in; the tensor-parallel model out.

    from shardlab.parallel.tensor import GPT_PLAN, apply_tensor_parallel
    model = apply_tensor_parallel(GPT(cfg), tp_group)                    # GPT_PLAN by default
    model = apply_tensor_parallel(DeepMLP(cfg), mesh, LECTURE_MLP_PLAN)   # the mesh's "tp" axis
    loss = model(x, targets); loss.backward()                             # gradients final here

A plan maps module-name patterns (fnmatch: `*` matches any run of characters, dots included;
`[02468]` one of those characters) to a style; the first pattern that matches a module gives its
style, and every pattern must match some module:

  column     nn.Linear, output features split          (layers.py)
  row        nn.Linear, input features split, output summed once, bias added after
  vocab      nn.Embedding or the output head, split by vocabulary; the head's loss is the
             vocabulary-parallel cross-entropy (vocab.py)
  heads      an attention module, split by heads (attention.py)
  lecture    nn.Linear, output features split and all-gathered after the layer (lecture_mlp.py)
  replicate  kept whole on every rank (norms, positions, small layers)

Every module that holds parameters must be covered, by its own entry or an ancestor's, so nothing
is replicated by omission. The model's form (gpt.py, lecture_mlp.py) then checks that the styles fit
together: whatever is sharded on one side of an activation must agree with the other side.

A plan that does not fit is refused before anything changes, with every problem named: the module,
its size and the degree. `check_plan` runs the same checks without a process group, so a launcher
can refuse a layout before starting any rank.

The conversion copies each rank's slices out of the plain model's weights, so a tensor-parallel
model built from the same seed as a plain one computes the same function (all ranks must build the
plain model identically, as train/task.py's prepare_model does). Parameter names are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from shardlab.comm.dispatch import Group
from shardlab.dist.mesh import DeviceMesh
from shardlab.models.gpt import GPT
from shardlab.models.mlp import DeepMLP
from shardlab.parallel.placement import Placement, tied_aliases
from shardlab.parallel.tensor.attention import head_problems
from shardlab.parallel.tensor.gpt import convert_gpt, gpt_plan, gpt_problems
from shardlab.parallel.tensor.lecture_mlp import LECTURE_MLP_PLAN, MEGATRON_MLP_PLAN, convert_mlp, mlp_problems
from shardlab.parallel.tensor.shards import tensor_placement

STYLES = ("column", "row", "vocab", "heads", "lecture", "replicate")
PLAN_NAMES = ("megatron", "lecture")
"""The plans a configuration names (layout.tp_plan): 'megatron', each model's default (GPT_PLAN;
MEGATRON_MLP_PLAN), and 'lecture', the deep MLP's lecture form (LECTURE_MLP_PLAN)."""


@dataclass(frozen=True)
class Form:
    """How one model class becomes tensor-parallel: its default plan, its rules, its conversion."""

    default_plan: Callable[[Any], Mapping[str, str]]
    problems: Callable[[Any, dict[str, str], int, bool], list[str]]
    convert: Callable[[Any, dict[str, str], Group, bool], nn.Module]


FORMS: dict[type, Form] = {
    GPT: Form(gpt_plan, gpt_problems, convert_gpt),
    DeepMLP: Form(lambda model: MEGATRON_MLP_PLAN, mlp_problems, convert_mlp),
}


def _form(model: nn.Module) -> Form:
    for cls, form in FORMS.items():
        if isinstance(model, cls):
            return form
    raise TypeError(f"no tensor-parallel form for {type(model).__name__}; known: {[c.__name__ for c in FORMS]}")


def named_plan(model: nn.Module, name: str) -> Mapping[str, str]:
    """The plan `name` (one of PLAN_NAMES) for `model`."""
    if name == "megatron":
        return _form(model).default_plan(model)
    if name == "lecture" and isinstance(model, DeepMLP):
        return LECTURE_MLP_PLAN
    raise ValueError(f"no tensor-parallel plan {name!r} for {type(model).__name__}: 'megatron' fits every model, "
                     f"'lecture' the DeepMLP only")


def resolve_plan(model: nn.Module, plan: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """{module name: style} for the modules the plan names, and the problems found on the way."""
    names = [name for name, _ in model.named_modules() if name]
    styles: dict[str, str] = {}
    problems: list[str] = []
    for pattern, style in plan.items():
        if style not in STYLES:
            problems.append(f"plan entry {pattern!r}: unknown style {style!r}; the styles are {', '.join(STYLES)}")
            continue
        matched = [n for n in names if fnmatchcase(n, pattern)]
        if not matched:
            problems.append(f"plan entry {pattern!r} matches no module of {type(model).__name__} "
                            f"(its modules include {', '.join(names[:8])}{', ...' if len(names) > 8 else ''})")
        for n in matched:
            styles.setdefault(n, style)
    for name in styles:
        outer = _styled_ancestor(styles, name)
        if outer is not None:
            problems.append(f"{name}: styled {styles[name]} inside {outer} (styled {styles[outer]}); "
                            f"style one or the other")
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)) and name not in styles \
                and _styled_ancestor(styles, name) is None:
            problems.append(f"{name or type(model).__name__}: holds parameters, but no plan entry covers it "
                            f"(say 'replicate' to keep it whole)")
    return styles, problems


def _styled_ancestor(styles: dict[str, str], name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in styles:
            return ".".join(parts[:i])
    return None


def _style_problems(name: str, module: nn.Module, style: str, n: int) -> list[str]:
    """Whether one module can take its style at degree n: its type, and its sizes divide."""
    linear, emb = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
    kind = type(module).__name__
    if style in ("column", "lecture", "row") and not linear:
        return [f"{name}: {style} needs an nn.Linear, got {kind}"]
    if style == "column" or style == "lecture":
        if module.out_features % n:
            return [f"{name}: {style} splits its {module.out_features} output features over tp {n}, "
                    f"which does not divide them"]
    if style == "row" and module.in_features % n:
        return [f"{name}: row splits its {module.in_features} input features over tp {n}, which does not divide them"]
    if style == "vocab":
        if not (linear or emb):
            return [f"{name}: vocab needs an nn.Embedding or nn.Linear head, got {kind}"]
        rows = module.num_embeddings if emb else module.out_features
        if rows % n:
            return [f"{name}: vocab splits its {rows} vocabulary rows over tp {n}, which does not divide them"]
    if style == "heads":
        if not all(hasattr(module, a) for a in ("q", "kv", "proj", "n_head", "n_kv_head", "head_dim")):
            return [f"{name}: heads needs an attention module (q, kv, proj, n_head, n_kv_head), got {kind}"]
        return head_problems(name, module.n_head, module.n_kv_head, n)
    return []


def check_plan(model: nn.Module, plan: Mapping[str, str] | None = None, tp: int = 1,
               sequence_parallel: bool = False) -> list[str]:
    """Every reason `plan` (default: the model's) cannot be applied to `model` at degree `tp`; [] if
    it can. Needs no process group."""
    if tp < 1:
        return [f"tp must be positive, got {tp}"]
    form = _form(model)
    styles, problems = resolve_plan(model, form.default_plan(model) if plan is None else plan)
    modules = dict(model.named_modules())
    for name, style in styles.items():
        problems += _style_problems(name, modules[name], style, tp)
    return problems + form.problems(model, styles, tp, sequence_parallel)


def apply_tensor_parallel(model: nn.Module, group_or_mesh: Group | DeviceMesh = None,
                          plan: Mapping[str, str] | None = None, sequence_parallel: bool = False,
                          base: Placement | None = None) -> nn.Module:
    """Convert `model` (GPT or DeepMLP) in place to its tensor-parallel form over the group (or the
    "tp" axis of a DeviceMesh; None: the default group) and return it, its placement record
    (`model.placement`: `base`, default the plain model's, with the "tp" axis added) written.

    Raises ValueError, on every rank alike and before changing anything, when the plan does not fit.
    The result keeps the plain model's forward signature and parameter names; it has
    `full_parameters()`, `full_gradients()` and `clip_grad_norm_(max_norm)` for whole-model views.
    """
    if hasattr(model, "tp_group"):
        raise ValueError(f"{type(model).__name__} is already tensor-parallel")
    group = group_or_mesh.group("tp") if isinstance(group_or_mesh, DeviceMesh) else group_or_mesh
    n = dist.get_world_size(group)
    form = _form(model)
    problems = check_plan(model, plan, n, sequence_parallel)
    if problems:
        raise ValueError(f"the tensor-parallel plan does not fit {type(model).__name__} at tp {n}:\n  "
                         + "\n  ".join(problems))
    styles, _ = resolve_plan(model, form.default_plan(model) if plan is None else plan)
    # The whole shapes and tied names are the plain model's: read before the conversion cuts them.
    base = Placement.whole(model.named_parameters(), tied_aliases(model)) if base is None else base
    model = form.convert(model, styles, group, sequence_parallel)
    model.placement = tensor_placement(model, group, base)
    return model
