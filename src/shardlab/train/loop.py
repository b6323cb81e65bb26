"""The training loop: one function that every rank runs, locally launched or under torchrun.

    shardlab train --config configs/gpt-small.toml --dp 2
    shardlab train --config configs/gpt-small.toml --dp 2 --tp 2 --sp      # 4 ranks: dp 2 x tp 2
    shardlab train --config configs/gpt-small.toml --pp 2 --schedule 1f1b --microbatches 4
    torchrun --standalone --nproc-per-node 2 -m shardlab train --config configs/gpt-small.toml --dp 2

Each step: this rank's micro-batches forward and backward (under a pipeline, its schedule's),
gradient sync by the layout, clipping, AdamW (train/step.py), with nothing read back to the host:
the steps' losses, norms and times stay on the device until the loop needs them (logging steps,
validation, checkpoints, a stop, the end: train/window.py), then come in one synchronisation and one
tiny all_gather of every rank's rows, so the curve is the global loss: the mean over dp ranks, since the ranks of a tp group compute the same loss on the same rows
and every stage of a pipeline returns its replica's loss; logged steps also measure peak tensor
memory per rank. A pipeline's communication wait is its time blocked on activations and gradients
from the other stages (the bubble shows there) plus its data-parallel sync. Throughput and MFU count the plain model's FLOPs over every rank. Rank 0 writes metrics.jsonl, TensorBoard events, and at the end loss.png, the
sampled text and summary.json into log.out_dir.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.parallel.deterministic.mode import deterministic_mode
from shardlab.checkpoint import Checkpointer, CheckpointError, load_checkpoint
from shardlab.checkpoint.verify import newest_verified, verify_together
from shardlab.dist import signals
from shardlab.parallel.layout import batch_rank, build_mesh, replica_group, uses_pipeline
from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.precision import autocast_context, get_precision
from shardlab.train.applied import applied_everywhere
from shardlab.train.compile import (compile_model, compiled_everywhere, compiled_target_count, describe_compiled,
                                    reset_compile_counters)
from shardlab.train.mfu import FlopsAccounting, run_flops
from shardlab.train.nonfinite import nothing_trained, raise_together
from shardlab.train.memory_tracker import MemoryTracker
from shardlab.train.metrics import MetricsWriter, step_line
from shardlab.train.plot import plot_loss
from shardlab.train.prefetch import Prefetcher
from shardlab.train.resolve import Run
from shardlab.train.sample import sample_text
from shardlab.train.sections import CheckpointSection
from shardlab.train.step import StepSetup, lr_at, make_optimizer, train_step
from shardlab.train.stop import StopAgreement
from shardlab.train.task import Task
from shardlab.train.window import StepWindow


def rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: Task, dp_rank: int, dp_size: int, batches: int,
             device: torch.device, dp_group: dist.ProcessGroup | None = None) -> float:
    """Mean loss over `batches` held-out global batches, each batch rank (dp x ep) taking its rows
    (the ranks of a tp group take the same rows and get the same loss: averaged over `dp_group`, the
    replicas (dp x ep x cp), not counted tp times)."""
    task.check_files()  # a raw .bin rewritten under the run: said here, not trained on (one stat a file)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(batches):
        x, y = task.val.batch(i, dp_rank, dp_size)
        total += model(x.to(device), y.to(device)).double()
    model.train(was_training)
    total /= batches
    comm.all_reduce(total, group=dp_group)  # recorded, as the step's gather below
    return total.item() / dist.get_world_size(dp_group)


def layout_name(lay: LayoutSection, micro_batches: int) -> str:
    """'dp 2 (overlap)', 'dp 2 (ZeRO-2) x tp 2 + sp (megatron)', 'pp 4 (1f1b, m 8) x dp 2 (bucketed)',
    ... for headers and titles (`micro_batches`: train.micro_batches, a pipeline's m): the layout's own
    description (LayoutSection.describe), then where it runs and in which precision."""
    text = lay.describe(micro_batches)
    if lay.nodes > 1:
        text += f" on {lay.nodes} nodes"
    return text + ("" if lay.precision == "fp32" else f", {lay.precision}")


def train_rank(run: Run) -> dict[str, Any] | None:
    """Train `run` (resolved once by the launcher, train/resolve.py) on this rank; rank 0 returns the
    run's summary. A stop signal (SIGTERM, SIGHUP, Ctrl-C) ends the run at the next step boundary, on
    every rank at the same step, with the summary, metrics and plot of the steps done (dist/signals.py).
    Under train.deterministic the whole run is in its mode (parallel/deterministic/mode.py)."""
    with signals.cooperative(), deterministic_mode(run.config.train.deterministic):
        return _train(run)


train_rank.stops_at_step_boundary = True  # type: ignore[attr-defined]  # a signal at start-up is kept for it


def _train(run: Run) -> dict[str, Any] | None:
    # Below here each part takes what it needs of the run; the resolved configuration is only recorded.
    cfg = run.config
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    t, lay, o = run.train, run.layout, run.optim

    plain = run.build_model().to(device)
    # The plain model's size and FLOPs, before tensor parallelism cuts it to this rank's shards.
    task = run.build_task(plain)
    n_params = sum(p.numel() for p in plain.parameters())
    mesh = build_mesh(lay)
    # Rows split over the dp x ep batch ranks; dense gradients and losses averaged over dp x ep x cp.
    (dp_rank, dp_size), dp_group = batch_rank(mesh), replica_group(mesh)
    # Each replica's loss, counted once: the ranks of a tp group and the stages of a pipeline all hold it.
    dp_leaders = [r for r in range(world) if mesh.coords(r)["pp"] == 0 and mesh.coords(r)["tp"] == 0]
    # MFU's FLOPs and peak, of the whole model (train/mfu.py).
    flops = run_flops(plain, lay, run.model.seq_len, run.log.peak_tflops, device)
    model = run.apply(plain, mesh)
    compile_targets, compiled = 0, []  # compiled: each rank's graphs after its first step
    if t.compile:
        reset_compile_counters()
        compile_targets = compiled_target_count(model)
        compile_model(model, backend=t.compile_backend)
    # On CPU the memory tracker is a dispatch mode, under which dynamo skips a frame for good: the
    # compiled forward would run eagerly from the first logged step on (train/compile.py). CUDA's
    # tracker reads the allocator and composes.
    track_memory = run.log.memory and not (t.compile and device.type == "cpu")
    split = model.stage.plan.describe() if uses_pipeline(lay) else None
    del plain  # a pipeline stage holds copies of its layers: the whole model is not kept
    optimizer = make_optimizer(model, o, run.precision)
    facts = applied_everywhere(model, optimizer)  # what each rank runs, from its live objects (train/applied.py)
    # Identical weights came from the shared seed; from here each dp rank draws its own randomness
    # from torch's generator, and the ranks of a tp group draw alike. Dropout does not depend on it:
    # its masks are hashed from each element's place in the run (models/dropout.py, batch_place).
    torch.manual_seed(t.seed * 1_000_003 + 1 + dp_rank)
    tokens_per_step = t.global_batch * task.tokens_per_row

    out_dir = Path(run.log.out_dir)
    # After the seeding above: a checkpoint restores every rank's random streams over it. The step
    # is also the data position (the samplers are keyed by (seed, step)).
    checkpointer, start_step, resumed = open_checkpoints(run.checkpoint, checkpoint_dir(run.checkpoint, out_dir),
                                                         t.steps, model, optimizer)
    writer = MetricsWriter.for_run(run.log, cfg.to_dict(), cfg.to_toml(),
                                   resume_step=start_step if resumed else None) if rank == 0 else None
    if rank == 0:
        (out_dir / "config.toml").write_text(cfg.to_toml())
        print(f"{run.model.name}: {n_params:,} parameters | {world} rank(s), {layout_name(lay, t.micro_batches)} | "
              f"global batch {t.global_batch} x {task.tokens_per_row} tokens | {t.steps} steps | "
              f"writing {out_dir}/", flush=True)
        if world > 1:
            print(f"mesh ({' x '.join(f'{n} {s}' for n, s in zip(mesh.names, mesh.sizes))}, outermost first):\n"
                  + mesh.describe(), flush=True)
        print(flops.describe(), flush=True)
        if split:
            print(split, flush=True)
        if resumed:
            print(f"resumed from {resumed} at step {start_step}", flush=True)
        if run.log.memory and not track_memory:
            print("peak memory not measured: on CPU the memory tracker is a dispatch mode, which would keep "
                  "torch.compile from tracing the model (train.compile); log.memory = false silences this",
                  flush=True)

    records: list[dict[str, Any]] = []
    window = StepWindow(world, device, lr_of=lambda s: lr_at(s, o, t))
    stop = StopAgreement(world, dist.get_backend())
    loss_scaling = get_precision(lay.precision).loss_scaling
    feed = Prefetcher(task, device)  # the next step's batches made (and on CUDA copied) during this one
    # Nothing is read back in a step (check_now=False): the loss, the norm and the non-finite flag stay
    # on the device until the window is read (train/window.py).
    setup = StepSetup(dp_rank=dp_rank, dp_size=dp_size, micro_batches=t.micro_batches, grad_clip=o.grad_clip,
                      skip_layer_every=run.model.skip_layer_every, device=device, on_nonfinite=o.on_nonfinite,
                      precision=run.precision, check_now=False)
    run_start = time.perf_counter()
    stopped_by = 0  # the stop signal the ranks agreed to end on (0: none)
    for step in range(start_step, t.steps):
        inject_fault(step, rank)
        # Steps count from 1 on the console: the first, every log_every-th (so step 100's line also
        # carries its validation loss when eval_every is a multiple) and the last.
        logged = step == 0 or (step + 1) % t.log_every == 0 or step == t.steps - 1
        tracker = MemoryTracker(device) if (logged and track_memory) else None
        window.started()
        if tracker is not None:
            tracker.__enter__()
        try:
            res = train_step(model, optimizer, feed, step, lr_at(step, o, t), setup)
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
        window.add(step, res, tracker)
        if t.compile and step == start_step:  # once: every rank traced its training forward, or the run stops
            compiled = compiled_everywhere(compile_targets)
            if rank == 0:
                print(describe_compiled(compiled, t.compile_backend), flush=True)
        # Every rank stops after the same step: the ranks' stop signals are agreed on the host, by
        # a one-number collective on a CPU group, which never waits for the device.
        stopped_by = stop.agree(signals.requested())
        evaluating = not stopped_by and ((t.eval_every and (step + 1) % t.eval_every == 0) or step == t.steps - 1)
        ck, last = run.checkpoint, step == t.steps - 1
        saving = checkpointer is not None and ((ck.every and ((step + 1) % ck.every == 0 or last))
                                               or (ck.final and last) or (stopped_by and ck.save_on_signal))
        if not (logged or evaluating or saving or stopped_by):
            continue
        # Read the window: one synchronisation and one gather for the steps since the last read; a
        # non-finite gradient norm under on_nonfinite 'stop' raises below, before anything is saved.
        for rec in window.read(dp_leaders, tokens_per_step, lambda rate: flops.rates(rate, world),
                               o.on_nonfinite):
            rec.pop("_nonfinite", None)
            skipped, scale = rec.pop("_skipped"), rec.pop("_loss_scale")
            if loss_scaling:  # fp16: the scale and whether the step was skipped
                rec.update(loss_scale=scale, skipped=skipped)
            elif skipped:  # a non-finite gradient norm under optim.on_nonfinite = 'skip'
                rec["skipped"] = True
            done = rec["step"] - 1  # the loop's index of the step (records count steps done, from 1)
            if done == step and evaluating:
                # Through the wrapper, not the plain module: a layout that shards parameters gathers them in forward.
                with autocast_context(lay.precision, device):
                    rec["val_loss"] = evaluate(model, task, dp_rank, dp_size, t.eval_batches, device, dp_group)
            records.append(rec)
            rec_logged = done == 0 or (done + 1) % t.log_every == 0 or done == t.steps - 1
            if writer is not None:
                writer.write(rec)
                if rec_logged or "val_loss" in rec or (skipped and not loss_scaling):  # each skip said
                    print(step_line(rec, t.steps), flush=True)
            if rec_logged:
                window.logged()
        if window.error is not None:  # the steps before it are written; nothing after it is saved
            raise window.error
        if saving:
            checkpointer.save(step + 1, model, optimizer, config=cfg.to_dict())
        if stopped_by:
            _say_stopped(stopped_by, step, t.steps, checkpointer if saving else None, rank)
            break

    feed.close()
    failed = nothing_trained(model, optimizer, task, records, setup, lambda s: lr_at(s, o, t))  # all skipped
    saved = None  # the newest checkpoint this run wrote
    if checkpointer is not None:
        saved = checkpointer.wait()  # an asynchronous save still in flight committed
        checkpointer.close()
    wall = time.perf_counter() - run_start
    sample = None
    m, log = run.model, run.log
    if m.name == "gpt" and log.sample_tokens > 0 and task.tokenizer is not None and not (stopped_by or failed):
        # Every rank samples the same text (same seed): a sharded layout needs all ranks in forward,
        # and a pipeline's forward passes through every stage and hands the logits to all of them.
        # Sequence parallelism splits every sequence over tp, context parallelism into 2 cp chunks (and
        # sp a cp rank's tokens further): the window is padded to a multiple of what they split it by.
        with autocast_context(lay.precision, device):
            sample = sample_text(model, m.seq_len, log.sample_prompt, log.sample_tokens,
                                 log.sample_temperature, seed=t.seed, device=device,
                                 multiple=(lay.tp if lay.sp else 1) * (2 * lay.cp if lay.cp > 1 else 1),
                                 tokenizer=task.tokenizer)
    if rank != 0:
        return raise_together(failed)
    assert writer is not None
    writer.close()
    if not records:  # resumed from a checkpoint of the last step: nothing left to train
        return {"steps": 0, "resumed_from": resumed, "out_dir": str(out_dir), "metrics": str(writer.path)}
    title = f"{m.name} {m.n_layer}x{m.d_model}, {layout_name(lay, t.micro_batches)}" if log.plot else None
    summary = _finish(sample, records, window.steady + window.untraced, wall, tokens_per_step, out_dir,
                      flops=flops, world=world, stopped_by=signals.signal_name(stopped_by) if stopped_by else None,
                      steps_planned=t.steps, plot_title=title)
    if summary["final_val_loss"] is not None and task.bytes_per_token:
        # Per token, losses of different tokenizers do not compare; per byte of text they do.
        summary["final_val_bits_per_byte"] = summary["final_val_loss"] / math.log(2) / task.bytes_per_token
    if resumed:
        summary["resumed_from"] = resumed
    if saved is not None:
        summary["checkpoint"] = str(saved)
    summary["applied"] = facts
    if t.compile:
        summary["compiled"] = compiled
    # Where every rank sat and what it paid: its mesh coordinates, peak memory, communication share.
    shares = [r["comm_wait_share_per_rank"] for r in records]
    summary["ranks"] = [{"rank": r, "coords": mesh.coords(r), "node": mesh.node_of(r),
                         "peak_mem_bytes": summary["peak_mem_bytes"][r] if summary["peak_mem_bytes"] else None,
                         "comm_wait_share": sum(s[r] for s in shares) / len(shares)} for r in range(world)]
    # Again, whole: summary.json held only what _finish knew (no bits per byte, resume or ranks).
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    raise_together(failed)
    return summary


def _say_stopped(signum: int, step: int, steps: int, checkpointer: Any, rank: int) -> None:
    """Rank 0 says where a stop signal ended the run and, when it saved, that the save committed.

    An asynchronous save is still being written when `save` returns: it is waited for here (the run
    ends anyway), so that "saved" is said only of a committed checkpoint; a save that failed (a full
    disk) is said to have failed, on every rank (the ranks agree on a save's outcome), and raised."""
    head = f"{signals.signal_name(signum)}: stopping after step {step + 1} of {steps}"  # steps done, from 1
    if checkpointer is None:
        if rank == 0:
            print(head, flush=True)
        return
    try:
        checkpointer.wait()
    except BaseException as exc:
        if rank == 0:
            print(f"{head}; the checkpoint of step {step + 1} was NOT saved: {type(exc).__name__}: {exc}", flush=True)
        raise
    if rank == 0:
        print(f"{head}, checkpoint of step {step + 1} saved", flush=True)


def checkpoint_dir(ck: CheckpointSection, out_dir: str | Path) -> Path:
    """checkpoint.dir, or <log.out_dir>/checkpoints."""
    return Path(ck.dir or Path(out_dir) / "checkpoints").expanduser()


def open_checkpoints(ck: CheckpointSection, root: Path, steps: int, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer) -> tuple[Any, int, str | None]:
    """The checkpointer (None when nothing is ever saved), the step to start from, and the
    checkpoint resumed from (None: afresh), under `root` (checkpoint_dir), for a run of `steps` steps
    (train.steps). Every rank, at the same point: loading is collective.

    The checkpoint is verified first, its files shared between the ranks (each hashed once): resume
    "latest" takes the newest one that passes and says on rank 0 which newer ones it skipped and
    why; a named one that fails is refused."""
    checkpointer = Checkpointer(root, keep=ck.keep or None, async_save=ck.async_save) \
        if ck.every or ck.final or ck.save_on_signal else None
    if ck.resume == "latest":
        path, skipped = newest_verified(root, agreed=True)
        if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
            for bad, why in skipped:
                print(f"resume: skipped {bad}: {why}", flush=True)
    else:
        path = Path(ck.resume) if ck.resume else None
        problems = verify_together(path) if path is not None else []
        if problems:
            raise CheckpointError(f"checkpoint.resume = {ck.resume!r} fails its checks:\n"
                                  + "\n".join(f"  {p}" for p in problems))
    if path is None:
        return checkpointer, 0, None
    info = load_checkpoint(path, model, optimizer, verify=False)  # just verified
    if info.step > steps:
        raise ValueError(f"checkpoint {info.path} is at step {info.step}, past train.steps = {steps}")
    return checkpointer, info.step, str(info.path)


def inject_fault(step: int, rank: int) -> None:
    """A testing aid for recovery: SHARDLAB_FAULT='STEP:RANK' kills that rank (SIGKILL: no cleanup,
    as a machine failure) when it reaches that step, on a job's first attempt only, so a job
    restarted by torchrun --max-restarts goes through."""
    fault = os.environ.get("SHARDLAB_FAULT", "")
    if not fault or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    at_step, _, at_rank = fault.partition(":")
    if int(at_step) == step and int(at_rank or 0) == rank:
        print(f"SHARDLAB_FAULT: killing rank {rank} at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _finish(sample: str | None, records: list[dict[str, Any]], untraced: list[float],
            wall: float, tokens_per_step: int, out_dir: Path, flops: FlopsAccounting | None = None,
            world: int = 1, stopped_by: str | None = None, steps_planned: int = 0,
            plot_title: str | None = None) -> dict[str, Any]:
    """Rank 0's end of run: the plot (titled `plot_title`; None: log.plot is off), sampled text and
    summary.json (which says what signal stopped the run early, if one did, and of the `steps_planned`)."""
    steady = sorted(untraced) or sorted(r["step_s"] for r in records)
    median_tokens_per_s = tokens_per_step / steady[len(steady) // 2]
    summary: dict[str, Any] = {
        "steps": len(records),
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "final_val_loss": records[-1].get("val_loss"),
        "final_val_perplexity": math.exp(records[-1]["val_loss"]) if records[-1].get("val_loss") is not None else None,
        "wall_s": wall,
        "median_step_s": steady[len(steady) // 2],
        "tokens_per_s": tokens_per_step / steady[len(steady) // 2],
        "peak_mem_bytes": max((r["peak_mem_bytes"] for r in records if r["peak_mem_bytes"]),
                              key=max, default=None),
        "out_dir": str(out_dir),
        "metrics": str(out_dir / "metrics.jsonl"),
    }
    reserved = [r["peak_reserved_bytes"] for r in records if r.get("peak_reserved_bytes")]
    if reserved:
        summary["peak_reserved_bytes"] = max(reserved, key=max)
    if flops is not None:  # utilisation at the median step, and what it is counted against
        summary.update(flops.rates(median_tokens_per_s, world), **flops.as_dict())
    if stopped_by:
        summary.update(stopped_by=stopped_by, steps_planned=steps_planned)
    if plot_title is not None:
        summary["plot"] = str(plot_loss(records, out_dir / "loss.png", plot_title))
    if sample is not None:
        (out_dir / "samples.txt").write_text(sample + "\n")
        summary["sample"] = sample
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
