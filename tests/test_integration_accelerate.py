"""Hugging Face Accelerate with scout_ckpt.integrations.accelerate, judged by the job's own trace, never by
scout-ckpt: tests/scripts/accelerate_job.py (a tiny GPT-2 with dropout on, AdamW, a warmup schedule, a shuffled
DataLoader and an end-of-epoch evaluation, everything through `prepare`) logs per step the dataset indices of its
batch, the loss and the LR (float.hex), its own sha256 of the model, optimizer and scheduler at each save and after
a load, and at the end. The oracle is the same job with `--plain`: no scout-ckpt at all.

3 epochs of 6 batches per rank (18 optimizer steps), a save every 4 steps: step 4 is mid-epoch 0, 8 mid-epoch 1,
12 the last batch of epoch 1, 16 mid-epoch 2. Under real torchrun, 2 CPU/gloo ranks (one scenario on 3); SIGKILLs
are real, and so are the faults of the world between generations (a deleted ledger, an EIO: tests/murphy_env.py).

The in-process tests at the end drive TrackedDataLoader with one process (accelerate's own single-process loader,
whose RandomSampler draws its order from torch's global RNG) and the refusals; they need no process group.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

# `make test` installs transformers and accelerate (the Makefile's integration extras): imported unconditionally,
# so that a broken install fails here instead of skipping the integration's tests.
import accelerate  # noqa: F401
import pytest
import torch
import transformers  # noqa: F401

from scout_ckpt.ledger import Ledger
from tests.conftest import REPO
from tests.torchrun_errors import why_failed

SCRIPT = REPO / "tests" / "scripts" / "accelerate_job.py"
STEPS, EVERY = 18, 4


def torchrun(root, trace, *extra, restarts=0, nproc=2, every=EVERY, env=None, ok=True):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
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
        str(SCRIPT),
        str(root),
        "--trace",
        str(trace),
        "--save-every",
        str(every),
        *map(str, extra),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=root.parent)
    assert (p.returncode == 0) == ok, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def read_trace(trace, ranks: int = 2) -> list[list[dict]]:
    return [[json.loads(line) for line in open(f"{trace}.rank{r}")] for r in range(ranks)]


def _key(rec):
    return ("eval", rec["epoch"]) if "eval" in rec else ("step", rec["step"])


def training(recs) -> dict:
    """{("step", n) | ("eval", epoch): record without its attempt} of the training steps and evaluations."""
    return {_key(r): {k: v for k, v in r.items() if k != "attempt"} for r in recs if "event" not in r}


def events(recs, kind) -> list[dict]:
    return [r for r in recs if r.get("event") == kind]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    base = tmp_path_factory.mktemp("acc_plain")
    torchrun(base / "root", base / "trace", "--plain")
    return read_trace(base / "trace")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    base = tmp_path_factory.mktemp("acc_scout")
    torchrun(base / "root", base / "trace")
    return base / "root", read_trace(base / "trace")


def assert_resumed_exactly(plain, run, resumed_from: int, saved_by=None) -> None:
    """Both ranks: the job's last attempt loaded exactly what was saved at `resumed_from` (the digest the saving
    attempt printed: an earlier attempt of `run`, or the trace `saved_by`), then took every later step with the
    uninterrupted run's batches, losses and LRs, evaluated alike, and ended with its final digest."""
    for rank in range(len(run)):
        recs, oracle = run[rank], training(plain[rank])
        last = max(r["attempt"] for r in recs)
        saver = saved_by[rank] if saved_by is not None else [r for r in recs if r["attempt"] < last]
        assert saver, "the job was not restarted"
        saved = {r["step"]: r["digest"] for r in events(saver, "save")}
        resumed = [r for r in recs if r["attempt"] == last]
        loaded = events(resumed, "loaded")
        assert [r["step"] for r in loaded] == [resumed_from], loaded
        assert loaded[0]["digest"] == saved[resumed_from]
        after = training(resumed)
        steps = sorted(k[1] for k in after if k[0] == "step")
        assert steps == list(range(resumed_from + 1, last_step(plain[rank]) + 1)), steps
        assert after == {k: oracle[k] for k in after}, rank  # idx, loss, lr, eval losses: bit for bit
        assert events(resumed, "final")[-1]["digest"] == events(plain[rank], "final")[-1]["digest"]


def last_step(recs) -> int:
    """The uninterrupted run's last training step (STEPS on 2 ranks; fewer on more ranks, whose epochs are
    shorter)."""
    return max(k[1] for k in training(recs) if k[0] == "step")


def checkpoints(root) -> dict:
    with Ledger.open(root, readonly=True) as led:
        return {r["step"]: r["state"] for r in led.checkpoints()}


# ---- default tier: the healthy run ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.scenario
@pytest.mark.scenario_ci  # with the kill below: the plain run is shared (make test's time budget is spent)
def test_healthy_run_certifies_every_checkpoint_and_is_the_run_without_scout_ckpt(plain, healthy):
    root, run = healthy
    for rank in (0, 1):
        assert training(run[rank]) == training(plain[rank]), rank  # every step and evaluation, bitwise
        assert len(training(run[rank])) == STEPS + 3
        assert events(run[rank], "final")[0]["digest"] == events(plain[rank], "final")[0]["digest"]
        assert [(r["step"], r["state"]) for r in events(run[rank], "save")] == [
            (s, "certified") for s in range(EVERY, STEPS + 1, EVERY)
        ]
    # the two ranks really trained on different batches (a job Accelerate did not distribute would not)
    assert training(run[0])[("step", 1)]["idx"] != training(run[1])[("step", 1)]["idx"]
    assert checkpoints(root) == {s: "certified" for s in range(EVERY, STEPS + 1, EVERY)}
    with Ledger.open(root, readonly=True) as led:
        ev = led.evidence(STEPS - STEPS % EVERY)
        run_row = led.runs()[-1]
    assert run_row["world_size"] == 2 and {"consensus", "replay"} <= set(run_row["policy"]["require"])
    assert ev["consensus"]["status"] == "pass" and ev["bytes"]["status"] == "pass"
    assert ev["replay"]["status"] == "pass", ev["replay"]  # on by default: every target replayed at each save
    # the observer watches the module that trains: DDP's wrapper (Accelerate keeps only the bare model)
    assert all(events(run[rank], "observer")[0]["attached"] == "counted" for rank in (0, 1))
    meta = (root / "step-00000016" / ".metadata").read_bytes()
    for key in (
        b"app.model.transformer.h.0.attn.c_attn.weight",
        b"app.optim.state",
        b"scheduler.last_epoch",
        b"data.dl0.start_rng",
        b"data.dl0.pos",
        b"rng.torch",
        b"accelerator.step",
    ):
        assert key in meta, key


# ---- scenarios: SIGKILLs and a flipped bit --------------------------------------------------------------------


@pytest.mark.scenario
def test_three_ranks_a_rank_killed_mid_epoch_resumes_the_saved_state_and_data_order(tmp_path):
    """The same job on 3 ranks: rank 1 dies after step 10, the restart loads step 8 with exactly the digest the
    job printed when it saved it, every later step gets the uninterrupted run's batches and LR, and the losses agree
    to the last bits DDP allows: at 3 ranks DDP's rebuilt buckets after a restart sum the gradients in another
    order (README, "Bitwise resume under DDP"), which 2 ranks do not show."""
    torchrun(tmp_path / "plain-root", tmp_path / "plain", "--plain", nproc=3)
    torchrun(tmp_path / "root", tmp_path / "trace", "--kill-step", 10, restarts=1, nproc=3)
    plain, run = read_trace(tmp_path / "plain", 3), read_trace(tmp_path / "trace", 3)
    last = last_step(plain[0])
    assert last > 10
    for rank in range(3):
        recs, oracle = run[rank], training(plain[rank])
        saved = {r["step"]: r["digest"] for r in events([r for r in recs if r["attempt"] == 0], "save")}
        resumed = [r for r in recs if r["attempt"] == 1]
        assert [(r["step"], r["digest"]) for r in events(resumed, "loaded")] == [(8, saved[8])]
        after = training(resumed)
        assert sorted(k[1] for k in after if k[0] == "step") == list(range(9, last + 1))
        for k, rec in after.items():
            want = oracle[k]
            assert {f: v for f, v in rec.items() if f != "loss"} == {f: v for f, v in want.items() if f != "loss"}
            got, exp = rec.get("loss"), want.get("loss")
            got, exp = ([got], [exp]) if isinstance(got, str) else (got, exp)  # an evaluation: a list of losses
            assert [float.fromhex(x) for x in got] == pytest.approx([float.fromhex(x) for x in exp], rel=1e-5), k
    assert checkpoints(tmp_path / "root") == {s: "certified" for s in range(EVERY, last + 1, EVERY)}


@pytest.mark.scenario
@pytest.mark.scenario_ci  # the CI tier's Accelerate kill
def test_a_rank_killed_mid_epoch_resumes_bitwise(plain, tmp_path):
    # rank 1 dies after step 10 (epoch 1, 4 batches in); the restart loads step 8 (epoch 1, 2 batches in)
    torchrun(tmp_path / "root", tmp_path / "trace", "--kill-step", 10, restarts=1)
    assert_resumed_exactly(plain, read_trace(tmp_path / "trace"), 8)
    assert checkpoints(tmp_path / "root") == {s: "certified" for s in range(EVERY, STEPS + 1, EVERY)}


@pytest.mark.scenario
def test_a_kill_that_resumes_across_an_epoch_boundary_is_bitwise(plain, tmp_path):
    # killed after step 7 (epoch 1); the restart loads step 4 (epoch 0, 4 of 6 batches) and crosses into epoch 1
    torchrun(tmp_path / "root", tmp_path / "trace", "--kill-step", 7, restarts=1)
    assert_resumed_exactly(plain, read_trace(tmp_path / "trace"), 4)


@pytest.mark.scenario
def test_a_checkpoint_after_an_epochs_last_batch_resumes_into_its_evaluation(plain, tmp_path):
    # step 12 is epoch 1's last batch: the restart finishes that pass (nothing left), runs epoch 1's evaluation as
    # the uninterrupted run did, then epoch 2
    torchrun(tmp_path / "root", tmp_path / "trace", "--kill-step", 14, restarts=1)
    run = read_trace(tmp_path / "trace")
    assert_resumed_exactly(plain, run, 12)
    assert ("eval", 1) in training([r for r in run[0] if r["attempt"] == 1])


@pytest.mark.scenario
def test_a_rank_killed_in_the_middle_of_a_save_resumes_from_the_previous_one(plain, tmp_path):
    torchrun(tmp_path / "root", tmp_path / "trace", "--kill-save", 12, restarts=1)
    assert_resumed_exactly(plain, read_trace(tmp_path / "trace"), 8)
    with Ledger.open(tmp_path / "root", readonly=True) as led:
        hist = [h for h in led.certifications(12) if h["state"] != "writing"]
        assert led.checkpoint(12)["state"] == "certified" and led.checkpoint(16)["state"] == "certified"
    assert hist[0]["state"] == "rejected" and hist[0]["reasons"][0]["code"] == "save_interrupted"


@pytest.mark.scenario
def test_a_flipped_bit_in_the_newest_checkpoint_is_walked_past(plain, healthy, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(healthy[0], root)
    f = max((root / "step-00000016").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    # the job is started again (as a scheduler would after a crash): it must walk past 16 and resume from 12
    torchrun(root, tmp_path / "trace")
    assert_resumed_exactly(plain, read_trace(tmp_path / "trace"), 12, saved_by=healthy[1])
    with Ledger.open(root, readonly=True) as led:
        verdicts = [h for h in led.certifications(16) if h["state"] != "writing"]
        assert led.checkpoint(16)["state"] == "certified"  # re-saved by the resumed run, a new attempt
    assert [h["state"] for h in verdicts][-2:] == ["rejected", "certified"]
    assert verdicts[-2]["reasons"][0]["code"] == "digest_mismatch"


@pytest.mark.scenario
def test_the_seedable_sampler_resumes_bitwise_too(tmp_path):
    base = tmp_path / "plain"
    base.mkdir()
    torchrun(base / "root", base / "trace", "--plain", "--seedable")
    torchrun(tmp_path / "root", tmp_path / "trace", "--seedable", "--kill-step", 10, restarts=1)
    assert_resumed_exactly(read_trace(base / "trace"), read_trace(tmp_path / "trace"), 8)


# ---- Murphy: the world misbehaves between generations (tests/murphy_env.py) --------------------------------------


@pytest.mark.scenario
def test_a_ledger_deleted_between_generations_is_rebuilt_and_the_restart_resumes_the_newest_certified(plain, tmp_path):
    """Generation 1 is SIGKILLed after step 10 (certified: 4, 8); the ledger is deleted; generation 2 (a new
    torchrun, as a scheduler starts it) rebuilds the ledger from the manifests and the journal, says so, and
    resumes from step 8, never from step 0: exactly the digest generation 1 printed at that save, then the
    uninterrupted run's batches, losses and LRs bit for bit."""
    from tests.murphy_env import delete_ledger

    root = tmp_path / "root"
    torchrun(root, tmp_path / "gen1", "--kill-step", 10, ok=False)
    assert checkpoints(root) == {4: "certified", 8: "certified"}
    delete_ledger(root)
    p = torchrun(root, tmp_path / "gen2")
    assert "rebuilding it from the manifests and the journal" in p.stderr, why_failed(p.stderr)
    assert_resumed_exactly(plain, read_trace(tmp_path / "gen2"), 8, saved_by=read_trace(tmp_path / "gen1"))
    assert checkpoints(root) == {s: "certified" for s in range(EVERY, STEPS + 1, EVERY)}


@pytest.mark.scenario
def test_a_transient_eio_on_the_newest_checkpoint_walks_back_and_leaves_it_certified(plain, healthy, tmp_path):
    """The job started again on the healthy run's root; its first read of one of step 16's files fails with EIO
    (every rank's process, whichever verifies it): it resumes from step 12 exactly (the digest the healthy run
    printed at that save, then the uninterrupted run bit for bit), and step 16 keeps its state, verdicts and
    attempt: the disk answering again, `ls` shows it certified and `resume --latest-clean` re-verifies and hands it
    out. The restart does not save (every 100 steps), so that the step 16 on disk afterwards is the one the EIO
    hit, not a re-save."""
    from tests.conftest import run_cli
    from tests.murphy_env import eio_once_env, largest_shard, trust

    root = tmp_path / "root"
    shutil.copytree(healthy[0], root)
    before = trust(root, 16)
    env = eio_once_env(tmp_path / "site", largest_shard(root / "step-00000016"))
    p = torchrun(root, tmp_path / "trace", every=100, env=env)
    assert "could not check step 16 now" in p.stderr, why_failed(p.stderr)
    assert_resumed_exactly(plain, read_trace(tmp_path / "trace"), 12, saved_by=healthy[1])
    assert trust(root, 16) == before and before[0] == "certified"
    rc, out, err = run_cli("ls", str(root), "--json")
    assert rc == 0 and {r["step"]: r["state"] for r in json.loads(out)["checkpoints"]}[16] == "certified", err
    rc, out, err = run_cli("resume", str(root), "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 16, err


def accelerate_launch(root, trace, *extra, attempt: int = 0):
    """One process under `accelerate launch --num_processes 1 --cpu` (its simple launcher, no torchrun); 6
    batches per epoch as under torchrun (12 samples). `attempt` stands for a scheduler's restart count."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--cpu",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(SCRIPT),
        str(root),
        "--trace",
        str(trace),
        "--save-every",
        str(EVERY),
        "--samples",
        "12",
        *map(str, extra),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=root.parent)


@pytest.mark.scenario
def test_one_process_under_accelerate_launch_resumes_bitwise(tmp_path):
    """No process group from Accelerate with one process: the integration makes a 1-rank gloo group. The plain
    RandomSampler (one process: no generator, its order drawn from torch's RNG) resumes exactly too."""
    base = tmp_path / "plain"
    base.mkdir()
    p = accelerate_launch(base / "root", base / "trace", "--plain")
    assert p.returncode == 0, why_failed(p.stderr)
    p = accelerate_launch(tmp_path / "root", tmp_path / "trace", "--kill-step", 10, "--kill-rank", 0)
    assert p.returncode != 0 and len(read_trace(tmp_path / "trace", 1)[0]) > 10
    p = accelerate_launch(tmp_path / "root", tmp_path / "trace", attempt=1)
    assert p.returncode == 0, why_failed(p.stderr)
    assert_resumed_exactly(read_trace(base / "trace", 1), read_trace(tmp_path / "trace", 1), 8)
    assert checkpoints(tmp_path / "root") == {s: "certified" for s in range(EVERY, STEPS + 1, EVERY)}


# ---- in process: TrackedDataLoader on one process, and the refusals -------------------------------------------


def _loader(seed: int = 0):
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    acc = Accelerator(cpu=True)
    torch.manual_seed(seed)
    dl = acc.prepare(DataLoader(list(range(10)), batch_size=2, shuffle=True))
    return acc, dl


def _walk(tracked, batches: int, epoch_end_draw: bool = True) -> list:
    """Hand out `batches` batches across passes, drawing a 'dropout' number from torch's RNG after each, and one
    at every pass's end (an evaluation); returns what was seen."""
    seen: list = []
    it = None
    while len(seen) < batches:
        if it is None:
            it = iter(tracked)
        b = next(it, None)
        if b is None:
            it = None
            if epoch_end_draw:
                seen.append(("end", torch.rand(1).item()))
            continue
        seen.append((b.tolist(), torch.rand(1).item()))
    return seen, it


@pytest.mark.parametrize("at,epoch", [(3, 0), (5, 0), (7, 1)])  # mid-pass; a pass's last batch; 2nd pass
def test_a_tracked_loader_resumes_the_exact_stream_in_one_process(at, epoch):
    """One process: accelerate's loader keeps the plain RandomSampler, whose order is drawn from torch's global RNG
    when a pass starts, and creating an iterator draws from it too. The resumed stream (batches and the draws
    after them) equals the uninterrupted one, at a mid-pass position and at a pass's end."""
    from scout_ckpt.integrations.accelerate_data import TrackedDataLoader

    _, dl = _loader()
    whole, _ = _walk(TrackedDataLoader(dl), 16)
    _, dl = _loader()
    first = TrackedDataLoader(dl)
    head, it = _walk(first, at)
    saved, rng = first.state_dict(), torch.get_rng_state()
    assert first.epoch == epoch
    del it
    _, dl = _loader(seed=123)  # a new process would rebuild the loader; a different seed shows nothing leaks
    second = TrackedDataLoader(dl)
    second.load_state_dict({k: v.clone() for k, v in saved.items()})
    assert second.epoch == epoch
    torch.set_rng_state(rng)
    tail, _ = _walk(second, 16 - len(head))
    assert head + tail == whole
    assert sum(1 for b, _ in whole if b == "end") == 2 and len({tuple(b) for b, _ in whole if b != "end"}) > 5


def test_accelerates_own_skip_first_batches_kept_beside_the_drop_in_is_ignored_with_a_warning(tmp_path, caplog):
    """Accelerate's resume recipe (`accelerator.skip_first_batches(dl, n)`) left in a script that uses the drop-in
    would skip the resumed batches a second time: on a tracked loader it is ignored (the same stream as without
    it), with a warning naming the line to remove."""
    from scout_ckpt.integrations.accelerate import ScoutCheckpointing
    from scout_ckpt.integrations.accelerate_data import TrackedDataLoader

    _, dl = _loader()
    whole, _ = _walk(TrackedDataLoader(dl), 6, epoch_end_draw=False)
    acc, dl = _loader()
    ckpt = ScoutCheckpointing(acc, tmp_path / "root")
    tracked = ckpt.track(dl)
    with caplog.at_level("WARNING", logger="scout_ckpt.accelerate"):
        skipped = acc.skip_first_batches(tracked, 3)
    assert skipped is tracked
    assert "skip the batches twice" in caplog.text
    assert _walk(skipped, 6, epoch_end_draw=False)[0] == whole


def test_a_dataloader_prepared_directly_is_refused_before_anything_is_saved(tmp_path):
    from scout_ckpt.errors import ScoutError
    from scout_ckpt.integrations.accelerate import ScoutCheckpointing

    acc, dl = _loader()
    ckpt = ScoutCheckpointing(acc, tmp_path / "root")
    with pytest.raises(ScoutError, match="ckpt.track"):
        ckpt.load_latest_clean()
    assert not (tmp_path / "root").exists()
    tracked = ckpt.track(dl)
    assert ckpt.track(dl) is tracked and ckpt.track(tracked) is tracked and len(tracked) == len(dl)


def test_a_save_between_optimizer_steps_is_refused(tmp_path):
    from scout_ckpt.errors import ScoutError
    from scout_ckpt.integrations.accelerate import ScoutCheckpointing

    acc, _ = _loader()
    ckpt = ScoutCheckpointing(acc, tmp_path / "root")
    acc.sync_gradients = False
    try:
        with pytest.raises(ScoutError, match="gradient accumulation"):
            ckpt.save(3)
    finally:
        acc.sync_gradients = True
    assert not (tmp_path / "root").exists()
