"""Training throughput of our tensor parallelism beside torch's (DTensor `parallelize_module`), with
the communication each moves and the activation memory each holds: `shardlab bench train --tp N`.

    result = run_train_bench(cfg_with_tp_2, ["torch_tp", "tp", "torch_tp_sp", "tp_sp"], runs=3)

Variants, all on the same plain GPT from the same seed, trained on the same batches:

  tp           ours: parallel/layout.py's parallelize (GPT_PLAN over the mesh's tp axis, then the
               data-parallel wrapper over its dp axis), stepped by the trainer's train_step
  tp_sp        the same with sequence parallelism
  torch_tp     torch's ColwiseParallel/RowwiseParallel plan (bench/torch_tp.py), loss_parallel
  torch_tp_sp  the same with SequenceParallel norms
  decl         declarative sharding (parallel/sharding): the rules heads/mlp/vocab over tp, the plan derived
               and compiled onto the plain model, then the same data-parallel wrapper (not run unless asked for)
  decl_sp      the same rules with seq over tp
  torch_tp_naive_kv  torch_tp with the fused key/value weight split naively: a *wrong* model, which
               the loss check below must refuse (not run unless asked for)

One run is one launch (bench/train.py's run_train_bench). In it, before anything is timed:

1. The check. The plain model takes one optimizer step on the whole global batch in one process
   (train_step, as verify's reference does); every variant takes the same step on its ranks. The
   loss of step 0 and the loss of the step-1 batch after the update must equal the reference's
   within `rtol`, or the run stops with LossMismatch naming every variant and number: a benchmark of
   a wrong model is worthless.
2. Communication. One untimed step per variant under a dispatcher-level counter (torch_tp.py's
   DispatchCommCounter: our c10d calls and DTensor's functional collectives alike; for ours also
   count_comm(), which counts our autograd collectives and must agree with it), split into forward
   + backward and what follows (gradient sync, clipping). The same at a second depth gives the
   counts per layer and at the edges (tp_volume.py), to set beside Megatron's formula.
3. Activation memory. One forward and backward per variant (and the plain model, on the same rows)
   under MemoryTracker, parameters as baseline: "held" is what forward leaves for backward, "peak"
   the highest during both (gradients included).

Then the variants take turns, `reps` times, timed as bench/train.py times data parallelism; after
its timed steps each variant runs min(steps, 3) more under torch.profiler, which split a step into
compute, communication and the dispatch cost around them (bench/dispatch_cost.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlab.bench import torch_tp as ttp
from shardlab.bench.dispatch_cost import dispatch_split, profile_steps
from shardlab.bench.train_timing import DrawnBatches, timed_steps
from shardlab.bench.variants import DECL, DECL_SP, TORCH_TP, TORCH_TP_SP, TP, TP_KNOWN, TP_SP, WRONG_KV
from shardlab.comm.autograd import count_comm
from shardlab.comm.validate import validation_off
from shardlab.dist.env import synchronize
from shardlab.parallel.layout import build_mesh
from shardlab.parallel.parallelize import parallelize
from shardlab.parallel.sharding import ShardingSection
from shardlab.train.config import Config
from shardlab.train.loop import rank_device
from shardlab.train.memory_tracker import MemoryTracker, tensor_bytes
from shardlab.train.step import StepHooks, StepSetup, lr_at, make_optimizer, train_step
from shardlab.train.task import Task
from shardlab.train.resolve import Run, resolve_run

DECL_RULES = {DECL: "heads=tp, mlp=tp, vocab=tp", DECL_SP: "heads=tp, mlp=tp, vocab=tp, seq=tp"}
YARDSTICK = {TP: TORCH_TP, TORCH_TP: TORCH_TP, TP_SP: TORCH_TP_SP, TORCH_TP_SP: TORCH_TP_SP, WRONG_KV: TORCH_TP,
             DECL: TORCH_TP, DECL_SP: TORCH_TP_SP}
"""Each variant's ratio is to torch's version of the same layout (with or without SP)."""
RTOL = 1e-5
"""Loss agreement asked of every variant, relative. Measured: ~1e-7 (a few fp32 roundings of ~5.5),
and the naive key/value split is off by ~1e-3, four orders of magnitude apart either way."""


class LossMismatch(RuntimeError):
    """A variant's loss differs from the single-process reference's: it does not train the same model."""


def is_torch(variant: str) -> bool:
    return variant.startswith("torch_")


def uses_sp(variant: str) -> bool:
    return variant.endswith("_sp")


@dataclass
class Setup:
    """What every variant of a run shares: the resolved run (train/resolve.py), the meshes, the batches."""

    run: Run
    device: torch.device
    mesh: Any             # ours: shardlab.dist.mesh.DeviceMesh, dp x tp
    torch_mesh: Any       # torch's 1-D DeviceMesh over tp, None without torch variants
    task: Task            # the data (reading the corpus takes seconds: once per run)
    drawn: DrawnBatches         # this dp rank's batches
    dp_rank: int
    dp_size: int
    data_bytes: int = 0  # the batches and corpus: in every whole-step figure, subtracted

    def batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        micro = self.run.train.micro_batches
        return [self.drawn.batch(step, self.dp_rank, self.dp_size, micro, m) for m in range(micro)]


def build(variant: str, s: Setup, n_layer: int | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The variant's model (from the run's seed) and optimizer."""
    run = s.run
    if n_layer is not None:  # the same run at another depth (count_step's second one)
        run = dataclasses.replace(run, model=dataclasses.replace(run.model, n_layer=n_layer))
    model = run.build_model().to(s.device)
    if is_torch(variant):
        model = ttp.torch_tensor_parallel(model, s.torch_mesh, uses_sp(variant), permute_kv=variant != WRONG_KV)
        return model, ttp.torch_optimizer(model, run.optim)
    if variant in DECL_RULES:
        model = parallelize(model, run.layout, s.mesh, ShardingSection(compute=DECL_RULES[variant]))
    else:
        model = parallelize(model, dataclasses.replace(run.layout, sp=uses_sp(variant)), s.mesh)
    return model, make_optimizer(model, run.optim, run.precision)


def step(variant: str, model: nn.Module, opt: torch.optim.Optimizer, s: Setup, i: int,
         after_backward: Callable[[], None] | None = None) -> float:
    """Step i (the trainer's: micro-batches, sync, clip, AdamW); this rank's mean loss."""
    c = s.run
    if is_torch(variant):
        return ttp.torch_train_step(model, opt, s.batches(i), lr=lr_at(i, c.optim, c.train), grad_clip=c.optim.grad_clip,
                                    after_backward=after_backward)
    setup = StepSetup(dp_rank=s.dp_rank, dp_size=s.dp_size, micro_batches=c.train.micro_batches,
                      grad_clip=c.optim.grad_clip, device=s.device)
    return train_step(model, opt, s.drawn, i, lr_at(i, c.optim, c.train), setup,
                      StepHooks(after_backward=after_backward)).loss


@torch.no_grad()
def eval_loss(variant: str, model: nn.Module, s: Setup, i: int) -> float:
    losses = [ttp.local_loss(ttp.forward_loss(model, x, y)) if is_torch(variant) else model(x, y)
              for x, y in s.batches(i)]
    return float(torch.stack([l.double() for l in losses]).mean())


def _dp_mean(value: float, s: Setup) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=s.device)
    if s.dp_size > 1:
        dist.all_reduce(t, group=s.mesh.group("dp"))
    return t.item() / s.dp_size


def check_losses(variants: list[str], s: Setup, rtol: float = RTOL) -> dict[str, Any]:
    """Step 0's loss and the step-1 batch's loss after it, for the plain model on the whole global
    batch and for every variant; raises LossMismatch (on every rank alike) when any differs."""
    c = s.run
    plain = c.build_model().to(s.device)
    global_batch = DrawnBatches(s.task, 2, 0, 1, c.train.micro_batches, s.device)
    ref_setup = Setup(c, s.device, None, None, s.task, global_batch, 0, 1)
    opt = make_optimizer(plain, c.optim, c.precision)
    ref = [step("plain", plain, opt, ref_setup, 0), eval_loss("plain", plain, ref_setup, 1)]
    out: dict[str, Any] = {"reference": ref, "rtol": rtol, "variants": {}}
    bad = []
    for v in variants:
        model, opt = build(v, s)
        got = [_dp_mean(step(v, model, opt, s, 0), s), _dp_mean(eval_loss(v, model, s, 1), s)]
        worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
        out["variants"][v] = {"losses": got, "max_rel_diff": worst}
        if not worst <= rtol:  # also catches nan
            bad.append(f"{v}: losses {got[0]:.8f} (step 0), {got[1]:.8f} (after it) vs one process's "
                       f"{ref[0]:.8f}, {ref[1]:.8f}: relative difference {worst:.2e} > {rtol:.0e}")
        del model, opt
    if bad:
        raise LossMismatch("variants that do not compute the plain model's loss (not timed):\n  " + "\n  ".join(bad))
    return out


def count_step(variant: str, s: Setup, n_layer: int) -> dict[str, Any]:
    """One untimed step at depth n_layer under the counters: {"fwd_bwd", "after_backward"}
    (DispatchCommCounter's, per operation) and, for ours, "count_comm" (our autograd collectives)."""
    model, opt = build(variant, s, n_layer)
    counter = ttp.DispatchCommCounter("fwd_bwd")
    with validation_off(), counter, count_comm() as ours:
        step(variant, model, opt, s, 0, after_backward=lambda: counter.phase("after_backward"))
    out = {phase: c.as_dict() for phase, c in counter.phases.items()}
    if not is_torch(variant):
        out["count_comm"] = ours.as_dict()
    return out


def activation_memory(variant: str, model: nn.Module, s: Setup) -> dict[str, int]:
    """{"held", "peak"} bytes of one forward and backward on step 0's first micro-batch."""
    from torch.distributed.tensor.parallel import loss_parallel

    x, y = s.batches(0)[0]
    gc.collect()
    context = loss_parallel() if is_torch(variant) else contextlib.nullcontext()
    with MemoryTracker(s.device, baseline=list(model.parameters())) as mt, context:
        entry = mt.current_bytes
        loss = model(x, y)
        held = mt.current_bytes - entry
        loss.backward()
        synchronize(s.device)
        peak = mt.peak_bytes - entry
    if hasattr(model, "finish_gradient_sync"):
        model.finish_gradient_sync()
    model.zero_grad(set_to_none=True)
    return {"held": held, "peak": peak}


def shared_setup(run: Run, variants: list[str], steps: int) -> Setup:
    """What every variant of the run shares on this rank: the meshes, the task, `steps` batches drawn."""
    device = rank_device()
    mesh = build_mesh(run.layout)
    torch_mesh = None
    if any(is_torch(v) for v in variants):
        if run.layout.dp != 1:
            raise ValueError(f"torch's tensor parallelism is compared at layout.dp = 1 only, not {run.layout.dp}")
        from torch.distributed.device_mesh import init_device_mesh

        torch_mesh = init_device_mesh(device.type, (run.layout.tp,), mesh_dim_names=("tp",))
    dp_rank, dp_size = mesh.local_rank("dp"), run.layout.dp
    task = run.build_task(run.build_model())
    drawn = DrawnBatches(task, max(2, steps), dp_rank, dp_size, run.train.micro_batches, device)
    s = Setup(run, device, mesh, torch_mesh, task, drawn, dp_rank, dp_size)
    # The benchmark's own data (the corpus, the batches drawn in advance) is no variant's memory.
    data = [*vars(task.train).values(), *vars(task.val).values(), *(x for b in drawn.batches.values() for x in b)]
    s.data_bytes = tensor_bytes(x for x in data if isinstance(x, torch.Tensor) and x.device == device)
    return s


def tp_bench_rank(cfg_dict: dict[str, Any], variants: list[str], reps: int, steps: int, warmup: int,
                  check: bool = True) -> dict[str, Any] | None:
    """One run on this rank (module docstring); rank 0 returns the timed steps' seconds per variant,
    each rank's whole-step peak bytes, the check, the counts and the activation memory."""
    unknown = [v for v in variants if v not in TP_KNOWN]
    if unknown or reps < 1 or steps < 1 or warmup < 1:
        raise ValueError(f"variants {unknown} unknown, or reps {reps} / steps {steps} / warmup {warmup} < 1")
    run = resolve_run(Config.from_dict(cfg_dict))  # the one place this rank reads the whole configuration
    s = shared_setup(run, variants, warmup + steps)
    rank, n = dist.get_rank(), dist.get_world_size()
    checked = check_losses(variants, s) if check else None
    depth = run.model.n_layer
    other = depth - 1 if depth > 1 else 2  # a second depth, to tell the layers' traffic from the edges'
    counts = {v: {"layers": [depth, other], "at": [count_step(v, s, depth), count_step(v, s, other)]}
              for v in variants}
    plain = run.build_model().to(s.device)
    memory = {"plain": activation_memory("plain", plain, s)}
    del plain
    times: dict[str, list[float]] = {v: [] for v in variants}
    phases: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    peaks: dict[str, int] = {v: 0 for v in variants}
    dispatch: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for rep in range(reps):
        for v in variants:
            gc.collect()
            model, opt = build(v, s)
            if rep == 0:
                memory[v] = activation_memory(v, model, s)
            marks: list[float] = []  # per step: its start, the end of its backward, its end

            def marked_step(i: int, v: str = v, model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
                marks.append(time.perf_counter())
                step(v, model, opt, s, i, after_backward=lambda: marks.append(time.perf_counter()))
                marks.append(time.perf_counter())

            times[v] += timed_steps(marked_step, warmup, steps, s.device)
            # This rank's split of each timed step: forward + backward, then sync, clipping, AdamW.
            split = [(marks[3 * k + 1] - marks[3 * k], marks[3 * k + 2] - marks[3 * k + 1])
                     for k in range(warmup, warmup + steps)]
            phases[v] += split
            # The same steps again, warm, under the profiler: the same count for every variant.
            profiled = profile_steps(lambda i, v=v, model=model, opt=opt: step(v, model, opt, s, i), warmup,
                                     min(steps, 3))
            dispatch[v].append(dispatch_split([a + b for a, b in split], profiled))
            gc.collect()
            dist.barrier()
            with MemoryTracker(s.device) as tracker:
                step(v, model, opt, s, 0)
                synchronize(s.device)
            peaks[v] = max(peaks[v], tracker.peak_bytes - s.data_bytes)
            del model, opt, marked_step  # the next variant is measured without this one alive
    every: list[Any] = [None] * n
    dist.all_gather_object(every, {"peaks": peaks, "memory": memory, "phases": phases, "dispatch": dispatch})
    if rank != 0:
        return None
    plain = run.build_model()
    return {
        "step_s": times,
        "peak_bytes": {v: [e["peaks"][v] for e in every] for v in variants},
        "activation_bytes": {k: [e["memory"][k] for e in every] for k in memory},
        "phase_s": {v: [e["phases"][v] for e in every] for v in variants},  # [rank][step] (fwd+bwd, rest)
        "dispatch": {v: [e["dispatch"][v] for e in every] for v in variants},  # [rank][rep] dispatch_split
        "check": checked,
        "comm": counts,
        "world_size": n,
        "threads_per_rank": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "device": s.device.type,
        "params": sum(p.numel() for p in plain.parameters()),
        "tokens_per_row": run.model.seq_len,
        "flops_per_token": plain.flops_per_token(run.model.seq_len),
    }
