"""Pipeline parallelism: a plain model split by depth, schedules as data, a checker, an executor.

    from shardlab.parallel.pipeline import (PipelineExecutor, build_stage, check, gather_parameters,
                                            plan_split, schedule)
    plan = plan_split(model, stages=P, virtual=V)              # which pieces go on which chunk
    stage = build_stage(model, plan, rank=pp_rank)             # this rank's chunks, original names
    actions = schedule("1f1b", stages=P, microbatches=M)       # every rank's action list
    runner = PipelineExecutor(stage, actions, pp_group)        # checks the schedule before any send
    opt = torch.optim.AdamW(stage.parameters())
    loss = runner.run(x, y, on_step=lambda: (opt.step(), opt.zero_grad())).loss

Files: actions.py (the vocabulary), schedules.py (naive, GPipe, 1F1B, interleaved, and the sends and
receives each implies), zero_bubble.py (ZB-H1), simulation.py (simulation: deadlock proof and timing;
deadlock.py its errors and the chain of waits that explains one),
partition.py and stages.py (the split), splitgrad.py (backward split into BI and BW), executor.py,
params.py (tied copies, gathering by original name), headers.py (validation mode: the step's
messages agreed before any is posted), model.py (a stage packaged for the trainer:
PipelineParallel, its forward-only pass and StageOptimizer), (parallel/parallelize.py's
parallelize_stage cuts the stage after tp, ep and cp, the split planned on the plain model; tp x pp), timeline.py (traces; the charts are bench/pipeline_gantt.py and the
measurement of real runs bench/pipeline_measure.py). See docs/pipeline.md.
"""

from shardlab._lazy import lazy_names

_EXPORTS = {name: module for module, names in {
    "shardlab.parallel.pipeline.actions": ("Action", "Schedule", "fmt"),
    "shardlab.parallel.pipeline.simulation": ("ScheduleError", "Simulation", "check", "simulate"),
    "shardlab.parallel.pipeline.executor": ("PipelineExecutor", "PipelineResult"),
    "shardlab.parallel.pipeline.model": ("PipelineParallel", "StageOptimizer", "forward_only"),
    "shardlab.parallel.pipeline.params": ("clip_grad_norm_", "gather_gradients", "gather_parameters",
                                          "stage_placement", "sum_tied_grads"),
    "shardlab.parallel.pipeline.schedules": ("KINDS", "bubble_theory", "chunk_owner", "compute_order",
                                             "in_flight_theory", "schedule", "with_comms"),
    "shardlab.parallel.pipeline.stages": ("PipelineStage", "SplitPlan", "build_stage", "plan_split", "split_model"),
    "shardlab.parallel.pipeline.timeline": ("Event", "Timeline"),
}.items() for name in names}
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

__all__ = [
    "KINDS",
    "Action",
    "Event",
    "PipelineExecutor",
    "PipelineParallel",
    "PipelineResult",
    "PipelineStage",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "SplitPlan",
    "StageOptimizer",
    "Timeline",
    "build_stage",
    "bubble_theory",
    "check",
    "chunk_owner",
    "clip_grad_norm_",
    "compute_order",
    "fmt",
    "forward_only",
    "gather_gradients",
    "gather_parameters",
    "in_flight_theory",
    "plan_split",
    "schedule",
    "simulate",
    "split_model",
    "stage_placement",
    "sum_tied_grads",
    "with_comms",
]
