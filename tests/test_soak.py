"""A short run of scripts/soak.py in CI: a real server with faults injected into its transfers and
two tenants, a seeded mix of good, bad, hostile (grammar bombs, dead ends, fan-out, slow bodies),
cancelled and stalled requests from one while the other measures its time to first token, and its
verdict (no canary crossed, no hang, no 5xx on bad input, no integrity violation, no stall of the
quiet tenant, pages at baseline, still ready). The 10,000-request run is measured
once and written down in docs/benchmarks.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_short_soak_keeps_every_promise(default_model_path: Path, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts/soak.py"), "--requests", "60", "--concurrency", "8", "--seed", "3",
         "--log", str(tmp_path / "server.log"), f"--server-arg=--model={default_model_path}"],
        capture_output=True, text=True, timeout=600)
    verdict = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{(tmp_path / 'server.log').read_text()[-4000:]}"
    assert verdict.startswith("verdict: 0 problems (0 hangs, 0 canary leaks, 0 of the quiet tenant, 0 integrity "
                              "violations), pages at baseline, ready 200"), verdict
    assert "requests: 60 " in run.stdout
