"""Real PyTorch Lightning (Trainer, DDPStrategy, ModelCheckpoint) under real torchrun (2 and 3 CPU/gloo ranks) with
scout_ckpt.integrations.lightning. The job is tests/scripts/lightning_job.py; every judgement comes from what the
job recorded itself (per-step loss, LR and sample fingerprints, sha256 of the model and optimizer state at each save
and at the end) or from a run of the same job without scout-ckpt, never from scout-ckpt's own answers alone.

Data position: Lightning resumes mid-epoch exactly only with a resumable dataloader (its own warning says so), so
the kill tests resume from a checkpoint at an epoch end (4 batches per rank per epoch, accumulate_grad_batches=2:
2 optimizer steps per epoch, a save every 2 steps)."""

import json
import os
import subprocess
import sys

# `make test` installs this extra (the Makefile's integration pins): imported unconditionally, so that a
# broken install fails here instead of skipping the integration's tests.
import lightning  # noqa: F401,E402
import pytest

from scout_ckpt.ledger import Ledger
from tests.conftest import REPO, run_cli
from tests.torchrun_errors import why_failed

pytestmark = pytest.mark.slow
JOB = REPO / "tests" / "scripts" / "lightning_job.py"
BASE = ("--steps", "8", "--save-every", "2", "--accum", "2")


def torchrun(root, *extra, restarts=0, record=None, ok=True, nproc=2, env=None):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        **(env or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        str(JOB),
        str(root),
        *(["--record", str(record)] if record else []),
        *map(str, extra),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root.parent)
    assert (p.returncode == 0) == ok, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def curve(rs, attempt=None) -> dict:
    """{step: (loss, lr, batch fingerprint)} of the optimizer steps recorded (the last attempt's wins)."""
    return {
        r["step"]: (r["loss"], r["lr"], r["batch"])
        for r in rs
        if "step" in r and (attempt is None or r["attempt"] == attempt)
    }


def final(rs) -> str:
    return [r for r in rs if "final" in r][-1]["final"]


def saved(rs) -> dict:
    return {r["saved"]: r["digest"] for r in rs if "saved" in r}


def started(rs) -> list[tuple]:
    """(step, digest) of what each resumed attempt restored, as the job digested it before training on."""
    return [(r["started"], r["digest"]) for r in rs if "started" in r]


def states(root) -> dict:
    with Ledger.open(root, readonly=True) as led:
        return {r["step"]: r["state"] for r in led.checkpoints()}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same job without scout-ckpt: plain DDPStrategy and Lightning's own ModelCheckpoint files."""
    base = tmp_path_factory.mktemp("plain")
    torchrun(base / "root", "--scout", "none", *BASE, record=base / "rec.jsonl")
    return rows(base / "rec.jsonl")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    base = tmp_path_factory.mktemp("healthy")
    root = base / "root"
    torchrun(root, *BASE, "--ckpt-path", "latest_clean", record=base / "rec.jsonl")
    return root, rows(base / "rec.jsonl")


@pytest.mark.scenario
@pytest.mark.scenario_ci  # with the kill below: the plain run is shared (make test's time budget is spent)
def test_healthy_ddp_run_certifies_every_checkpoint_and_equals_the_run_without_scout(healthy, plain):
    root, rs = healthy
    assert curve(rs) == curve(plain) and len(curve(rs)) == 8
    assert final(rs) == final(plain)
    assert states(root) == {2: "certified", 4: "certified", 6: "certified", 8: "certified"}
    # the per-step hook follows real optimizer steps: 8 steps over 16 batches (accumulate_grad_batches=2)
    assert [r["scout_steps"] for r in rs if "scout_steps" in r] == [list(range(1, 9))]
    # the observer watches the strategy's DDP wrapper, and replay (on by default) covered every save
    assert [r["observer_attached"] for r in rs if "observer_attached" in r] == ["counted"]
    with Ledger.open(root, readonly=True) as led:
        assert led.evidence(8)["replay"]["status"] == "pass"
    # every save is a core step directory, and ModelCheckpoint's names are pointers to them
    assert sorted(p.name for p in root.glob("step-*")) == [f"step-{s:08d}" for s in (2, 4, 6, 8)]
    ptr = json.loads((root / "lightning" / "step=8.ckpt").read_text())["scout_ckpt"]
    assert ptr["step"] == 8 and ptr["path"] == "step-00000008"
    rc, out, err = run_cli("resume", str(root), "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 8, err  # re-verifies the digests of step 8's files
    # a fresh run with ckpt_path="latest_clean" started from scratch (nothing loaded)
    assert not [r for r in rs if "loaded" in r]


@pytest.mark.scenario
def test_bitflip_in_the_newest_checkpoint_is_walked_past_on_restart(healthy, plain, tmp_path):
    src, _ = healthy
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", str(src), str(root)], check=True)
    victim = max((root / "step-00000008").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    rec = tmp_path / "rec.jsonl"
    torchrun(root, *BASE, "--ckpt-path", "latest_clean", record=rec)
    rs = rows(rec)
    assert [r["loaded"] for r in rs if "loaded" in r] == [6]  # walked back past 8, the flipped one
    assert curve(rs) == {s: v for s, v in curve(plain).items() if s > 6}
    assert final(rs) == final(plain)
    assert states(root)[8] == "certified"  # saved again by this run, after the rejected one was replaced
    with Ledger.open(root, readonly=True) as led:
        hist = [h["state"] for h in led.certifications(8)]
    assert "rejected" in hist, hist


@pytest.mark.scenario
@pytest.mark.scenario_ci  # the CI tier's Lightning kill
def test_sigkill_mid_run_resumes_exactly_from_latest_clean(plain, tmp_path):
    """Rank 1 SIGKILLed after optimizer step 5; torchrun restarts both ranks with ckpt_path="latest_clean": the
    restarted job loads step 4 (what it recorded when it saved), trains steps 5..8 on the same samples with the
    same loss and LR, and ends bitwise equal to the uninterrupted run without scout-ckpt."""
    root = tmp_path / "root"
    rec = tmp_path / "rec.jsonl"
    torchrun(root, *BASE, "--kill-step", "5", "--ckpt-path", "latest_clean", restarts=1, record=rec)
    rs = rows(rec)
    assert [r["loaded"] for r in rs if "loaded" in r] == [4]
    first = {r["saved"]: r["digest"] for r in rs if "saved" in r and r["attempt"] == 0}
    assert first == {s: d for s, d in saved(plain).items() if s <= 4}
    assert curve(rs, attempt=1) == {s: v for s, v in curve(plain).items() if s > 4}
    assert final(rs) == final(plain)
    assert [r["scout_steps"] for r in rs if "scout_steps" in r] == [[5, 6, 7, 8]]
    assert set(states(root).values()) == {"certified"}


@pytest.mark.scenario
def test_sigkill_in_the_middle_of_a_save_resumes_exactly_from_the_previous_one(plain, tmp_path):
    """Rank 1 SIGKILLed in the middle of writing step 6's checkpoint; the restart records that save as
    interrupted, loads step 4 (what the job recorded when it saved it), saves 6 and 8 again and ends bitwise equal
    to the uninterrupted run without scout-ckpt."""
    root = tmp_path / "root"
    rec = tmp_path / "rec.jsonl"
    torchrun(root, *BASE, "--kill-in-save", "6", "--ckpt-path", "latest_clean", restarts=1, record=rec)
    rs = rows(rec)
    assert [r["loaded"] for r in rs if "loaded" in r] == [4]
    # the job records a save as it hands the state over (6 included: rank 1 died while writing it)
    first = {r["saved"]: r["digest"] for r in rs if "saved" in r and r["attempt"] == 0}
    assert {s: d for s, d in first.items() if s <= 4} == {s: d for s, d in saved(plain).items() if s <= 4}
    assert curve(rs, attempt=1) == {s: v for s, v in curve(plain).items() if s > 4}
    assert final(rs) == final(plain)
    assert set(states(root).values()) == {"certified"}
    with Ledger.open(root, readonly=True) as led:
        hist6 = [h for h in led.certifications(6) if h["state"] != "writing"]
    assert hist6[0]["state"] == "rejected" and hist6[0]["reasons"][0]["code"] == "save_interrupted", hist6


@pytest.mark.scenario
def test_model_checkpoint_top_k_and_last_over_20_saves(tmp_path):
    """save_top_k=2 on the synced train loss and save_last over 20 saves: the same files (names) as Lightning's
    own ModelCheckpoint writes without scout-ckpt, each a pointer to a certified step; the step directories on disk
    are exactly those the pointers name plus the newest certified one; every other step is `deleted`."""
    args = ("--steps", "20", "--save-every", "1", "--top-k", "2", "--save-last")
    torchrun(tmp_path / "plain", "--scout", "none", *args)
    root = tmp_path / "root"
    torchrun(root, *args, record=tmp_path / "rec.jsonl")
    names = sorted(p.name for p in (root / "lightning").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "plain" / "lightning").iterdir())
    assert len(names) == 3 and "last.ckpt" in names
    named = {json.loads((root / "lightning" / n).read_text())["scout_ckpt"]["step"] for n in names}
    st = states(root)
    newest = max(s for s, v in st.items() if v == "certified")
    assert newest == 20
    on_disk = {int(p.name.split("-")[1]) for p in root.glob("step-*")}
    assert on_disk == named | {newest}
    assert all(st[s] == "certified" for s in on_disk)
    assert {s for s, v in st.items() if v == "deleted"} == set(range(1, 21)) - on_disk


@pytest.mark.scenario
def test_async_save_with_top_k_1_leaves_only_named_steps_and_warns_that_one_is_kept(tmp_path):
    """async_save: the last save's verdict comes after ModelCheckpoint dropped the previous pointer; retention runs
    once more at teardown, so no step directory is left that no pointer names (but the newest certified).
    save_top_k=1 is warned about at fit start (nothing certified to walk back to)."""
    root = tmp_path / "root"
    p = torchrun(
        root,
        "--steps",
        "6",
        "--save-every",
        "2",
        "--top-k",
        "1",
        "--options",
        '{"async_save": true}',
        record=tmp_path / "rec.jsonl",
    )
    assert p.stderr.count("keeps one checkpoint") == 1, p.stderr[-3000:]
    named = {json.loads(f.read_text())["scout_ckpt"]["step"] for f in (root / "lightning").iterdir()}
    st = states(root)
    newest = max(s for s, v in st.items() if v == "certified")
    on_disk = {int(d.name.split("-")[1]) for d in root.glob("step-*")}
    assert on_disk == named | {newest}, (on_disk, named, st)
    assert {s for s, v in st.items() if v == "deleted"} == set(st) - on_disk, st  # a step top-k skipped: no row


@pytest.mark.scenario
def test_model_parallel_fsdp2_certifies_and_resumes_exactly_after_sigkill(tmp_path):
    """ScoutModelParallelStrategy (fully_shard in configure_model): every save certified with the shard replay and
    at-rest evidence; rank 1 SIGKILLed after step 5 resumes from step 4 and ends bitwise equal to a plain
    ModelParallelStrategy run (Lightning's own sharded checkpoints, no scout-ckpt). Gradient clipping on: it runs
    in Lightning's closure, which the strategy evaluates before the replays capture the gradients."""
    plain_rec = tmp_path / "plain.jsonl"
    torchrun(tmp_path / "plain", "--scout", "mp-none", *BASE, "--clip", "0.05", record=plain_rec)
    plain = rows(plain_rec)
    root = tmp_path / "root"
    rec = tmp_path / "rec.jsonl"
    torchrun(
        root,
        "--scout",
        "mp",
        *BASE,
        "--clip",
        "0.05",
        "--kill-step",
        "5",
        "--ckpt-path",
        "latest_clean",
        restarts=1,
        record=rec,
    )
    rs = rows(rec)
    assert [r["loaded"] for r in rs if "loaded" in r] == [4]
    assert curve(rs, attempt=1) == {s: v for s, v in curve(plain).items() if s > 4}
    assert final(rs) == final(plain)
    assert set(states(root).values()) == {"certified"} and set(states(root)) == {2, 4, 6, 8}
    with Ledger.open(root, readonly=True) as led:
        ev = led.evidence(8)
    assert {"shard_replay", "at_rest"} <= set(ev), ev


def test_fsdp1_strategy_is_refused_on_cpu_with_one_line_and_keep_is_refused():
    """FSDP1 needs a GPU: ScoutFSDPStrategy stops at setup_environment on CPU (before any process group) with a
    ScoutError naming the CPU alternative; the Checkpointer option `keep` is refused (ModelCheckpoint retains)."""
    import lightning.pytorch as pl
    import torch

    from scout_ckpt.errors import ScoutError
    from scout_ckpt.integrations.lightning import ScoutDDPStrategy, ScoutFSDPStrategy

    with pytest.raises(ScoutError, match="keep"):
        ScoutDDPStrategy(checkpointer={"keep": 2})
    # LightningCLI's YAML gives the checkpointer's groups as tables: converted to their dataclasses here
    from scout_ckpt.options import ObserverOptions, ReplayOptions

    strategy = ScoutDDPStrategy(
        checkpointer={"replay": {"interval": 5}, "observer": {"stall_s": 9}, "async_save": True}
    )
    assert strategy.scout_options == {
        "replay": ReplayOptions(interval=5),
        "observer": ObserverOptions(stall_s=9),
        "async_save": True,
    }
    with pytest.raises(ScoutError, match="replay: unknown option 'intervall'"):
        ScoutDDPStrategy(checkpointer={"replay": {"intervall": 5}})

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        strategy=ScoutFSDPStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)
    with pytest.raises(ScoutError, match="needs a GPU"):
        trainer.fit(Tiny(), train_dataloaders=data)
    assert not torch.distributed.is_initialized()


# ---- 3 ranks ----------------------------------------------------------------------------------------------------
# 48 samples, 4 batches of 4 per rank per epoch, as at 2 ranks. Under DDP at 3 ranks, a resumed run is bitwise
# the run Lightning itself resumes from its own checkpoint, not the uninterrupted one: the DDP reducer built by a
# restart sums the first step's gradients in its initial bucket order, the uninterrupted one in its rebuilt order
# (docs/pytorch-facts.md, "Bitwise resume"), and with 3 addends the order shows in the last bits (2 addends commute). FSDP2's
# reduce-scatter has no buckets to rebuild: bitwise there.


@pytest.fixture(scope="module")
def plain3(tmp_path_factory):
    """The 3-rank job without scout-ckpt (plain DDPStrategy, Lightning's own ModelCheckpoint files)."""
    base = tmp_path_factory.mktemp("plain3")
    torchrun(base / "root", "--scout", "none", *BASE, record=base / "rec.jsonl", nproc=3)
    return base / "root", rows(base / "rec.jsonl")


@pytest.mark.scenario
def test_three_ranks_ddp_healthy_run_certifies_every_checkpoint_and_equals_the_run_without_scout(plain3, tmp_path):
    _, plain = plain3
    root = tmp_path / "root"
    rec = tmp_path / "rec.jsonl"
    torchrun(root, *BASE, "--ckpt-path", "latest_clean", record=rec, nproc=3)
    rs = rows(rec)
    assert curve(rs) == curve(plain) and len(curve(rs)) == 8  # bitwise: no restart, no rebuilt reducer
    assert saved(rs) == saved(plain) and final(rs) == final(plain)
    assert states(root) == {2: "certified", 4: "certified", 6: "certified", 8: "certified"}
    with Ledger.open(root, readonly=True) as led:
        assert led.runs()[-1]["world_size"] == 3
        assert led.evidence(8)["consensus"]["status"] == "pass"
        assert led.evidence(8)["replay"]["status"] == "pass"
    assert [r["observer_attached"] for r in rs if "observer_attached" in r] == ["counted"]


@pytest.mark.scenario
def test_three_ranks_ddp_sigkill_mid_run_resumes_the_saved_state_and_is_lightnings_own_resume(plain3, tmp_path):
    """Rank 1 SIGKILLed after step 5 of 3: the restart restores exactly the digest the job printed when it saved
    step 4, then trains steps 5..8 bit for bit as Lightning's own resume from its own step=4.ckpt of the run
    without scout-ckpt does; against the uninterrupted run, the same samples and LRs, losses equal to rel 1e-5
    (measured: rel 2e-8 at step 6, from DDP's bucket order, see above)."""
    plain_root, plain = plain3
    root = tmp_path / "root"
    rec = tmp_path / "rec.jsonl"
    torchrun(root, *BASE, "--kill-step", "5", "--ckpt-path", "latest_clean", restarts=1, record=rec, nproc=3)
    own_rec = tmp_path / "own.jsonl"
    torchrun(
        tmp_path / "own",
        "--scout",
        "none",
        *BASE,
        "--ckpt-path",
        plain_root / "lightning" / "step=4.ckpt",
        record=own_rec,
        nproc=3,
    )
    rs, own = rows(rec), rows(own_rec)
    first = {r["saved"]: r["digest"] for r in rs if "saved" in r and r["attempt"] == 0}
    assert first == {s: d for s, d in saved(plain).items() if s <= 4}
    assert [r["loaded"] for r in rs if "loaded" in r] == [4]
    assert started(rs) == [(4, first[4])] == started(own)
    assert curve(rs, attempt=1) == curve(own) and final(rs) == final(own)
    resumed, oracle = curve(rs, attempt=1), curve(plain)
    assert sorted(resumed) == [5, 6, 7, 8]
    for s, (loss, lr, batch) in resumed.items():
        assert (lr, batch) == oracle[s][1:] and loss == pytest.approx(oracle[s][0], rel=1e-5), s
    assert states(root) == {2: "certified", 4: "certified", 6: "certified", 8: "certified"}


@pytest.fixture(scope="module")
def plain3_fsdp2(tmp_path_factory):
    """The 3-rank FSDP2 job without scout-ckpt (plain ModelParallelStrategy, Lightning's own sharded saves)."""
    base = tmp_path_factory.mktemp("plain3_fsdp2")
    torchrun(base / "root", "--scout", "mp-none", *BASE, record=base / "rec.jsonl", nproc=3)
    return rows(base / "rec.jsonl")


@pytest.mark.scenario
def test_three_ranks_fsdp2_healthy_run_certifies_every_checkpoint_and_equals_the_run_without_scout(
    plain3_fsdp2, tmp_path
):
    """fully_shard over 3 ranks: Linear(32, 1)'s one row leaves two ranks with empty shards."""
    root = tmp_path / "root"
    rec = tmp_path / "rec.jsonl"
    torchrun(root, "--scout", "mp", *BASE, "--ckpt-path", "latest_clean", record=rec, nproc=3)
    rs = rows(rec)
    assert curve(rs) == curve(plain3_fsdp2) and len(curve(rs)) == 8
    assert saved(rs) == saved(plain3_fsdp2) and final(rs) == final(plain3_fsdp2)
    assert states(root) == {2: "certified", 4: "certified", 6: "certified", 8: "certified"}
    with Ledger.open(root, readonly=True) as led:
        ev = led.evidence(8)
        assert led.runs()[-1]["world_size"] == 3
    assert {"shard_replay", "at_rest"} <= set(ev), ev


@pytest.mark.scenario
def test_three_ranks_fsdp2_sigkill_in_the_middle_of_a_save_resumes_bitwise(plain3_fsdp2, tmp_path):
    """Rank 1 SIGKILLed while writing step 6's shards: the restart records that save as interrupted, restores
    exactly the digest the job printed at step 4's save, and ends bit for bit the uninterrupted run."""
    root = tmp_path / "root"
    rec = tmp_path / "rec.jsonl"
    torchrun(
        root,
        "--scout",
        "mp",
        *BASE,
        "--kill-in-save",
        "6",
        "--ckpt-path",
        "latest_clean",
        restarts=1,
        record=rec,
        nproc=3,
    )
    rs = rows(rec)
    first = {r["saved"]: r["digest"] for r in rs if "saved" in r and r["attempt"] == 0}
    assert [r["loaded"] for r in rs if "loaded" in r] == [4]
    assert started(rs) == [(4, first[4])] and first[4] == saved(plain3_fsdp2)[4]
    assert curve(rs, attempt=1) == {s: v for s, v in curve(plain3_fsdp2).items() if s > 4}
    assert final(rs) == final(plain3_fsdp2)
    assert states(root) == {2: "certified", 4: "certified", 6: "certified", 8: "certified"}
    with Ledger.open(root, readonly=True) as led:
        hist6 = [h for h in led.certifications(6) if h["state"] != "writing"]
    assert hist6[0]["state"] == "rejected" and hist6[0]["reasons"][0]["code"] == "save_interrupted", hist6


# ---- Murphy: the world misbehaves between generations (tests/murphy_env.py) --------------------------------------


@pytest.mark.scenario
def test_a_ledger_deleted_between_generations_is_rebuilt_and_the_restart_resumes_the_newest_certified(plain, tmp_path):
    """Generation 1 is SIGKILLed after step 5 (certified: 2, 4); the ledger is deleted; generation 2 (a new
    torchrun, as a scheduler starts it) rebuilds the ledger from the manifests and the journal, says so, resumes
    from step 4 (never from step 0) with the digest generation 1 printed at that save, and ends bitwise equal to
    the uninterrupted run without scout-ckpt."""
    from tests.murphy_env import delete_ledger

    root = tmp_path / "root"
    rec1, rec2 = tmp_path / "gen1.jsonl", tmp_path / "gen2.jsonl"
    torchrun(root, *BASE, "--kill-step", "5", "--ckpt-path", "latest_clean", record=rec1, ok=False)
    assert states(root) == {2: "certified", 4: "certified"}
    delete_ledger(root)
    p = torchrun(root, *BASE, "--ckpt-path", "latest_clean", record=rec2)
    assert "rebuilding it from the manifests and the journal" in p.stderr, why_failed(p.stderr)
    gen1, gen2 = rows(rec1), rows(rec2)
    assert saved(gen1) == {s: d for s, d in saved(plain).items() if s <= 4}
    assert [r["loaded"] for r in gen2 if "loaded" in r] == [4]
    assert started(gen2) == [(4, saved(gen1)[4])]
    assert curve(gen2) == {s: v for s, v in curve(plain).items() if s > 4}
    assert final(gen2) == final(plain)
    assert states(root) == {2: "certified", 4: "certified", 6: "certified", 8: "certified"}


@pytest.mark.scenario
def test_a_transient_eio_on_the_newest_checkpoint_walks_back_and_leaves_it_certified(healthy, plain, tmp_path):
    """The restarted job's first read of one of step 8's files fails with EIO (every rank's process, whichever
    verifies it): it resumes from step 6 with the digest the job printed at that save and ends bitwise equal to
    the uninterrupted run, and step 8 keeps its state, verdicts and attempt: the disk answering again, `ls` shows it
    certified and `resume --latest-clean` re-verifies and hands it out. The restart saves every 3 steps (none in
    7..8), so that the step 8 on disk afterwards is the one the EIO hit, not a re-save."""
    from tests.murphy_env import eio_once_env, largest_shard, trust

    src, healthy_rs = healthy
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", str(src), str(root)], check=True)
    before = trust(root, 8)
    env = eio_once_env(tmp_path / "site", largest_shard(root / "step-00000008"))
    rec = tmp_path / "rec.jsonl"
    p = torchrun(
        root, "--steps", "8", "--save-every", "3", "--accum", "2", "--ckpt-path", "latest_clean", record=rec, env=env
    )
    assert "could not check step 8 now" in p.stderr, why_failed(p.stderr)
    rs = rows(rec)
    assert [r["loaded"] for r in rs if "loaded" in r] == [6]
    assert started(rs) == [(6, saved(healthy_rs)[6])]
    assert curve(rs) == {s: v for s, v in curve(plain).items() if s > 6}
    assert final(rs) == final(plain)
    assert trust(root, 8) == before and before[0] == "certified"
    rc, out, err = run_cli("ls", str(root), "--json")
    assert rc == 0 and {r["step"]: r["state"] for r in json.loads(out)["checkpoints"]}[8] == "certified", err
    rc, out, err = run_cli("resume", str(root), "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 8, err
