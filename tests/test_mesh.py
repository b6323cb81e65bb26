"""DeviceMesh: coordinates, lines over one or several axes, and their process groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.dist.mesh import DeviceMesh


def test_lines_over_several_axes():
    mesh = DeviceMesh({"pp": 2, "dp": 2, "ep": 1, "cp": 2, "tp": 2}, world_size=16, rank=13,
                      create_groups=False)
    assert mesh.coords() == {"pp": 1, "dp": 1, "ep": 0, "cp": 0, "tp": 1}
    assert mesh.ranks_along("cp") == [13, 15]
    # Several axes vary together, the first outermost, whatever order they are named in.
    assert mesh.ranks_along(("dp", "cp")) == [9, 11, 13, 15]
    assert mesh.ranks_along(("cp", "dp")) == [9, 11, 13, 15]
    assert mesh.size(("dp", "ep", "cp")) == 4
    with pytest.raises(ValueError, match="distinct axes"):
        mesh.ranks_along(("dp", "dp"))
    with pytest.raises(KeyError, match="no axis 'xp'"):
        mesh.size(("dp", "xp"))



def _combined_task() -> list[float]:
    mesh = DeviceMesh({"dp": 2, "cp": 2, "tp": 1}, combined=[("tp", "cp")])  # its groups end with the task
    me = torch.tensor([float(dist.get_rank())])
    out = [comm.all_reduce(me.clone(), "sum", mesh.group(("cp", "tp"))).item(),
           comm.all_reduce(me.clone(), "sum", mesh.group("dp")).item()]
    try:
        mesh.group(("dp", "cp"))
    except KeyError as exc:
        out.append(float("combined" in str(exc)))
    return out


def test_combined_groups(pools):
    # ranks: dp outer, cp inner -> cp lines {0,1},{2,3}; dp lines {0,2},{1,3}
    assert pools(4).run(_combined_task) == [[1, 2, 1], [1, 4, 1], [5, 2, 1], [5, 4, 1]]
