"""examples/slurm/train.sbatch without Slurm: the torchrun command it renders for a fake Slurm
environment (parsed by torchrun's and shardlab's own parsers), its refusal outside a job, the signal
before the time limit passed on to the step and the job requeued, and (make test-long) the script run
for real as a two-node job on this machine, twice: the second start resumes from the first's checkpoint."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
SLURM = {"SLURM_JOB_ID": "1234", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]"}


def _fake_bin(tmp_path: Path, hosts: str = "gpu01 gpu02", srun: str | None = None) -> dict[str, str]:
    """A PATH whose scontrol expands the node list to `hosts` and logs anything else it is asked,
    and, given, a fake srun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        f'if [ "$1 $2" = "show hostnames" ]; then printf "%s\\n" {hosts}; exit 0; fi\n'
        f'echo "scontrol $*" >> {shlex.quote(str(log))}\n')
    if srun is not None:
        (bin_dir / "srun").write_text(srun)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log)}


# The script resolves the layout with `$PYTHON -m shardlab train ... --dry-run`: this interpreter.
PY = {"PYTHON": sys.executable}


def _render(tmp_path, args, **env):
    out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **_fake_bin(tmp_path), **SLURM, **PY, "DRY_RUN": "1", **env})
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout)


def test_the_rendered_command_takes_the_rendezvous_from_slurm(tmp_path):
    from torch.distributed.run import get_args_parser

    cmd = _render(tmp_path, ["--config", "configs/gpt-small.toml", "--dp", "8", "--save-every", "50",
                             "--set", 'log.out_dir="runs/a b"'], SLURM_GPUS_ON_NODE="8")
    assert cmd[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"] and cmd[3] == "torchrun"
    run = get_args_parser().parse_args(cmd[4:])  # torchrun's own parser
    assert (run.nnodes, run.nproc_per_node, run.rdzv_backend) == ("2", "4", "c10d")  # dp 8 over 2 nodes
    assert (run.rdzv_endpoint, run.rdzv_id) == ("gpu01:21234", "1234")  # the first node; port 20000 + id % 20000
    assert run.module and run.training_script == "shardlab"
    args = build_parser().parse_args(run.training_script_args)  # shardlab's
    assert (args.command, args.resume, args.save_on_signal, args.dp) == ("train", "latest", True, 8)
    assert args.save_every == 50 and args.config == "configs/gpt-small.toml"  # the user's flags win
    assert args.overrides == ['log.out_dir="runs/a b"']  # quoting survives
    # NPROC_PER_NODE that makes the world size is taken; the port can be chosen.
    cmd = _render(tmp_path, ["--dp", "4"], NPROC_PER_NODE="2", MASTER_PORT="29600",
                  TORCHRUN="python -m torch.distributed.run")
    assert cmd[3:6] == ["python", "-m", "torch.distributed.run"]
    run = get_args_parser().parse_args(cmd[6:])
    assert (run.nproc_per_node, run.rdzv_endpoint) == ("2", "gpu01:29600")
    assert build_parser().parse_args(run.training_script_args).save_every == 200
    # A long node list: the first host, and no failure from a pipe closed on scontrol (pipefail).
    out = subprocess.run(["bash", str(SCRIPT), "--dp", "2"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **SLURM, **PY, "DRY_RUN": "1",
                              **_fake_bin(tmp_path, hosts=" ".join(f"n{i:05d}" for i in range(20000)))})
    assert out.returncode == 0 and " --rdzv-endpoint n00000:21234 " in out.stdout, out.stderr


def test_ranks_per_node_come_from_the_layout_and_a_misfit_is_refused_before_srun(tmp_path):
    """make run's dp 2 x tp 2 on two nodes starts 2 ranks a node, not the header's 8 GPUs' worth; the
    preview works without Slurm (no SLURM_* variables, no scontrol on the PATH)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(SCRIPT), "--config", "configs/gpt-mesh.toml", "--nodes", "2"],
                         capture_output=True, text=True, timeout=60,
                         env={**env, **PY, "DRY_RUN": "1", "PATH": os.environ["PATH"]})
    assert out.returncode == 0, out.stderr
    assert " --nnodes 2 --nproc-per-node 2 " in out.stdout and out.stdout.startswith("srun ")
    refused = {("--dp", "3", "--set", "train.global_batch=3"): "world size 3 does not split over the job's 2 nodes",
               ("--dp", "4", "--nodes", "4"): "the layout is for 4 nodes (--nodes, layout.nodes) but the job has 2",
               ("--dp", "16"): "8 ranks per node but Slurm gave each node 4 GPU(s)",
               ("--dp", "2", "--set", "train.steps=0"): "the configuration is refused"}
    for args, why in refused.items():
        out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                             env={**os.environ, **_fake_bin(tmp_path), **SLURM, **PY, "SLURM_GPUS_ON_NODE": "4"})
        assert out.returncode == 2 and why in out.stderr, (args, out.stderr)
        assert "srun" not in out.stdout


def test_outside_a_slurm_job_it_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30,
                         env={**env, **_fake_bin(tmp_path)})
    assert out.returncode != 0 and "not inside a Slurm job (SLURM_JOB_ID is unset)" in out.stderr


FAKE_STEP = """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
trap 'echo "step got TERM" >> "$FAKE_LOG"; exit 0' TERM
echo started >> "$FAKE_LOG"
while true; do sleep 0.05; done
"""


@pytest.mark.parametrize("sig,requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_a_signal_stops_the_step_and_usr1_requeues(tmp_path, sig, requeued):
    env = {**os.environ, **_fake_bin(tmp_path, srun=FAKE_STEP), **SLURM, **PY}
    log = Path(env["FAKE_LOG"])
    proc = subprocess.Popen(["bash", str(SCRIPT), "--dp", "2"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # until the fake step has set its trap (at most ~60 s on a loaded machine)
            if log.exists() and "started" in log.read_text():
                break
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    calls = log.read_text()
    assert proc.returncode == 0, err
    assert "step got TERM" in calls  # passed on to the step as SIGTERM: --save-on-signal saves
    assert ("scontrol requeue 1234" in calls) == requeued, calls
    assert f"{sig.name.removeprefix('SIG')}: stopping the ranks" in err


# The fake srun of a two-node job on one machine: the command once per "node", both at once.
TWO_NODES = """#!/bin/bash
shift 2   # --ntasks-per-node=1 --kill-on-bad-exit=1
"$@" > "$FAKE_LOG.node0" 2>&1 & a=$!
"$@" > "$FAKE_LOG.node1" 2>&1 & b=$!
wait $a; ra=$?; wait $b; rb=$?
cat "$FAKE_LOG.node0" "$FAKE_LOG.node1"
exit $(( ra | rb ))
"""


@pytest.mark.long
@pytest.mark.timeout(400)
def test_the_script_runs_a_two_node_job_and_its_restart_resumes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sets = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.seq_len=16", "data.max_bytes=200000",
            "train.warmup_steps=1", "train.global_batch=8", "train.eval_every=0", "train.eval_batches=1",
            "log.sample_tokens=0", "log.tensorboard=false", "log.plot=false", "checkpoint.async_save=false",
            f"log.out_dir={json.dumps(str(tmp_path / 'run'))}"]
    env = {**os.environ, **_fake_bin(tmp_path, hosts="127.0.0.1", srun=TWO_NODES), **SLURM, **PY,
           "NPROC_PER_NODE": "1", "MASTER_PORT": str(port), "SAVE_EVERY": "2", "OMP_NUM_THREADS": "1",
           "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    for steps in (3, 5):  # the second start is the requeued job: --resume latest finds step 3
        out = subprocess.run(["bash", str(SCRIPT), "--dp", "2", "--steps", str(steps),
                              *[a for s in sets for a in ("--set", s)]],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert f"step {steps}/{steps}" in out.stdout
    assert "resumed from" in out.stdout and "step_00000003" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]


# Stand-ins for Slurm on this machine: sbatch runs the script at once with the job's variables (its
# --nodes, else the header's), scontrol names this machine for every node, srun starts the command
# once per node, all at once, as separate local processes.
SBATCH = r"""#!/bin/bash
nodes=; gpus=
while [[ "$1" == --* ]]; do
    case "$1" in --nodes) nodes=$2; shift 2;; --gpus-per-node) gpus=$2; shift 2;; *) shift;; esac
done
script=$1; shift
[[ -n "$nodes" ]] || nodes=$(sed -n 's/^#SBATCH --nodes=//p' "$script")
export SLURM_JOB_ID=4321 SLURM_NNODES=$nodes SLURM_JOB_NODELIST="node[1-$nodes]"
[[ -z "$gpus" ]] || export SLURM_GPUS_ON_NODE=$gpus
exec bash "$script" "$@"
"""
SRUN = r"""#!/bin/bash
shift 2   # --ntasks-per-node=1 --kill-on-bad-exit=1
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node "$@" > "$FAKE_LOG.node$node" 2>&1 & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
cat "$FAKE_LOG".node*
exit $rc
"""


@pytest.mark.timeout(300)
def test_sbatch_runs_make_runs_layout_as_two_nodes_of_two_ranks(tmp_path):
    """`sbatch examples/slurm/train.sbatch --config configs/gpt-mesh.toml --nodes 2`, as README.md
    writes it, end to end on this machine: the script derives 2 ranks a node from dp 2 x tp 2 (the
    header asks for 8 GPUs a node), two torchrun agents meet and train 2 steps over gloo."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(_fake_bin(tmp_path, hosts="127.0.0.1", srun=SRUN))
    (tmp_path / "bin" / "sbatch").write_text(SBATCH)
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    env.update(PY, MASTER_PORT=str(port), OMP_NUM_THREADS="1", TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    tiny = ["model.n_layer=1", "model.d_model=32", "model.n_head=4", "model.seq_len=16", 'data.tokenizer="bytes"',
            "data.max_bytes=100000", "train.global_batch=4", "train.warmup_steps=1", "train.eval_every=0",
            "log.sample_tokens=0", "log.tensorboard=false", "log.plot=false",
            f"log.out_dir={json.dumps(str(tmp_path / 'run'))}"]
    out = subprocess.run(["sbatch", str(SCRIPT), "--config", "configs/gpt-mesh.toml", "--nodes", "2", "--steps", "2",
                          *[a for s in tiny for a in ("--set", s)]],
                         capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 node(s) x 2 rank(s)" in out.stderr and "4 rank(s), dp 2 (overlap) x tp 2 (megatron) on 2 nodes" in out.stdout
    assert "step 2/2" in out.stdout and "model saved:" in out.stdout  # the script's --save-every saves the last step
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
