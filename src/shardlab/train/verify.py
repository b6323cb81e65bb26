"""The equivalence harness: a parallel layout must compute the same training as one process.

    shardlab verify --model gpt --dp 2 --json v.json
    shardlab verify --model gpt --dp 2 --tp 2 --sp        # 4 ranks
    shardlab verify --model gpt --pp 2 --schedule 1f1b --microbatches 4
    shardlab verify --model gpt --cp 2                    # every sequence split over 2 ranks (ring attention)

Every rank builds the model from the run's seed and keeps an untouched copy as the single-process
reference. Then, for K steps, the layout trains on its ranks' shares of each global batch while the
reference trains on the whole global batch in one pass (no micro-batching, no communication), both
through train/step.py, the code the trainer runs. After each step every rank compares what it holds
with the reference: the loss, every gradient just before the optimizer uses it, and every parameter
after the update. The largest differences over all ranks are reported. Sharded layouts are compared
whole, by the plain model's parameter names: the data-parallel wrapper's views gathered over dp,
then tensor-parallel shards gathered over tp, or pipeline stages gathered over pp
(parallel/layout.py). The layout's loss is its dp ranks' mean; every rank of a tp group and every
stage of a pipeline holds it, and each rank's is compared.

Differences are relative to each tensor's scale (train/verify_compare.py). The reference runs on
every rank, so every replica is checked, not just rank 0's. The report as text: train/verify_report.py.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from shardlab.parallel.deterministic.mode import deterministic_mode
from shardlab.parallel.layout import batch_rank, build_mesh, full_gradients, full_parameters, replica_group
from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.parallelize import parallelize
from shardlab.parallel.pipeline.schedules import V_KINDS, chunks_per_rank
from shardlab.parallel.precision import get_precision
from shardlab.train.compile import compile_model, compile_stats, fresh_compile_state
from shardlab.train.config import Config
from shardlab.train.loop import rank_device
from shardlab.train.resolve import resolve_run
from shardlab.train.step import StepHooks, StepSetup, lr_at, make_optimizer, train_step
from shardlab.train.task import prepare_model
from shardlab.parallel.gradnorm import clip_coefficient
from shardlab.train.verify_compare import gradients_of, norm_diff, perturb, tensor_diff, unscaled, worst_pair
from shardlab.train.verify_noise import AdamBound, bound_report, compare, merge, table_worst
from shardlab.train.verify_report import family
from shardlab.train.verify_terms import TermMass, chain_length, mass_floors

# A command's own defaults: models small enough that 4 ranks on 2 cores verify in seconds, and a
# global batch of 12 that divides by 1, 2, 3 and 4 ranks.
#
# Adam's eps: Adam divides each gradient element by its own running magnitude, so an element whose
# gradient is close to zero (a rarely seen byte's embedding row, a bias whose gradient cancels over
# the batch) turns fp32 rounding noise into a step of up to lr. With eps = 1e-8 that moved the GPT's
# embedding 1.6e-5 relative from the reference after 5 steps at 3 ranks; eps bounds the gain at
# lr / eps, and 1e-4 keeps it under the 1e-6 tolerance while ordinary gradients (~1e-2) are still
# normalised as usual. A training run keeps the configuration's eps.
VERIFY_BASE = [
    "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=32", "optim.eps=1e-4",
    "train.global_batch=12", "train.steps=5", "train.warmup_steps=1", "data.max_bytes=2097152",
]
# Mixed precision, on top: eps 1e-3 for the same reason as above, as bf16 gradients carry ~1e-3
# relative rounding where fp32's carry ~1e-7 (at 1e-4 the first Adam step turned bf16 rounding of
# a norm's bias gradient into twice the precision's own error). fp16 starts its loss scale at 2^13:
# at torch's 2^16 this GPT's gradients sit at the top of fp16's range, where whether a step
# overflows depends on how the batch is split across ranks (each rank's partial gradient is
# larger than the whole batch's mean), so one run would skip a step the other takes.
MIXED_VERIFY_BASE = ["optim.eps=1e-3", "optim.loss_scale=8192"]


def verify_base(layout: LayoutSection, micro_batches: int, model: str) -> list[str]:
    """VERIFY_BASE and what `layout` (with train.micro_batches, of model.name `model`, as resolved on
    VERIFY_BASE) needs on top, as base entries that --set still overrides: MIXED_VERIFY_BASE under
    mixed precision; a global batch of 12 raised to the next multiple of layout.dp x layout.ep x
    micro_batches (16 for 8 microbatches); and for a pipeline enough layers that every chunk holds a
    piece (the GPT's pieces are its blocks plus the embedding and the head: 2 blocks fill 4 chunks;
    the MLP's are its layers)."""
    base = list(VERIFY_BASE)
    if layout.precision != "fp32":
        base += MIXED_VERIFY_BASE
    rows = layout.batch_ranks * micro_batches
    if rows > 0 and 12 % rows:
        base.append(f"train.global_batch={rows * math.ceil(12 / rows)}")
    chunks = layout.pp * chunks_per_rank(layout.schedule, layout.virtual_stages)
    # The V puts the embedding's and the head's chunks on rank 0: a block in each chunk keeps one there
    # too (recomputation refuses a stage without blocks, parallel/pipeline/checks.py).
    layers = chunks - 2 if model == "gpt" and layout.schedule not in V_KINDS else chunks
    if layout.pp > 1 and layers > 2:
        base.append(f"model.n_layer={layers}")
    return base


def mp_factor_for(layout: LayoutSection, micro_batches: int) -> float:
    """verify's mixed-precision allowance in units of G (the reference's distance from fp32).

    2 when the layout makes the reference's roundings: two runs each about G from the exact one. A
    16-bit gradient average over dp replicas makes more roundings of the same size
    (parallel/precision.py's averaging_op): each rank's partial sum over its rows, where the
    reference rounds the whole batch's once (over mb micro-batches: mb partials and mb - 1
    additions, 2 mb - 1), the division by dp unless dp is a power of two, and dp - 1 additions in
    16 bits. Each moves a gradient, and through AdamW a weight, by up to what the reference's one
    rounding does, so the layout is up to (1 + those roundings) x G from the reference. Measured
    2026-11-28: an fp16 MLP at dp 3 (5G now) used 0.99 of a flat 2G on an AMD EPYC, its weights two
    fp16 units apart where G was one (docs/reliability.md, "Portable numerics"). A layout bug still
    fails: a gradient summed instead of averaged is 100% off, G ~1e-3. bf16-autocast averages fp32
    gradients: 2."""
    dp = layout.dp
    if layout.precision not in ("fp16", "bf16") or dp == 1:
        return 2.0
    return 1.0 + (2 * micro_batches - 1) + (dp & (dp - 1) != 0) + (dp - 1)


def verify_rank(cfg_dict: dict[str, Any], tol: float, grad_tol: float, atol: float = 1e-7,
                mp_factor: float = 2.0, noise_floor: bool = False, ref_micro_batches: int = 1,
                ref_noise_ulps: float = 0.0) -> dict[str, Any] | None:
    """verify_layout under train.deterministic's mode when the configuration asks for it: then the
    reference runs the layout's dp x micro_batches micro-batches (its own ref_micro_batches is
    ignored) and the bar is 0, in the loss, every gradient, every parameter and the norm."""
    with deterministic_mode(bool(cfg_dict.get("train", {}).get("deterministic"))):
        return verify_layout(cfg_dict, tol, grad_tol, atol, mp_factor, noise_floor, ref_micro_batches, ref_noise_ulps)


def verify_layout(cfg_dict: dict[str, Any], tol: float, grad_tol: float, atol: float = 1e-7,
                  mp_factor: float = 2.0, noise_floor: bool = False, ref_micro_batches: int = 1,
                  ref_noise_ulps: float = 0.0) -> dict[str, Any] | None:
    """Run the layout and the reference side by side; rank 0 returns the report.

    Under mixed precision (layout.precision bf16 or fp16) the reference runs in that precision too,
    and a third copy runs the same single process in fp32. The reference's distance from it is the
    error the precision itself makes, G (the largest so far; per gradient, relative to its scale;
    for parameters, the worst tensor's relative figure; for the loss, the absolute difference). The
    layout passes when it is within mp_factor x G of the reference, on top of the fp32 allowances. mp_factor 2: the layout and the reference are
    two runs of that precision, each about G from the exact run, so up to ~2G from each other (the
    triangle inequality); a layout bug (a wrong shard, a missing reduction) moves tensors by their
    whole size, far more than a precision's rounding.

    noise_floor (fp32), for configurations whose AdamW magnifies rounding (train/verify_noise.py):
    every step after the first starts the reference from the layout's parameters, the loss and norm
    keep the strict bars, a gradient from the second step on is allowed max(its strict bar, the a
    priori rounding bound on its term mass) (train/verify_terms.py), and each parameter element, on top of its strict bar,
    what AdamW's arithmetic makes of the two runs' gradient differences (AdamBound).

    ref_micro_batches, ref_noise_ulps: the reference's rounding perturbed, to check that verdicts do
    not depend on it (tests/test_verify_noise.py): it sums each batch over that many micro-batches,
    and each nonzero gradient element moves by that many fp32 units of its tensor's scale, with a
    sign drawn from a generator seeded by the step (the same on every rank).
    """
    cfg = Config.from_dict(cfg_dict)
    run = resolve_run(cfg)  # what will run, decided once
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    t, o = cfg.train, cfg.optim

    plain = run.build_model().to(device)
    reference = copy.deepcopy(plain)
    task = run.build_task(plain)
    mesh = build_mesh(cfg.layout)
    (dp_rank, dp_size), dp_group = batch_rank(mesh), replica_group(mesh)
    # parallelize by name, not Run.apply: tests put a faulty layout here (verify must catch it).
    model = parallelize(plain, cfg.layout, mesh, cfg.sharding)
    if t.compile:  # the layout compiled as the trainer compiles it (train/compile.py); the reference stays eager
        fresh_compile_state()
        compile_model(model, backend=t.compile_backend)
    opt = make_optimizer(model, cfg.optim, cfg.layout.precision)
    ref_opt = make_optimizer(reference, cfg.optim, cfg.layout.precision)
    # on_nonfinite "apply": a layout that produces nan is compared as it is (nan fails every bound,
    # step by step) rather than stopped at its first nan, so the report shows where it went wrong.
    common = StepSetup(grad_clip=o.grad_clip, skip_layer_every=cfg.model.skip_layer_every, device=device,
                       on_nonfinite="apply", precision=cfg.layout.precision)
    layout_setup = dataclasses.replace(common, dp_rank=dp_rank, dp_size=dp_size, micro_batches=t.micro_batches)
    bitwise = t.deterministic  # the same micro-batches, summed in the same tree: 0 difference demanded
    if bitwise:
        ref_micro_batches, noise_floor = dp_size * t.micro_batches, False
    ref_setup = dataclasses.replace(common, micro_batches=ref_micro_batches)
    # bf16 autocast rounds like bf16 parameters do: allowances from the same comparison with fp32.
    mixed = get_precision(cfg.layout.precision).mixed or get_precision(cfg.layout.precision).autocast is not None
    bound = AdamBound() if noise_floor and not mixed else None
    terms = TermMass(reference) if bound is not None else None  # the gradients' bar (verify_terms.py)
    gpt = cfg.model.name == "gpt"
    chain = chain_length(reference, t.global_batch * (cfg.model.seq_len if gpt else 1),
                         cfg.model.n_layer * cfg.model.seq_len if gpt else 0)
    grad_floor_top = (0.0, "")
    bound_table: dict[str, dict[str, float]] = {}
    if mixed:
        exact = prepare_model(cfg.model, run.vocab, t.seed, "fp32").to(device)
        exact_opt = make_optimizer(exact, cfg.optim)

    rows = []
    held: dict[str, torch.Tensor] = {}  # the layout's parameters after the last step (noise_floor starts the next there)
    gap = {"param": 0.0, "loss": 0.0, "norm": 0.0}
    grad_gap: dict[str, float] = {}
    for step in range(t.steps):
        captured: dict[str, dict[str, torch.Tensor | None]] = {}
        if bound is not None and step > 0:  # from the layout's own state (AdamW's bound, verify_noise.py)
            with torch.no_grad():
                for n, p in reference.named_parameters():
                    p.copy_(held[n])
        # fp16: gradients are held multiplied by the loss scale; they are compared divided by it.
        scales = (getattr(opt, "loss_scale", 1.0), getattr(ref_opt, "loss_scale", 1.0))
        res = train_step(model, opt, task, step, lr_at(step, o, t), layout_setup,
                         # Sharded gradients are gathered whole for the comparison.
                         StepHooks(before_update=lambda: captured.update(par=unscaled(full_gradients(model), scales[0]))))

        def ref_grads() -> None:
            if ref_noise_ulps:
                perturb(reference, ref_noise_ulps, step)
            captured.update(ref=unscaled(gradients_of(reference), scales[1]))

        if terms is not None:
            terms.reset()
            terms.enabled = True
        ref = train_step(reference, ref_opt, task, step, lr_at(step, o, t), ref_setup, StepHooks(before_update=ref_grads))
        ref_params = dict(reference.named_parameters())
        floors = None
        if terms is not None:
            terms.enabled = False
            # From the second step: the first, from the initial weights, keeps the strict bars (nothing
            # has trained into cancellation yet; a fault in the gradients shows there at full strength).
            floors = mass_floors(terms.mass, clip_coefficient(ref.grad_norm, cfg.optim.grad_clip or math.inf),
                                 chain) if step > 0 else {}
            for n, f in floors.items():
                g = captured["ref"].get(n)
                scale = 0.0 if g is None else g.detach().double().abs().max().item()
                if scale > 0 and f / scale > grad_floor_top[0]:
                    grad_floor_top = (f / scale, n)
        # What the precision itself costs (0 in fp32): the reference against the same single
        # process in fp32, the largest so far (one step's figure can be near zero by coincidence,
        # two errors cancelling). Gradients per tensor, relative to its scale: a layout bug shows in
        # a gradient directly. Parameters: the worst tensor's relative figure, because Adam turns a
        # gradient element's rounding into an update of up to lr in whichever tensor it lands.
        # And at every step, one rounding unit of the compute dtype, relative: after the first update
        # the loss comes from weights rounded from masters that may differ in their last bits; from
        # the first, any layout computes some fp32 value in another order before rounding it to the
        # compute dtype (a tp row layer's sum of partial outputs, cp's ring blocks, a dp rank's fewer
        # rows in another GEMM blocking), so elements land on the other neighbour. The fp32 gap alone
        # was no bar: at step 0 it was 4e-6 by coincidence on one CPU while cp2 bf16 differed by 3e-5
        # under ATEN_CPU_CAPABILITY=default + MKL_CBWR=COMPATIBLE (docs/reliability.md).
        loss_floor = 0.0
        if mixed:
            loss_floor = torch.finfo(get_precision(cfg.layout.precision).matmul_dtype).eps / 2 * abs(ref.loss)
            ex = train_step(exact, exact_opt, task, step, lr_at(step, o, t), dataclasses.replace(common, precision="fp32"),
                            StepHooks(before_update=lambda: captured.update(exact=gradients_of(exact))))
            exact_params = dict(exact.named_parameters())
            for n in captured["ref"]:
                d, scale = tensor_diff(captured["ref"][n], captured["exact"][n])
                grad_gap[n] = max(grad_gap.get(n, 0.0), d / scale if scale > 0 else 0.0)
            gap["param"] = max(gap["param"], worst_pair([(n, ref_params[n], exact_params[n]) for n in ref_params], 0, 1)[1])
            gap["loss"] = max(gap["loss"], abs(ref.loss - ex.loss))
            if math.isfinite(ref.grad_norm) and math.isfinite(ex.grad_norm):
                gap["norm"] = max(gap["norm"], abs(ref.grad_norm - ex.grad_norm))
        # The mean over the replicas, dp x ep x cp (a tp group's ranks each hold their rows' loss: not
        # summed again; cp ranks each their tokens' mean, of equal counts).
        loss = torch.tensor([res.loss], dtype=torch.float64, device=device)  # nccl reduces device tensors only
        dist.all_reduce(loss, group=dp_group)
        loss_par = loss.item() / dist.get_world_size(dp_group)
        grad_abs, grad_rel, grad_used, grad_name = worst_pair(
            [(n, captured["par"][n], captured["ref"][n]) for n in captured["ref"]], 0.0, grad_tol,
            {n: mp_factor * g for n, g in grad_gap.items()}, floors)
        # Sharded parameters (ZeRO-3, tensor parallelism) gathered whole, by their original names.
        held = full_parameters(model)
        missing = sorted(set(ref_params) - set(held))
        if missing:
            raise RuntimeError(f"the layout does not hold parameters {missing[:5]} of the reference")
        pairs = [(n, held[n], ref_params[n]) for n in ref_params]
        if bound is None:
            param_abs, param_rel, param_used, param_name = worst_pair(pairs, atol, tol + mp_factor * gap["param"])
        else:  # each element within its strict bar + AdamW's bound for it (verify_noise.py)
            table = compare(pairs, bound.allowances(reference, ref_opt, captured["ref"], captured["par"]), atol, tol)
            param_abs, param_rel, param_used, param_name = table_worst(table)
            merge(bound_table, table, device)
        # The gradient norm the step clipped with and logged: a sharded layout sums it over its groups
        # (parallel/gradnorm.py), so a group left out shows here. Allowed: what the gradients are.
        norm_allowed = ((grad_tol + mp_factor * max(grad_gap.values(), default=0.0)) * abs(ref.grad_norm)
                        + mp_factor * gap["norm"])
        norm_used = norm_diff(res.grad_norm, ref.grad_norm) / norm_allowed if norm_allowed > 0 else 0.0
        # The worst over ranks: every replica must match, not just rank 0's.
        worst = torch.tensor([grad_abs, grad_rel, grad_used, param_abs, param_rel, param_used, norm_used,
                              abs(res.grad_norm - ref.grad_norm)], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        names: list[Any] = [None] * world
        dist.all_gather_object(names, (grad_used, grad_name, param_used, param_name, loss_par))
        loss_par = max((x[4] for x in names), key=lambda v: abs(v - ref.loss))  # the worst rank's
        rows.append({
            "step": step,
            "loss": loss_par,
            "ref_loss": ref.loss,
            "loss_diff": loss_par - ref.loss,
            "max_abs_grad_diff": worst[0].item(),
            "max_rel_grad_diff": worst[1].item(),
            "grad_allowance_used": worst[2].item(),
            "worst_grad": max(names, key=lambda x: x[0])[1],
            "max_abs_param_diff": worst[3].item(),
            "max_rel_param_diff": worst[4].item(),
            "param_allowance_used": worst[5].item(),
            "worst_param": max(names, key=lambda x: x[2])[3],
            "grad_norm": res.grad_norm,
            "ref_grad_norm": ref.grad_norm,
            "grad_norm_allowance_used": worst[6].item(),
            "abs_grad_norm_diff": worst[7].item(),
            "loss_allowance": tol * abs(ref.loss) + mp_factor * max(gap["loss"], loss_floor),
            "skipped": res.skipped,
            "ref_skipped": ref.skipped,
        })
        if bound is not None:  # this step's largest element allowance from AdamW, and who needed it
            rows[-1].update(anchored=step > 0, adam_bound_max=max((b["bound"] for b in table.values()), default=0.0),
                            adam_bound_needed=sorted(n for n, b in table.items() if b["above_strict"]),
                            grad_floor_rel=grad_floor_top[0], grad_floor_from=grad_floor_top[1])
        r = rows[-1]
        if mixed:
            r.update(precision_loss_gap=gap["loss"], precision_rel_grad_gap=max(grad_gap.values(), default=0.0),
                     precision_rel_param_gap=gap["param"])
        r["passed"] = bool(math.isfinite(r["loss"]) and abs(r["loss_diff"]) <= r["loss_allowance"]
                           and r["param_allowance_used"] <= 1.0 and r["grad_allowance_used"] <= 1.0
                           and r["grad_norm_allowance_used"] <= 1.0 and res.skipped == ref.skipped)
        if bitwise:  # bit for bit: no allowance at all
            r["passed"] = bool(math.isfinite(r["loss"]) and r["loss_diff"] == 0.0 and r["max_abs_grad_diff"] == 0.0
                               and r["max_abs_param_diff"] == 0.0 and r["abs_grad_norm_diff"] == 0.0
                               and res.skipped == ref.skipped)
    bars = None
    if noise_floor:  # per parameter, its step closest to the allowance (each tensor's worst rank)
        bars = bound_report(bound_table, t.steps, chain, *grad_floor_top) if bound is not None else {
            "measured": False, "why": "mixed precision: the precision's own error, measured against fp32, is the allowance"}
    # What dynamo compiled on each rank: a layout whose blocks silently ran eager shows 0 graphs.
    compiled: list[Any] = [None] * world
    dist.all_gather_object(compiled, compile_stats() if t.compile else None)
    if rank != 0:
        return None
    max_rel_loss = max(abs(r["loss_diff"]) / max(abs(r["ref_loss"]), 1e-30) for r in rows)
    report = {
        "layout": {"dp": cfg.layout.dp, "dp_mode": cfg.layout.dp_mode, "zero": cfg.layout.zero,
                   "tp": cfg.layout.tp, "sp": cfg.layout.sp, "tp_plan": cfg.layout.tp_plan,
                   "comm_impl": cfg.layout.comm_impl, "micro_batches": t.micro_batches,
                   "precision": cfg.layout.precision, "pp": cfg.layout.pp, "schedule": cfg.layout.schedule,
                   "virtual_stages": cfg.layout.virtual_stages, "ep": cfg.layout.ep, "cp": cfg.layout.cp,
                   "mesh_order": cfg.layout.mesh_order},
        "model": cfg.model.name,
        "family": family(cfg.model),
        "world_size": world,
        "steps": t.steps,
        "tolerance": tol,
        "atol": atol,
        "grad_tolerance": grad_tol,
        "mp_factor": mp_factor if mixed else None,
        "deterministic": bitwise,
        "max_abs_grad_norm_diff": max(r["abs_grad_norm_diff"] for r in rows),
        "loss_diffs": [r["loss_diff"] for r in rows],
        "max_rel_loss_diff": max_rel_loss,
        "max_abs_grad_diff": max(r["max_abs_grad_diff"] for r in rows),
        "max_rel_grad_diff": max(r["max_rel_grad_diff"] for r in rows),
        "max_abs_param_diff": max(r["max_abs_param_diff"] for r in rows),
        "max_rel_param_diff": max(r["max_rel_param_diff"] for r in rows),
        "param_allowance_used": max(r["param_allowance_used"] for r in rows),
        "grad_allowance_used": max(r["grad_allowance_used"] for r in rows),
        "max_rel_grad_norm_diff": max(norm_diff(r["grad_norm"], r["ref_grad_norm"]) / max(abs(r["ref_grad_norm"]), 1e-30)
                                      for r in rows),
        "per_step": rows,
        "compiled": compiled if t.compile else None,
        "noise_floor": bars,
        "config": cfg.to_dict(),
    }
    # Pass: the loss within tol relative; every parameter within atol + tol x its tensor's scale;
    # every gradient within grad_tol x its tensor's scale.
    #  * atol: biases and norms start at zero or one and after a step or two their scale is ~lr, so
    #    a difference of a few rounding units of the update is a large share of that scale; atol
    #    (1e-7, one fp32 unit in the last place at 1.0) absorbs exactly that and nothing larger.
    #  * grad_tol: a gradient is a sum over the batch taken in another order (per rank, then across
    #    ranks); where its terms cancel (a norm's bias) its relative rounding error grows with the
    #    cancellation, ~1e-6 here, so gradients get a looser tolerance.
    #  * mixed precision: on top, mp_factor x what the precision itself changes (see verify_rank).
    report["passed"] = bool(all(r["passed"] for r in rows))
    return report
