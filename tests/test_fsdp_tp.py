"""The core Checkpointer on FSDP x TP (a 2x2 DeviceMesh), where FSDP shards a dim TP already shards and DTensor
gives `_StridedShard` placements: saves certify, the strided tensors are listed as vouched for by their bytes at
load (`load_check_unsigned`), and a fresh Checkpointer loads exactly what the job held when it saved (the job's own
sha256 of every full tensor, not scout-ckpt's verifier). Before, every save of such a model raised in the
full-tensor signatures."""

from __future__ import annotations

import json
import subprocess
import sys

from scout_ckpt.testing.launch import run_ranks
from tests.workers_fsdp_tp import fsdp_tp_save_then_load


def test_fsdp_x_tp_saves_certify_and_load_exactly(tmp_path):
    root = tmp_path / "run"
    out = run_ranks(fsdp_tp_save_then_load, 4, str(root), timeout=300)
    res = [o.result for o in out]
    assert "_StridedShard" in res[0]["placements"]
    for r in res:
        assert r["loaded_step"] == 2
        assert r["loaded"] == r["saved"][2] != r["saved"][1]
    ls = subprocess.run(
        [sys.executable, "-m", "scout_ckpt.cli", "ls", str(root), "--json"], capture_output=True, text=True, timeout=120
    )
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)["checkpoints"]  # docs/operations.md: `ls --json` is {"checkpoints": [...]}
    assert [(r["step"], r["state"]) for r in rows] == [(1, "certified"), (2, "certified")]
    m = json.loads((root / "step-00000002" / "scout-manifest.json").read_text())
    unsigned = m["evidence"]["bytes"]["load_check_unsigned"]
    assert "app.model.0.weight" in unsigned and "app.model.2.weight" not in unsigned
    assert "app.model.2.weight" in m["signatures"]
