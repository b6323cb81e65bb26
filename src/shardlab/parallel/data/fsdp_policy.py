"""Which submodules are FSDP's units (fsdp.py) and which unit owns each parameter: the wrapping
policy (the children of every nn.ModuleList by default; module types; a size in elements; a
predicate), a pipeline stage's entry chunks, and the order units come in. Pure module-tree walks, no
tensors touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Union

import torch.nn as nn

Policy = Union[None, int, type, Iterable[type], Callable[[nn.Module], bool]]


def unit_modules(root: nn.Module, policy: Policy) -> list[nn.Module]:
    """The root, then the modules the policy makes units, in module order. Containers (ModuleList,
    ModuleDict) never are: they are not called, so their hooks would never gather them."""
    containers = (nn.ModuleList, nn.ModuleDict)
    if policy is None:
        # Not a list whose members a forward calls only sometimes (a mixture's experts, by where the
        # router sends tokens): ranks would gather different units. Those stay in their parent's unit.
        chosen = {id(c) for m in root.modules() if isinstance(m, nn.ModuleList) and not getattr(m, "conditional", False)
                  for c in m}
        pick: Callable[[nn.Module], bool] = lambda m: id(m) in chosen  # noqa: E731
    elif isinstance(policy, int):
        chosen = set()

        def rest(m: nn.Module) -> int:  # elements under m not yet in a unit
            n = sum(p.numel() for p in m._parameters.values() if p is not None) + sum(map(rest, m.children()))
            if m is not root and n >= policy and not isinstance(m, containers):
                chosen.add(id(m))
                return 0
            return n

        rest(root)
        pick = lambda m: id(m) in chosen  # noqa: E731
    elif callable(policy) and not isinstance(policy, type):
        pick = policy
    else:
        types = (policy,) if isinstance(policy, type) else tuple(policy)
        pick = lambda m: isinstance(m, types)  # noqa: E731
    return [root, *(m for m in root.modules() if m is not root and not isinstance(m, containers) and pick(m))]


def entry_policy(entries: list[nn.Module]) -> Callable[[nn.Module], bool]:
    """Units for a wrapper entered through `entries`: each of them, and every child of a ModuleList
    or ModuleDict under them (a chunk's blocks or layers, as the default policy picks the model's)."""
    chosen = {id(m) for m in entries}
    for e in entries:
        for m in e.modules():
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                chosen |= {id(c) for c in m.children()}
    return lambda m: id(m) in chosen


def owners(root: nn.Module, units: list[nn.Module]) -> list[tuple[nn.Parameter, int, list[tuple[nn.Module, str]]]]:
    """Each parameter once, with the unit that owns it (the innermost unit around every module that
    registers it, or the root when those differ: tied across units) and every (module, name) slot
    that registers it."""
    index = {id(m): i for i, m in enumerate(units)}
    where: dict[int, tuple[nn.Parameter, set[int], list[tuple[nn.Module, str]]]] = {}
    seen: set[int] = set()

    def walk(m: nn.Module, unit: int) -> None:
        unit = index.get(id(m), unit)
        first = id(m) not in seen  # a module registered twice holds its slots once
        seen.add(id(m))
        for name, p in m._parameters.items():
            if p is not None:
                entry = where.setdefault(id(p), (p, set(), []))
                entry[1].add(unit)
                if first:
                    entry[2].append((m, name))
        for child in m.children():
            walk(child, unit)

    walk(root, 0)
    return [(p, next(iter(us)) if len(us) == 1 else 0, slots) for p, us, slots in where.values()]


def successors(order: Iterable[int]) -> dict[int, int]:
    """{unit: the unit after its first appearance} for a sequence of units."""
    seen = list(dict.fromkeys(order))
    return dict(zip(seen, seen[1:]))
