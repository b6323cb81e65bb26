"""Rank functions for tests/test_sharding.py (the pool's ranks import them by module name)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from shardlab.comm.autograd import count_comm
from shardlab.models.gpt import GPT, GPTConfig
from shardlab.models.mlp import DeepMLP, MLPConfig
from shardlab.parallel.sharding import Rules, compile_plan, derive
from shardlab.parallel.tensor import apply_tensor_parallel


def _model(kind: str, **kw) -> torch.nn.Module:  # noqa: ANN003
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(**{**dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, bias=False), **kw}))
    return DeepMLP(MLPConfig(d_model=16, n_layer=4))


def _batch(kind: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "gpt":
        ids = torch.randint(0, 64, (rows, 17), generator=g)
        return ids[:, :-1], ids[:, 1:]
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 16, generator=g)


def _counts(model: torch.nn.Module, kind: str, rows: int) -> list[list]:
    """Every collective of one forward and backward as [operation, bytes], in issue order."""
    x, y = _batch(kind, rows)
    log: list[list] = []
    with count_comm() as c:
        add = c.add
        c.add = lambda op, nbytes, n: (log.append([op, int(nbytes)]), add(op, nbytes, n))  # type: ignore[method-assign]
        model(x, y).backward()
    return log


def traces(kind: str, plan: dict | None, sp: bool, compute: str, rows: int = 2) -> dict:
    """One forward and backward's tensor-parallel collectives: the hand-written layout (`plan`, `sp`),
    the derived one (`compute` rules) as measured, and as the derived plan predicts them."""
    hand = apply_tensor_parallel(_model(kind), None, plan, sequence_parallel=sp)
    plain = _model(kind)
    derived_plan = derive(plain, Rules.parse(compute), {"tp": dist.get_world_size()}, rows=rows)
    derived = compile_plan(plain, derived_plan, None)
    return {"hand": _counts(hand, kind, rows), "derived": _counts(derived, kind, rows),
            "predicted": derived_plan.counts(),
            # The placement record written from the plan is the hand-written layout's, entry for entry.
            "same_record": dict(hand.placement.params) == dict(derived.placement.params)
            and dict(hand.placement.tied) == dict(derived.placement.tied)}


def checkpoint_across(root: str) -> dict:
    """Train the derived Megatron layout 2 steps and save; load that into the hand-written tp layout and
    into a fresh derived one: whether every parameter (gathered whole by the placement record) is exact."""
    from shardlab.checkpoint import Checkpointer, load_checkpoint
    from shardlab.parallel.layout import build_mesh, full_parameters
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import load_config
    from shardlab.train.step import StepSetup, lr_at, make_optimizer, train_step
    from shardlab.train.resolve import resolve_run
    from shardlab.train.verify import VERIFY_BASE

    def setup(rules: str):  # noqa: ANN202
        cfg = load_config(None, ["layout.tp=2", f"sharding.compute={rules}"], base=VERIFY_BASE)
        plain = resolve_run(cfg).build_model()
        task = resolve_run(cfg).build_task(plain)
        model = parallelize(plain, cfg.layout, build_mesh(cfg.layout), cfg.sharding)
        return cfg, model, make_optimizer(model, cfg.optim, cfg.layout.precision), task

    cfg, model, opt, task = setup("heads=tp, mlp=tp, vocab=tp, seq=tp")
    for s in range(2):
        train_step(model, opt, task, s, lr_at(s, cfg.optim, cfg.train), StepSetup(grad_clip=cfg.optim.grad_clip))
    Checkpointer(root).save(2, model, opt, config=cfg.to_dict())
    saved = full_parameters(model)
    out = {}
    for name, rules in (("hand-written", ""), ("derived", "heads=tp, mlp=tp, vocab=tp")):
        _, other, other_opt, _ = setup(rules)
        load_checkpoint(root, other, other_opt)
        got = full_parameters(other)
        out[name] = sorted(n for n in saved if not torch.equal(saved[n], got[n]))
        out[name + " trained"] = any(not torch.equal(saved[n], v) for n, v in full_parameters(setup(rules)[1]).items())
    return out


def _flight_trace(run) -> list[list]:  # noqa: ANN001
    """Every shardlab.comm operation `run()` starts on this rank, in issue order, as [operation, the
    group's global ranks, bytes] (point-to-point: "send"/"recv" with the peer's rank), from the flight
    recorder (dist/flight.py)."""
    import math

    from shardlab.dist import flight

    before = max((e["id"] for e in flight.snapshot("mark")["entries"]), default=-1)
    run()
    snap = flight.snapshot("trace")
    ranks = {g["key"]: g["ranks"] for g in snap["groups"]}
    entries = [e for e in snap["entries"] if e["id"] > before]
    assert [e["id"] for e in entries] == list(range(before + 1, before + 1 + len(entries))), "flight ring overflowed"
    out = []
    for e in entries:
        shape = e["shape"] or []
        numel = sum(math.prod(s) for s in shape) if shape and isinstance(shape[0], list) else math.prod(shape)
        item = torch.empty(0, dtype=getattr(torch, e["dtype"])).element_size() if e["dtype"] else 0
        out.append([e["op"], ranks.get(e["group"], []), numel * item] + ([e["peer"]] if "peer" in e else []))
    return out


def cp_traces(sets: list[str]) -> dict:
    """One training step (forward, backward, gradient sync, clipping, AdamW) of verify's GPT laid out
    by the hand-written flags `sets` (e.g. layout.cp=2) and again with the rules `sharding.compute=...`
    that describe it: every operation of each, and what the derived plan predicts for the cp axis."""
    from shardlab.parallel.layout import build_mesh
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import load_config
    from shardlab.train.resolve import resolve_run
    from shardlab.train.step import StepSetup, lr_at, make_optimizer, train_step
    from shardlab.train.verify import VERIFY_BASE

    out: dict = {}
    for name, extra in (("hand", [s for s in sets if not s.startswith("sharding.")]), ("derived", sets)):
        cfg = load_config(None, extra, base=VERIFY_BASE)
        cfg.validate(dist.get_world_size())
        plain = resolve_run(cfg).build_model()
        task = resolve_run(cfg).build_task(plain)
        model = parallelize(plain, cfg.layout, build_mesh(cfg.layout), cfg.sharding)
        opt = make_optimizer(model, cfg.optim, cfg.layout.precision)
        setup = StepSetup(grad_clip=cfg.optim.grad_clip)
        out[name] = _flight_trace(lambda: train_step(model, opt, task, 0, lr_at(0, cfg.optim, cfg.train), setup))
        inner = getattr(model, "module", model)
        out[name + " swapped"] = [type(inner.tokens).__name__, type(inner.blocks[0].attn.attend).__name__]
        if name == "derived":
            plan = inner.derived_plan
            rows = cfg.train.global_batch // (cfg.layout.dp * cfg.train.micro_batches)
            from shardlab.parallel.sharding import Rules, derive
            from shardlab.parallel.sharding.apply import mesh_sizes

            sized = derive(resolve_run(cfg).build_model(), Rules.parse(cfg.sharding.compute, cfg.sharding.params),
                           mesh_sizes(cfg.layout), rows=rows)
            out["predicted_cp"] = sized.counts(axis="cp")
            out["cp_ranks"] = build_mesh(cfg.layout, create_groups=False).ranks_along("cp")
            out["plan_has_context"] = plan.context_axis == "cp"
    return out


def engine_under_rules(sets: list[str]) -> dict:
    """What parallelize builds for verify's GPT under `sets` ([sharding] rules with seq over cp and a
    ZeRO stage): the data-parallel engine, its stage and replica group, and the context swaps, so a
    verify that passes is known to have run ZeRO under the derived ring (not plain data parallelism)."""
    from shardlab.parallel.layout import build_mesh
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import load_config
    from shardlab.train.resolve import resolve_run
    from shardlab.train.verify import VERIFY_BASE

    cfg = load_config(None, sets, base=VERIFY_BASE)
    cfg.validate(dist.get_world_size())
    model = parallelize(resolve_run(cfg).build_model(), cfg.layout, build_mesh(cfg.layout), cfg.sharding)
    inner = model.module
    return {"engine": type(model).__name__, "stage": getattr(model, "stage", None),
            "replicas": dist.get_world_size(model.group), "context": inner.derived_plan.context_axis,
            "swapped": [type(inner.tokens).__name__, type(inner.blocks[0].attn.attend).__name__]}


def layout_traces(sets: list[str]) -> dict:
    """One training step of verify's GPT laid out by the hand-written flags `sets` and again with the
    [sharding] rules among them (layers over pp, experts over ep, ...): every shardlab.comm operation
    of each in issue order, what parallelize built, and the derived plan's axes."""
    from shardlab.parallel.layout import build_mesh
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import load_config
    from shardlab.train.resolve import resolve_run
    from shardlab.train.step import StepSetup, lr_at, make_optimizer, train_step
    from shardlab.train.verify import VERIFY_BASE

    out: dict = {}
    for name, extra in (("hand", [s for s in sets if not s.startswith("sharding.")]), ("derived", sets)):
        cfg = load_config(None, extra, base=VERIFY_BASE)
        cfg.validate(dist.get_world_size())
        run = resolve_run(cfg)
        plain = run.build_model()
        task = run.build_task(plain)
        model = parallelize(plain, cfg.layout, build_mesh(cfg.layout), cfg.sharding)
        opt = make_optimizer(model, cfg.optim, cfg.layout.precision)
        setup = StepSetup(grad_clip=cfg.optim.grad_clip)
        out[name] = _flight_trace(lambda: train_step(model, opt, task, 0, lr_at(0, cfg.optim, cfg.train), setup))
        out[name + " built"] = sorted({type(m).__name__ for m in model.modules()
                                       if type(m).__name__ in ("PipelineParallel", "ExpertParallelMoE",
                                                               "ExpertDataParallel", "RingAttend")})
        plan = getattr(model, "derived_plan", None) or getattr(getattr(model, "module", None), "derived_plan", None)
        if name == "derived":
            out["plan_axes"] = [plan.pipeline_axis, plan.expert_axis, plan.context_axis] if plan else None
    return out


def built(sets: list[str]) -> list[str]:
    """The classes parallelize builds for verify's model under `sets` (with [sharding] rules: the
    derived leaves, DerivedLinear and the like, where the rules cut tensors)."""
    from shardlab.parallel.layout import build_mesh
    from shardlab.parallel.parallelize import parallelize
    from shardlab.train.config import load_config
    from shardlab.train.resolve import resolve_run
    from shardlab.train.verify import VERIFY_BASE

    cfg = load_config(None, sets, base=VERIFY_BASE)
    cfg.validate(dist.get_world_size())
    model = parallelize(resolve_run(cfg).build_model(), cfg.layout, build_mesh(cfg.layout), cfg.sharding)
    return sorted({type(m).__name__ for m in model.modules()})
