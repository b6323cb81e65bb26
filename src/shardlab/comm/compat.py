"""torch 2.13 renamed the tensor forms of two collectives; these names work on older releases too."""

import torch.distributed as dist

all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
