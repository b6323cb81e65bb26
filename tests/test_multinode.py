"""Two nodes on one machine: two `torchrun` agents (--nnodes 2, 2 processes each, c10d rendezvous on
127.0.0.1) train a dp 2 x tp 2 GPT as one job of 4 ranks, the mesh told of its 2 nodes. Both agents
exit 0, every step is logged and text is sampled, the losses are finite and fall, and the first loss is one process's on the same global batch
(the weights are the same seed's, the rows the same sampler's: only the layout differs)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from shardlab.train.config import load_config
from shardlab.train.resolve import resolve_run

TINY = ['model.name="gpt"', "model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.seq_len=16",
        "data.max_bytes=200000", "train.steps=4", "train.warmup_steps=1", "train.global_batch=8",
        "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "log.sample_tokens=20",
        "log.tensorboard=false", "log.plot=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_dp2_x_tp2(tmp_path: Path) -> None:
    port = _free_port()
    sets = [a for s in TINY + [f"log.out_dir={json.dumps(str(tmp_path))}"] for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shardlab-two-nodes",
         "-m", "shardlab", "train", "--dp", "2", "--tp", "2", "--nodes", "2", *sets],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=110)
            outputs.append((agent.returncode, out, err))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for code, out, err in outputs:
        assert code == 0, out[-2000:] + err[-3000:]
    stdout = "".join(out for _, out, _ in outputs)
    # Rank 0 (on whichever agent the rendezvous made node 0) printed the mesh with its nodes.
    assert "dp 2" in stdout and "on 2 nodes" in stdout and "| node 1" in stdout
    # The whole run under torchrun, as a user sees it: every step logged, then sampled text.
    assert "step 4/4" in stdout and "sampled text" in stdout
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]

    # One process, the same model and global batch: the first loss before any update.
    cfg = load_config(None, TINY)
    model = resolve_run(cfg).build_model()
    x, y = resolve_run(cfg).build_task(model).batch(0, 0, 1)
    with torch.no_grad():
        reference = model(x, y).item()
    assert abs(losses[0] - reference) <= 1e-5 * abs(reference), (losses[0], reference)
