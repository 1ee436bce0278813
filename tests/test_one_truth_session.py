"""A framework save (the integrations' IntegrationRun) never replaces a certified step's row or folder, unless the
operator names the step in SCOUT_CKPT_REPLACE_CERTIFIED; bad use of that variable is one line.

Real SQLite ledgers, real folders and manifests written through the integrations' own commit protocol (one
process, no process group: IntegrationRun's single-rank path), a real subprocess for the one-line error.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scout_ckpt import policy
from scout_ckpt.errors import BadInput, CertifiedStep
from scout_ckpt.integrations.session import REPLACE_ENV, IntegrationRun, replace_certified_steps
from scout_ckpt.ledger import Ledger
from tests.conftest import REPO, run_cli


def _run(root) -> IntegrationRun:
    run = IntegrationRun(root, framework="test")
    run.start(topology={}, policy=policy.BYTES_ONLY, versions={})
    return run


def _save(run: IntegrationRun, step: int, payload: bytes) -> dict:
    """One framework save: the `writing` row, the framework's own file, the hash and the commit."""
    name = f"checkpoint-{step}"
    attempt = run.begin_save(step, name)
    folder = run.root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.bin").write_bytes(payload)
    files, listing = run.hash_share(folder)
    return run.commit(step, attempt, folder, files, listing, {}, run_policy=policy.BYTES_ONLY, topology={}, versions={})


def _tree(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def certified(tmp_path):
    """ROOT with checkpoint-5 certified by a first framework run (closed)."""
    root = tmp_path / "out"
    run = _run(root)
    assert _save(run, 5, b"first run's weights")["state"] == "certified"
    run.close()
    return root


def test_a_framework_save_of_a_certified_step_is_refused_and_leaves_row_and_folder(certified, monkeypatch):
    monkeypatch.delenv(REPLACE_ENV, raising=False)
    root = certified
    with Ledger.open(root, readonly=True) as led:
        before_row = led.checkpoint(5)
    before = {k: v for k, v in _tree(root).items() if k.startswith("checkpoint-")}
    run = _run(root)
    with pytest.raises(CertifiedStep, match=f"step 5 is certified.*{REPLACE_ENV}=5"):
        run.begin_save(5, "checkpoint-5")
    run.close()
    assert {k: v for k, v in _tree(root).items() if k.startswith("checkpoint-")} == before
    with Ledger.open(root, readonly=True) as led:
        row = led.checkpoint(5)
        refused = [h for h in led.certifications(5, all_outcomes=True) if h["outcome"] == "refused"]
    assert (row["state"], row["attempt"], row["manifest_digest"]) == (
        "certified",
        before_row["attempt"],
        before_row["manifest_digest"],
    )
    assert len(refused) == 1


def test_a_framework_save_of_a_quarantined_step_is_saved_anew_with_the_quarantined_bytes_kept(certified, monkeypatch):
    """A run resumed before a quarantined step reaches it again: refusing the save would stop every restart there.
    The quarantined folder is kept aside, byte for byte (the quarantine command set it aside already: the newest
    `checkpoint-N` must not be the Trainer's own resume), the new attempt is saved and judged on its own, and the
    quarantine stays in the step's history."""
    monkeypatch.delenv(REPLACE_ENV, raising=False)  # no override: a quarantine is never a certified step
    run_cli("quarantine", certified, "5", "--reason", "suspect node", check_rc=0)
    (aside,) = [p for p in certified.iterdir() if p.name.startswith("checkpoint-5.scout-quarantined-")]
    run = _run(certified)
    assert _save(run, 5, b"second lineage's weights")["state"] == "certified"
    run.close()
    assert (aside / "model.bin").read_bytes() == b"first run's weights"
    assert (certified / "checkpoint-5" / "model.bin").read_bytes() == b"second lineage's weights"
    with Ledger.open(certified, readonly=True) as led:
        row, states = led.checkpoint(5), [h["state"] for h in led.certifications(5)]
    assert (row["state"], row["path"]) == ("certified", "checkpoint-5")
    assert states.index("quarantined") < len(states) - 1 and states[-1] == "certified"


def test_the_operator_names_the_step_and_the_save_replaces_it_with_its_history_kept(certified, monkeypatch):
    monkeypatch.setenv(REPLACE_ENV, "7, 5")
    with Ledger.open(certified, readonly=True) as led:
        old_attempt = led.checkpoint(5)["attempt"]
    run = _run(certified)
    assert _save(run, 5, b"second run's weights")["state"] == "certified"
    run.close()
    assert (certified / "checkpoint-5" / "model.bin").read_bytes() == b"second run's weights"
    with Ledger.open(certified, readonly=True) as led:
        row = led.checkpoint(5)
        attempts = {h["attempt"] for h in led.certifications(5) if h["state"] == "certified"}
        events = [e for e in led.events() if e["kind"] == "certified_replaced"]
    assert row["attempt"] != old_attempt and attempts == {old_attempt, row["attempt"]}
    assert [(e["step"], e["detail"]["attempt"], e["detail"]["by"]) for e in events] == [
        (5, old_attempt, f"{REPLACE_ENV}=5")
    ]


@pytest.mark.parametrize("value", ["ten", "5;6", "-3", "5.0"])
def test_a_malformed_override_is_bad_input(value):
    with pytest.raises(BadInput, match=REPLACE_ENV):
        replace_certified_steps(value)


def test_an_empty_override_names_no_step():
    assert replace_certified_steps("") == replace_certified_steps(None) == frozenset()
    assert replace_certified_steps("10,20,") == frozenset({10, 20})


def test_a_job_with_a_malformed_override_ends_with_one_line_before_anything_is_written(tmp_path):
    """A job script that builds its framework run with SCOUT_CKPT_REPLACE_CERTIFIED=ten: one line on stderr, no
    traceback, a non-zero exit, and ROOT left as it was (not even created)."""
    root = tmp_path / "out"
    script = (
        "from scout_ckpt.integrations.session import IntegrationRun\n"
        f"IntegrationRun({json.dumps(str(root))}, framework='test')\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), REPLACE_ENV: "ten", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("scout-ckpt: BadInput:") and REPLACE_ENV in lines[0], p.stderr
    assert not root.exists()


# ---- the walk-back's local candidate after an elastic restart ---------------------------------------------------


def test_the_local_candidate_passes_over_rows_of_another_layout_and_finds_older_ones_of_this_one(tmp_path):
    """The suspected case: `local_restore.candidate` stopped at the newest certified local row whose layout
    differs (saved by a 3-rank job), hiding the older rows this 2-rank job can restore. Real ledger rows as the
    local tier records them; the decision is taken for a job of the 2-rank layout: step 6 (the newest of its
    layout), then step 4 once step 6 is quarantined as a step (its durable row), never step 8."""
    from types import SimpleNamespace

    from scout_ckpt.save import local_restore
    from scout_ckpt.save import local_tier_rows as rows

    two, three = {"world": 2, "mode": "ddp"}, {"world": 3, "mode": "ddp"}
    with Ledger.open(tmp_path, create=True) as led:
        led.begin_run("r1", world_size=2, topology={}, policy=policy.BYTES_ONLY)
        for step, lay in ((2, two), (4, two), (6, two), (8, three)):
            rows.record(
                led,
                step=step,
                run_id="r1",
                state="certified",
                dir=f"r1/step-{step:08d}",
                world_size=lay["world"],
                layout=lay,
                files=[],
                copies=[],
                evidence={},
                signatures={},
                reasons=[],
            )
        tier = SimpleNamespace(ck=SimpleNamespace(ledger=led), layout=two, layout_told=False)
        assert local_restore.candidate(tier, None)["step"] == 6
        assert tier.layout_told  # the passed-over row of the other layout is said once
        assert local_restore.candidate(tier, 6)["step"] == 4
    run_cli("quarantine", tmp_path, "6", "--reason", "suspect node", check_rc=0)
    with Ledger.open(tmp_path) as led:
        tier = SimpleNamespace(ck=SimpleNamespace(ledger=led), layout=two, layout_told=True)
        assert local_restore.candidate(tier, None)["step"] == 4
