"""shardlab: distributed training for PyTorch from the collective primitives up.

Layers (imports only point down): cli -> bench / plan -> comm -> dist. See docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
