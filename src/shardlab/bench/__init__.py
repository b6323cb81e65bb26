"""Measurements: collective bandwidth against message size (comm), and the machine's ceilings.

    from shardlab.bench import CommBenchConfig, run_comm_bench
    result = run_comm_bench(CommBenchConfig(ops=["all_reduce"], impls=["torch", "ring"], world_sizes=[2, 4]))
    result["rows"][0]["busbw_gbps"]

The CLI is `shardlab bench comm`; docs/bench-comm.md explains what is measured and how.
"""

from shardlab.bench.cases import count_wrong
from shardlab.bench.comm import run_comm_bench
from shardlab.bench.sweep import OPS, CommBenchConfig, busbw_factor, parse_sizes, plan_points

__all__ = [
    "OPS",
    "CommBenchConfig",
    "busbw_factor",
    "count_wrong",
    "parse_sizes",
    "plan_points",
    "run_comm_bench",
]
