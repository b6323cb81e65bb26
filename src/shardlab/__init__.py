"""shardlab: distributed training for PyTorch from the collective primitives up.

Layers (imports only point down): cli > bench > train > plan > checkpoint > parallel > models > comm > dist > data.
See docs/ARCHITECTURE.md; tests/test_import_graph.py checks it.
"""

__version__ = "0.1.0"
