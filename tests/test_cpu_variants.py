"""benchmarks/cpu_variants.sh (docs/reliability.md, "Portable numerics"), held without running its
variants (10-30 minutes each): it parses, runs test files that exist, and refuses an unknown variant."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "cpu_variants.sh"


def test_script_lists_existing_files_and_refuses_unknown_variants():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    files = subprocess.run(["bash", str(SCRIPT), "--files"], capture_output=True, text=True, check=True).stdout.split()
    assert len(files) > 20 and all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]
    assert "tests/test_verify_noise.py" in files
    bad = subprocess.run(["bash", str(SCRIPT), "avx512"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown variant avx512" in bad.stderr
