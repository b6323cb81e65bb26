"""train.deterministic: every layout of dp, ZeRO and pp bit-identical to one process (docs/deterministic.md).

mode.py the process-wide switch and what it pins · tree.py micro-batch gradients summed in the
canonical tree (a pipeline stage's: pipeline/tree_grads.py) ·
exact.py sums exact in any order (the gradient norm) · checks.py what the mode refuses before launch.
"""
