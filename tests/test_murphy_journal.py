"""A trust-lowering verdict is durable before it takes effect (#25 item 5), and a failure to record it is the same
error on every rank, never a coordinator that raises while the others wait in its next broadcast.

Real DCP files of a 3-rank run (the `ckpt_root` fixture: certified steps 3 and 4), real SQLite, real processes:
the load mismatch is made as in test_checkpointer (a recorded signature that no longer matches what DCP loads,
with the ledger's manifest digest updated so the bytes still verify); the journal is made unwritable by a
directory in its place (EISDIR, as a read-only or broken mount gives); the ledger is made unwritable by another
process holding its write lock."""

from __future__ import annotations

import json
import shutil
import sqlite3

from scout_ckpt.format.digests import bytes_digest
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.testing.launch import run_ranks
from tests import workers_ckpt as w
from tests.conftest import ledger_write_lock, run_cli


def _make_step_4_load_wrongly(root) -> str:
    mpath = root / "step-00000004" / "scout-manifest.json"
    m = json.loads(mpath.read_text())
    key = next(k for k in m["signatures"] if k.endswith("exp_avg"))
    sig = m["signatures"][key]
    m["signatures"][key] = sig[:-4] + ("0000" if not sig.endswith("0000") else "1111")
    mpath.write_text(json.dumps(m))
    c = sqlite3.connect(root / "scout-ledger.db")
    c.execute("UPDATE checkpoints SET manifest_digest=? WHERE step=4", (bytes_digest(mpath.read_bytes()),))
    c.commit()
    c.close()
    return key


def _rejections_of_4(root) -> list[dict]:
    return [r for r in journal.read(root) if r["step"] == 4 and r.get("state") == "rejected"]


def test_a_rejection_the_journal_cannot_take_is_the_same_error_on_every_rank_and_changes_nothing(ckpt_root):
    _make_step_4_load_wrongly(ckpt_root)
    jpath = journal.path(ckpt_root)
    records = jpath.read_bytes()
    jpath.unlink()
    jpath.mkdir()
    out = run_ranks(w.load_into, 3, str(ckpt_root), True, timeout=90, allow_failures=True)
    errors = [o.error or "" for o in out]
    assert all(
        "could not record that checkpoint 4 failed verification" in e and "nothing was loaded" in e for e in errors
    ), errors  # every rank, none left in a collective until the timeout
    assert all("ScoutError" in e for e in errors), errors
    with Ledger.open(ckpt_root, readonly=True) as led:
        assert led.checkpoint(4)["state"] == "certified"  # not rejected without its journal record
        assert led.events(("load_mismatch",)) == []
    jpath.rmdir()
    jpath.write_bytes(records)
    out = run_ranks(w.load_into, 3, str(ckpt_root), True, timeout=90)
    assert all(o.result == {"step": 3, "error": None} for o in out)
    with Ledger.open(ckpt_root, readonly=True) as led:
        assert led.checkpoint(4)["state"] == "rejected"
    assert [r["reasons"][0]["code"] for r in _rejections_of_4(ckpt_root)] == ["load_mismatch"]


def test_a_rejection_is_in_the_journal_before_the_ledger_takes_it(ckpt_root, tmp_path):
    """The ledger refuses the write (another process holds its lock past the busy timeout) after the journal took
    the rejection: the ledger still says certified, but once that ledger is lost, neither `resume` (from the
    manifests and the journal) nor `ledger rebuild` hands out step 4."""
    import pytest

    from scout_ckpt.errors import LedgerError
    from scout_ckpt.save.loading import LatestCleanLoader

    key = _make_step_4_load_wrongly(ckpt_root)
    led = Ledger.open(ckpt_root, busy_timeout=0.5)
    loader = LatestCleanLoader(ckpt_root, 0, 1, None, led, led.run()["id"], True, lambda point, s: None)
    with ledger_write_lock(ckpt_root / "scout-ledger.db", 30):
        with pytest.raises(LedgerError):
            loader._reject_load_mismatch({"step": 4}, [key])
    assert led.checkpoint(4)["state"] == "certified"
    led.close()
    assert [r["reasons"][0]["code"] for r in _rejections_of_4(ckpt_root)] == ["load_mismatch"]
    lost = tmp_path / "lost"
    shutil.copytree(ckpt_root, lost)
    (lost / "scout-ledger.db").unlink()
    rc, out, err = run_cli("resume", lost, "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 3, (out, err)
    rc, out, err = run_cli("ledger", "rebuild", lost, "--json")
    assert rc == 0, err
    rows = {r["step"]: r for r in json.loads(out)["checkpoints"]}
    assert (rows[3]["state"], rows[4]["state"]) == ("certified", "rejected"), rows
    assert rows[4]["reasons"][0]["code"] == "load_mismatch"


def test_a_metadata_swapped_after_verification_is_never_unpickled_and_the_load_walks_back(ckpt_root, tmp_path):
    """#25 item 3. Right after step 4's files pass their byte verification, its `.metadata` is replaced by a
    pickle that runs code (it creates a file). The loader must not unpickle it: step 4 is rejected
    (digest_mismatch of .metadata), every rank walks back to step 3 in the same call, and the weights loaded are
    step 3's as plain DCP reads them from its files."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from tests import workers_murphy

    marker = tmp_path / "the-pickle-ran"
    step4 = ckpt_root / "step-00000004"
    out = run_ranks(
        workers_murphy.swap_metadata_after_verification, 3, str(ckpt_root), str(step4), str(marker), timeout=120
    )
    assert not marker.exists()
    assert [o.result["step"] for o in out] == [3, 3, 3]
    with Ledger.open(ckpt_root, readonly=True) as led:
        row = led.checkpoint(4)
    assert row["state"] == "rejected" and row["reasons"][0]["file"] == ".metadata", row
    model = w.make_model(seed=11)
    sd = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(sd, checkpoint_id=str(ckpt_root / "step-00000003"))
    assert all(torch.equal(torch.tensor(o.result["weight"]), sd["model"]["0.weight"]) for o in out)


def test_a_flip_in_a_frozen_fsdp2_shard_is_caught_at_the_next_save_whenever_it_happened(tmp_path):
    """#25 item 1. FSDP2 on 2 ranks, a frozen (requires_grad=False) weight in a sharded block, the Checkpointer's
    defaults. Healthy: both saves certified. One low mantissa bit of rank 1's local shard of the frozen weight
    flipped after step 4 (between the saves of 3 and 6, not right before one): the save of 6 is rejected
    `at_rest_changed` naming rank 1 and the frozen tensor, and it raises LiveStateCorrupt on every rank."""
    from tests import workers_murphy

    healthy = run_ranks(workers_murphy.fsdp2_frozen_weight, 2, str(tmp_path / "healthy"), timeout=240)
    assert all({s: v["state"] for s, v in o.result.items()} == {3: "certified", 6: "certified"} for o in healthy), [
        o.result for o in healthy
    ]
    out = run_ranks(workers_murphy.fsdp2_frozen_weight, 2, str(tmp_path / "flip"), 4, timeout=240)
    for o in out:
        assert o.result[3]["state"] == "certified" and o.result[6]["state"] == "rejected", o.result
        assert o.result[6]["raised"]
        why = [r for r in o.result[6]["reasons"] if r.get("code") == "at_rest_changed"]
        assert why and why[0]["ranks"] == [1] and why[0]["tensors"] == ["blocks.0.fc1.weight (frozen)"], o.result


def test_a_run_that_diverged_on_every_rank_is_a_divergence_not_sdc_on_every_rank(tmp_path):
    """#26 labels: NaN/Inf everywhere (the optimizer blew the weights up on every rank alike) is the training's
    numerics: one `divergence` event naming every rank, no `sdc` event blaming ranks 0 and 1."""
    from tests import workers_murphy

    out = run_ranks(workers_murphy.diverge_everywhere, 2, str(tmp_path / "run"), timeout=120)
    assert [o.result["state"] for o in out] == ["rejected", "rejected"]
    with Ledger.open(tmp_path / "run", readonly=True) as led:
        kinds = [(e["kind"], e["ranks"]) for e in led.events() if e["kind"] in ("sdc", "divergence")]
    assert kinds == [("divergence", [0, 1])], kinds
    rc, out, _ = run_cli("report", tmp_path / "run", "--json")
    assert [e["kind"] for e in json.loads(out)["events"] if e["kind"] in ("sdc", "divergence")] == ["divergence"]
