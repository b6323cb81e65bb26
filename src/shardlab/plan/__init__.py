"""Planning inputs: what the machine is (topo) and what its collectives cost (alphabeta)."""

from shardlab.plan.alphabeta import AlphaBeta, fit, fit_rows, load_fits, model_for, save_fits
from shardlab.plan.topo import discover, format_topology
from shardlab.plan.topo_parse import parse_nvidia_smi_topo

__all__ = [
    "AlphaBeta",
    "discover",
    "fit",
    "fit_rows",
    "format_topology",
    "load_fits",
    "model_for",
    "parse_nvidia_smi_topo",
    "save_fits",
]
