"""Measurements: collective bandwidth against message size (comm), and the machine's ceilings.

    from shardlab.bench import CommBenchConfig, run_comm_bench
    result = run_comm_bench(CommBenchConfig(ops=["all_reduce"], impls=["torch", "ring"], world_sizes=[2, 4]))
    result["rows"][0]["busbw_gbps"]

The CLI is `shardlab bench comm`; docs/bench-comm.md explains what is measured and how.
"""

from shardlab._lazy import lazy_names

_EXPORTS = {name: module for module, names in {
    "shardlab.bench.cases": ("count_wrong",),
    "shardlab.bench.comm": ("run_comm_bench",),
    "shardlab.bench.sizes": ("OPS", "parse_sizes"),
    "shardlab.bench.sweep": ("CommBenchConfig", "busbw_factor", "plan_points"),
}.items() for name in names}
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

__all__ = [
    "OPS",
    "CommBenchConfig",
    "busbw_factor",
    "count_wrong",
    "parse_sizes",
    "plan_points",
    "run_comm_bench",
]
