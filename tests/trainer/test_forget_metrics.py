"""resume() rewrites metrics.jsonl without the lines of the steps it redoes.  A trainer that
crashed because its volume was full restarts on the same full volume: the rewrite, done in place,
truncated the file and then failed, and the run's whole metrics history was gone.  It is now
written beside and renamed over the old one, which a failed write leaves whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mixrl.rl.trainer.main import METRICS

REWRITE_UNDER_A_SIZE_LIMIT = """
import resource, signal, sys, types
from pathlib import Path
from mixrl.rl.trainer.main import TrainerLoop
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
try:
    TrainerLoop.forget_metrics_after(types.SimpleNamespace(run_dir=Path(sys.argv[1])), 150)
except OSError as exc:
    print(exc.errno)
"""


def test_a_rewrite_that_fails_leaves_the_metrics_as_they_were(tmp_path: Path) -> None:
    lines = [
        json.dumps({"step": step, "loss": 0.1 * step, "pad": "x" * 200}) + "\n" for step in range(1, 201)
    ]
    metrics = tmp_path / METRICS
    metrics.write_text("".join(lines))
    limit = len("".join(lines[:50]))  # the volume fills up a third of the way into the rewrite
    done = subprocess.run(
        [sys.executable, "-c", REWRITE_UNDER_A_SIZE_LIMIT, str(tmp_path), str(limit)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "27"  # EFBIG: the write did fail
    assert metrics.read_text() == "".join(lines)
