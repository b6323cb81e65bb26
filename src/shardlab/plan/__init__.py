"""Planning: what the machine is (topo), what its collectives cost (alphabeta), and the planner that
predicts a layout's memory and step time before it runs (models, hardware, layout, activations,
memory_model, op_costs, comm, steptime, search, report; validate checks it against published and measured runs).

Names are loaded on first use: the planner itself needs no torch, and `shardlab plan` should not
pay for importing it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AlphaBeta": "alphabeta", "fit": "alphabeta", "fit_rows": "alphabeta", "load_fits": "alphabeta",
    "model_for": "alphabeta", "save_fits": "alphabeta",
    "discover": "topo", "format_topology": "topo", "parse_nvidia_smi_topo": "topo_parse",
    "ModelSpec": "models", "get_model": "models", "spec_from_config": "models",
    "Hardware": "hardware", "get_hardware": "hardware",
    "Execution": "execution", "LayoutError": "execution",
    "rank_memory": "memory_model", "step_time": "steptime", "search": "search", "evaluate": "search",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardlab.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(f"shardlab.plan.{module}"), name)
