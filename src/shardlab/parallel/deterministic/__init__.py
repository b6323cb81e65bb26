"""train.deterministic: every layout of dp, ZeRO and pp bit-identical to one process (docs/deterministic.md).

mode.py the process-wide switch and what it pins · tree.py micro-batch gradients summed in the
canonical tree · stage.py a pipeline stage's per-micro-batch gradients, tied copies included ·
exact.py sums exact in any order (the gradient norm) · checks.py what the mode refuses before launch.
"""
