"""One truth per step: a verdict reaches every copy, in every tier, and a save never outruns one.

Real gloo ranks (scout_ckpt.testing.launch.run_ranks), real SQLite ledgers and journals, real CLI subprocesses;
faults placed by real means (a NaN written into a weight, a slow commit thread, a deleted ledger file).
"""

from __future__ import annotations

import json

from scout_ckpt.testing.launch import run_ranks
from tests import workers_one_truth as w
from tests.conftest import run_cli


def _ls(root) -> dict:
    rc, out, err = run_cli("ls", root, "--json")
    assert rc == 0, err
    return {r["step"]: r for r in json.loads(out)["checkpoints"] if r.get("tier", "durable") == "durable"}


# ---- a save never outruns a verdict it could depend on ---------------------------------------------------------

def test_a_durable_save_waits_for_the_local_verdict_it_descends_from(tmp_path):
    """Step 2's local save holds a NaN and its commit thread is slowed by 2 s; the NaN is gone again before the
    durable save of step 3, which descends from it. The durable save sees the local verdict first: step 3 is
    rejected for `lineage_tainted`, never certified."""
    root, local_dir = tmp_path / "run", tmp_path / "local"
    out = run_ranks(w.local_verdict_races_durable_save, 2, str(root), str(local_dir), timeout=180)
    r = out[0].result
    assert r["local"] and r["local"]["state"] == "rejected", r
    assert r["durable"]["state"] == "rejected"
    assert "lineage_tainted" in {x["code"] for x in r["durable"]["reasons"]}
    row = _ls(root)[3]
    assert row["state"] == "rejected"
