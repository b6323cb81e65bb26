"""The command line answers --help without loading what its commands run (cli/main.py says why): no
torch, checked in a fresh interpreter, for `shardlab --help` and every `shardlab COMMAND --help`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

PROBE = """
import contextlib, io, json, sys
from shardlab.cli.main import COMMANDS, main

seen = {}
for argv in [["--help"], *([name, "--help"] for name in COMMANDS), ["bench", "train", "--help"], ["viz", "measure", "--help"]]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main(argv)
        except SystemExit:
            pass
    seen[" ".join(argv)] = [len(out.getvalue()), sorted(m for m in ("torch", "numpy") if m in sys.modules)]
print(json.dumps(seen))
"""


def test_help_loads_no_torch():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert len(seen) >= 14
    for argv, (printed, loaded) in seen.items():
        assert printed > 200, f"shardlab {argv} printed {printed} characters"
        assert "torch" not in loaded, f"shardlab {argv} imported torch"
