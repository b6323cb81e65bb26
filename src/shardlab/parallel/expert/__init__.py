"""Expert parallelism (MoE): experts spread over an ep group, tokens moved by all-to-all.

layer.py     ExpertParallelMoE, convert_expert_parallel: route, dispatch, local experts, combine
alltoall.py  the differentiable uneven all-to-all and its byte counts
data_parallel.py  ExpertDataParallel: dense gradients over dp x ep x cp, experts' over dp x cp / ep
zero.py      ZeRO-1/2 under ep: each kind sharded over its own replicas, one optimizer over both
rows.py      under context parallelism: routing over whole rows (counts and probabilities summed over cp)
docs/expert-parallel.md describes the design.
"""

from shardlab.parallel.expert.alltoall import A2AStats, all_to_all_rows
from shardlab.parallel.expert.data_parallel import ExpertDataParallel
from shardlab.parallel.expert.layer import (
    ExpertParallelMoE,
    comm_stats,
    convert_expert_parallel,
    expert_layers,
    expert_parameters,
)

__all__ = ["A2AStats", "ExpertDataParallel", "ExpertParallelMoE", "all_to_all_rows", "comm_stats",
           "convert_expert_parallel", "expert_layers", "expert_parameters"]
