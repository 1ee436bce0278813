"""Campaign scenarios for faults of the world (Murphy), run against a real job: a user's DDP script
(examples/train_ddp.py, 2 gloo ranks under real `torchrun --standalone`, default Checkpointer options).

Loaded by bench/campaign.py (`--kinds lost_ledger,transient_eio,enospc,clock_skew,gc_resave,second_container`, and
the fast tier's `local_quarantine,tier_revocation,eio_every_candidate,local_verdict_race`, described where they
are defined).
Every incident starts from a copy of one base run of the job (20 steps, checkpoints 5, 10, 15, 20 certified; built
once per campaign), then meets one fault of the world, injected by real means, and restarts the job:

  lost_ledger       scout-ledger.db deleted (even incidents) or truncated to 0 bytes (odd) between generations;
                    the restart runs to step 25.
  transient_eio     the restart's resume meets one EIO: in every process, the first os.open of one shard of step
                    20 fails (the call a file digest reads through); that generation saves nothing, then
                    `scout-ckpt gc --keep 2` runs, then the next generation (no fault) runs to 25.
  enospc            ROOT on a real 16 MiB tmpfs; when the save of step 25 creates its temp dir, another tenant
                    fills the disk (all but 48 KiB); torchrun's one restart meets the same full disk. Then the space
                    is freed and the job runs again to step 30. Skipped, saying why, where `mount -t tmpfs` fails.
  clock_skew        the restart's coordinator (rank 0) sees time.time() an hour ahead (even) or behind (odd) and
                    runs to 30; the next generation (true clock) runs to 35.
  gc_resave         a shard of step 20 is truncated, so the restart walks back to 15 and re-saves 20 (then 25),
                    while `scout-ckpt gc --keep 2` runs as a CLI process in a loop; rank 0's publish rename is
                    slowed by 3 s (a slow metadata server) so gc meets the re-save in flight.
  second_container  the restart runs in its own PID namespace (`unshare --pid --fork --mount-proc`: a second
                    container on this host, same host name, other PIDs) to step 30, publishes slowed by 3 s, while
                    `scout-ckpt certify` runs in a loop from this (the host's) PID namespace.

The faults enter through a sitecustomize.py on the job's PYTHONPATH (written by this module, driven by SCOUT_MURPHY_*
variables): the script itself is unchanged. The clock skew patches time.time/time_ns in Python; C-level clocks
(SQLite's, datetime.now) are not skewed.

The oracle is the job's own record (`--record`: sha256 of model and optimizer state, printed by rank 0 when it saves
and after it loads) and an independent read of every step directory on disk with plain `dcp.load` into a fresh
model and AdamW (no scout-ckpt code), digested the way the script digests. Per incident:

  wrongly_certified  steps the ledger calls certified (or `resume --latest-clean` hands out) whose bytes on disk do
                     not load to the state the job printed at that step's latest save (a damaged step, a step no
                     save of the job finished, a stale one); and steps a restart loaded whose digest differs.
  good_lost          good steps (certified before the fault, or saved since) that end deleted, rejected or changed,
                     or that a restart or `resume --latest-clean` passed over for an older one (a fresh start over
                     existing checkpoints). Retention asked for is not a loss: with gc --keep 2 only the newest two
                     good steps must survive. transient_eio's faulty generation may walk back one step (could not
                     check now is not a rejection): that is `walked_back`, not a loss.
  outcome            "finished" (every generation exited 0), "refused: <the job's error line>" (a scout-ckpt error,
                     one line: the documented answer to a full disk), or "crashed: <line>" otherwise.

`fired` is False when the fault did not happen (gc never met the re-save in flight, no certify run overlapped a
slowed publish, the EIO was never hit, no tmpfs). `detected` means handled: wrongly_certified == 0, good_lost == 0 and the outcome is finished or
refused; campaign.py's recall for these kinds is the fraction of incidents handled so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_ddp.py"
CLI = [sys.executable, "-m", "scout_ckpt.cli"]
RANKS = 2  # the faults are of the world, not of the rank count; consensus still runs over 2 replicas
SAVE_EVERY = 5
BASE_STEPS = 20  # the base run certifies 5, 10, 15, 20
KEEP = 2  # gc_resave's and transient_eio's retention
SLOW_PUBLISH_S = 3.0
TMPFS_SIZE = "16M"
FILL_LEAVE = 48 * 1024  # less than one checkpoint of this job (~83 KB), more than the ledger needs to say so
SKEW_S = 3600.0
ERR_RE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Corrupt|Refused|Mismatch)\w*): (.*)$")

SITECUSTOMIZE = r'''
"""Faults of the world for campaign_murphy's job, from SCOUT_MURPHY_* variables (nothing set: nothing changes)."""
import errno, json, os, time

_log_path = os.environ.get("SCOUT_MURPHY_LOG")
_rank0 = os.environ.get("RANK") == "0"
_real_time = time.time


def _log(what, **kw):
    if _log_path:
        with open(_log_path, "a") as f:
            f.write(json.dumps({"what": what, "pid": os.getpid(), "rank": os.environ.get("RANK"),
                                "time": _real_time(), **kw}) + "\n")


_eio = os.environ.get("SCOUT_MURPHY_EIO_FILE")
if _eio and os.environ.get("RANK") is not None:
    _real_open, _done = os.open, []

    def _open(path, flags, *args, **kwargs):   # this process's first open of the target fails: a flaky disk
        if not _done and not isinstance(path, int) and os.path.realpath(os.fspath(path)) == _eio:
            _done.append(1)
            _log("eio", path=os.fspath(path))
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return _real_open(path, flags, *args, **kwargs)

    os.open = _open

_skew = os.environ.get("SCOUT_MURPHY_CLOCK_SKEW_S")
if _skew and _rank0:
    _s, _tns = float(_skew), time.time_ns
    time.time = lambda: _real_time() + _s
    time.time_ns = lambda: _tns() + int(_s * 1e9)
    _log("skew", seconds=_s)

_slow = os.environ.get("SCOUT_MURPHY_SLOW_PUBLISH_S")
if _slow and _rank0:
    _real_rename = os.rename

    def _rename(src, dst, *args, **kwargs):   # the publish of a temp dir waits: a slow metadata server
        if (os.path.basename(os.fspath(src)).startswith(".step-")
                and os.path.basename(os.fspath(dst)).startswith("step-")):
            _log("slow_publish", src=os.fspath(src))
            time.sleep(float(_slow))
        return _real_rename(src, dst, *args, **kwargs)

    os.rename = _rename

_fill = os.environ.get("SCOUT_MURPHY_FILL_AT")
if _fill:
    _prefix, _ballast, _leave = _fill.split("|")
    _real_mkdir = os.mkdir

    def _mkdir(path, *args, **kwargs):   # another tenant fills the disk the moment this save starts
        out = _real_mkdir(path, *args, **kwargs)
        if os.path.basename(os.fspath(path)).startswith(_prefix):
            chunk = b"\0" * 65536
            with open(_ballast, "ab") as f:
                try:
                    while True:
                        f.write(chunk)
                        f.flush()
                except OSError:
                    pass
            size = os.path.getsize(_ballast)
            os.truncate(_ballast, max(0, size - int(_leave)))
            st = os.statvfs(os.path.dirname(_ballast))
            _log("fill", path=os.fspath(path), free=st.f_bavail * st.f_frsize)
        return out

    os.mkdir = _mkdir
'''


# ---- the job ------------------------------------------------------------------------------------------------


def _site(work: Path) -> Path:
    site = work / "murphy-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return site


def _error_line(stderr: str) -> str | None:
    """The job's error, one line: the first scout-ckpt exception line, else the last exception line."""
    lines = [m.group(0) for m in (ERR_RE.match(ln.strip()) for ln in stderr.splitlines()) if m]
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln) for ln in lines if "ChildFailedError" not in ln]
    scout = [ln for ln in lines if ln.startswith("scout_ckpt")]
    return scout[0] if scout else (lines[-1] if lines else None)


class Job:
    """One generation: examples/train_ddp.py under torchrun, in the background; its SCOUT-EXAMPLE records."""

    def __init__(
        self,
        work: Path,
        root: Path,
        steps: int,
        save_every: int = SAVE_EVERY,
        env: dict | None = None,
        max_restarts: int = 0,
        prefix: tuple[str, ...] = (),
    ):
        self.log = work / "murphy-faults.jsonl"
        full = {
            **os.environ,
            "PYTHONPATH": f"{_site(work)}{os.pathsep}{REPO}",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
            "SCOUT_MURPHY_LOG": str(self.log),
            **(env or {}),
        }
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(RANKS),
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "0.5",
            str(SCRIPT),
            str(root),
            "--steps",
            str(steps),
            "--save-every",
            str(save_every),
            "--record",
        ]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)

    def wait(self, timeout: float = 600.0) -> dict:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        rc = self.proc.returncode
        events = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines() if ln.startswith("SCOUT-EXAMPLE ")]
        return {
            "rc": rc,
            "wall_s": round(time.monotonic() - self.t0, 1),
            "events": events,
            "error": None if rc == 0 else (_error_line(err) or (err.strip().splitlines() or ["?"])[-1]),
            "stderr_tail": err[-1500:] if rc != 0 else "",
        }


def _run_job(work, root, steps, **kw) -> dict:
    return Job(work, root, steps, **kw).wait()


def _cli(*args, timeout: float = 300.0) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        p = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return 124, "", "timed out"


def _cli_loop(job: Job, *args) -> tuple[threading.Thread, list[dict]]:
    """Run a CLI command over and over while the job runs (an operator's or a cron's); each one's JSON."""
    seen: list[dict] = []

    def loop():
        while job.proc.poll() is None:
            start = time.time()
            rc, out, err = _cli(*args, timeout=120)
            try:
                doc = json.loads(out) if out.strip() else None
            except ValueError:
                doc = None
            seen.append({"rc": rc, "doc": doc, "err": err.strip()[-300:], "start": start, "end": time.time()})

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t, seen


# ---- the oracle ---------------------------------------------------------------------------------------------


def disk_digest(step_dir: Path) -> str | None:
    """What the step's bytes load to, read with plain dcp.load into a fresh model and AdamW (no scout-ckpt code),
    digested as examples/train_ddp.py report() digests (keys as under DDP: `module.` prefixed). None: it does not
    load."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class App(Stateful):
        def state_dict(self):
            m, o = get_state_dict(model, opt)
            return {"model": m, "optim": o}

        def load_state_dict(self, sd):
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"app": App()}, storage_reader=dcp.FileSystemReader(str(step_dir)))
    except BaseException:  # noqa: BLE001 - CheckpointException is a BaseException; any failure: does not load
        return None
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(("module." + k).encode())
        h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    osd = opt.state_dict()
    for pid, st in sorted(osd["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"optim.{pid}.{k}".encode())
            if torch.is_tensor(v):
                h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    for i, group in enumerate(osd["param_groups"]):
        h.update(f"optim.param_groups.{i}={sorted(group.items())!r}".encode())
    return h.hexdigest()


class Oracle:
    """What the job said it saved and loaded, generation after generation; what must hold afterwards."""

    def __init__(self, base: dict[int, str]):
        self.saved = dict(base)  # step -> digest printed at its latest save
        self.good = set(base)  # steps whose latest save the job finished (and that nobody damaged)
        self.wrong: set[int] = set()
        self.lost: set[int] = set()
        self.loads: list[dict] = []
        self.walked_back = False
        self.fresh_starts = 0  # generations that started from step 0 while good steps existed

    def damage(self, step: int) -> None:
        self.good.discard(step)

    def generation(self, label: str, res: dict, walk_back_ok: bool = False) -> None:
        for e in res["events"]:
            if e["event"] == "saved":
                self.saved[e["step"]] = e["digest"]
                self.good.add(e["step"])
            elif e["event"] == "loaded":
                newest = max(self.good, default=0)
                s = e["step"]
                rec = {"gen": label, "attempt": e["attempt"], "step": s, "expected": newest}
                if not s and self.good:
                    self.fresh_starts += 1
                if s and e["digest"] != self.saved.get(s):
                    self.wrong.add(s)
                    rec["digest_differs"] = True
                if s < newest:
                    below = sorted(g for g in self.good if g < newest)
                    if walk_back_ok and below and s == below[-1]:
                        self.walked_back = True
                    else:
                        self.lost.update(g for g in self.good if g > s)
                self.loads.append(rec)

    def final(self, root: Path, keep: int | None = None) -> dict:
        from scout_ckpt.ledger import Ledger

        states = {}
        if (root / "scout-ledger.db").exists():
            with Ledger.open(root, readonly=True) as led:
                states = {c["step"]: c["state"] for c in led.checkpoints()}
        dirs = {int(p.name.split("-")[1]): p for p in root.glob("step-*") if p.is_dir()}
        disk = {s: disk_digest(p) for s, p in sorted(dirs.items())}
        certified = sorted(s for s, st in states.items() if st == "certified")
        for s in certified:
            if disk.get(s) is None or disk[s] != self.saved.get(s):
                self.wrong.add(s)
        must_keep = sorted(self.good)[-keep:] if keep else sorted(self.good)
        for s in must_keep:
            if s not in certified or disk.get(s) != self.saved.get(s):
                self.lost.add(s)
        rc, out, err = _cli("resume", root, "--latest-clean", "--json")
        resume = json.loads(out)["step"] if rc == 0 and out.strip() else None
        if resume is not None and disk.get(resume) != self.saved.get(resume):
            self.wrong.add(resume)
        newest = max(self.good, default=0)
        if (resume or 0) < newest:
            self.lost.update(g for g in self.good if g > (resume or 0))
        return {
            "states": {str(k): v for k, v in sorted(states.items())},
            "resume_latest_clean": resume,
            "resume_rc": rc,
            "resume_err": err.strip().splitlines()[-1:] if rc else [],
            "leftover_tmp": sorted(p.name for p in root.glob(".step-*")),
            "disk_matches": {str(s): disk[s] is not None and disk[s] == self.saved.get(s) for s in disk},
        }


# ---- the base run -------------------------------------------------------------------------------------------


_BASE_LOCK = threading.Lock()


def _base(work: Path) -> tuple[Path, dict[int, str]]:
    """One real run of the job (steps 5..20 certified), made once per campaign; incidents start from copies."""
    base = work / "murphy-base"
    with _BASE_LOCK:
        done = base / "oracle.json"
        if not done.exists():
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            res = _run_job(work, base / "run", BASE_STEPS)
            saved = {e["step"]: e["digest"] for e in res["events"] if e["event"] == "saved"}
            if res["rc"] != 0 or sorted(saved) != list(range(SAVE_EVERY, BASE_STEPS + 1, SAVE_EVERY)):
                raise RuntimeError(
                    f"the base run of {SCRIPT.name} failed: rc={res['rc']} {res['error']}\n{res['stderr_tail']}"
                )
            done.write_text(json.dumps({str(k): v for k, v in saved.items()}))
        return base / "run", {int(k): v for k, v in json.loads(done.read_text()).items()}


def _start(inc: dict, work: Path, dest: Path | None = None) -> tuple[Path, Oracle]:
    src, saved = _base(work)
    root = dest or (work / inc["id"] / "run")
    shutil.copytree(src, root)
    return root, Oracle(saved)


def _outcome(*gens: dict) -> str:
    for g in gens:
        if g["rc"] != 0:
            line = g.get("error") or "?"
            return ("refused: " if line.startswith("scout_ckpt") else "crashed: ") + line
    return "finished"


def _record(inc: dict, oracle: Oracle, final: dict, outcome: str, fired: bool, wall: float, **extra) -> dict:
    wrong, lost = sorted(oracle.wrong), sorted(oracle.lost)
    handled = not wrong and not lost and not oracle.fresh_starts and outcome.split(":")[0] in ("finished", "refused")
    return {
        "id": inc["id"],
        "kind": inc["kind"],
        "ranks": RANKS,
        "fired": fired,
        "detected": handled,
        "blamed": [],
        "truth": [],
        "latency_s": None,
        "wall_s": round(wall, 1),
        "wrongly_certified": len(wrong),
        "wrongly_certified_steps": wrong,
        "good_lost": len(lost),
        "good_lost_steps": lost,
        "outcome": outcome,
        "fresh_start_over_checkpoints": oracle.fresh_starts,
        "walked_back": oracle.walked_back,
        "loads": oracle.loads,
        "resume_step": final.get("resume_latest_clean"),
        "no_resume": final.get("resume_latest_clean") is None,
        "bad_resume": bool(wrong),
        "bad_resume_detail": [f"certified or loaded with other state: {wrong}"] if wrong else [],
        "final": final,
        **extra,
    }


def _skipped(inc: dict, why: str) -> dict:
    return {
        "id": inc["id"],
        "kind": inc["kind"],
        "fired": False,
        "detected": False,
        "blamed": [],
        "truth": [],
        "latency_s": None,
        "wrongly_certified": 0,
        "good_lost": 0,
        "fresh_start_over_checkpoints": 0,
        "outcome": f"skipped: {why}",
        "bad_resume": False,
        "no_resume": False,
        "note": why,
    }


# ---- the kinds ----------------------------------------------------------------------------------------------


def _run_lost_ledger(inc: dict, work: Path) -> dict:
    t0 = time.monotonic()
    root, oracle = _start(inc, work)
    db = root / "scout-ledger.db"
    for side in ("-wal", "-shm"):
        (root / f"scout-ledger.db{side}").unlink(missing_ok=True)
    if inc["how"] == "deleted":
        db.unlink()
    else:
        db.write_bytes(b"")
    g = _run_job(work, root, 25)
    oracle.generation("restart", g)
    final = oracle.final(root)
    return _record(
        inc,
        oracle,
        final,
        _outcome(g),
        True,
        time.monotonic() - t0,
        how=inc["how"],
        restart={"rc": g["rc"], "wall_s": g["wall_s"], "error": g["error"]},
    )


def _run_transient_eio(inc: dict, work: Path) -> dict:
    t0 = time.monotonic()
    root, oracle = _start(inc, work)
    shards = sorted(p for p in (root / "step-00000020").iterdir() if p.suffix == ".distcp")
    target = shards[inc["shard"] % len(shards)]
    log = work / "murphy-faults.jsonl"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    g1 = _run_job(work, root, BASE_STEPS, save_every=1000, env={"SCOUT_MURPHY_EIO_FILE": os.path.realpath(target)})
    hits = [json.loads(ln) for ln in log.read_text().splitlines()[before:]] if log.exists() else []
    hits = [h for h in hits if h["what"] == "eio"]
    oracle.generation("eio-restart", g1, walk_back_ok=True)
    rc, out, err = _cli("gc", root, "--keep", KEEP, "--json")
    gc = json.loads(out) if rc == 0 and out.strip() else {"rc": rc, "err": err.strip()[-300:]}
    g2 = _run_job(work, root, 25)
    oracle.generation("next", g2)
    final = oracle.final(root, keep=KEEP)
    return _record(
        inc,
        oracle,
        final,
        _outcome(g1, g2),
        bool(hits),
        time.monotonic() - t0,
        eio_file=target.name,
        eio_hits=len(hits),
        gc_deleted=gc.get("delete"),
        generations=[{"rc": g["rc"], "wall_s": g["wall_s"], "error": g["error"]} for g in (g1, g2)],
    )


def _mount_tmpfs(where: Path) -> str | None:
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(where)], capture_output=True, text=True
    )
    return None if p.returncode == 0 else (p.stderr.strip() or f"mount exited {p.returncode}")


def _run_enospc(inc: dict, work: Path) -> dict:
    t0 = time.monotonic()
    mnt = work / inc["id"] / "tmpfs"
    why = _mount_tmpfs(mnt)
    if why:
        return _skipped(inc, f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {why}")
    try:
        root, oracle = _start(inc, work, dest=mnt / "run")
        ballast = mnt / "other-tenant.bin"
        log = work / "murphy-faults.jsonl"
        before = len(log.read_text().splitlines()) if log.exists() else 0
        g1 = _run_job(
            work, root, 30, max_restarts=1, env={"SCOUT_MURPHY_FILL_AT": f".step-00000025|{ballast}|{FILL_LEAVE}"}
        )
        fills = [json.loads(ln) for ln in log.read_text().splitlines()[before:]] if log.exists() else []
        fills = [f for f in fills if f["what"] == "fill"]
        oracle.generation("full-disk", g1)
        full_outcome = _outcome(g1)
        ballast.unlink(missing_ok=True)  # the operator frees the space
        g2 = _run_job(work, root, 30)
        oracle.generation("after", g2)
        final = oracle.final(root)
        return _record(
            inc,
            oracle,
            final,
            full_outcome,
            bool(fills),
            time.monotonic() - t0,
            fills=len(fills),
            after_space_freed=_outcome(g2),
            generations=[{"rc": g["rc"], "wall_s": g["wall_s"], "error": g["error"]} for g in (g1, g2)],
        )
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


def _run_clock_skew(inc: dict, work: Path) -> dict:
    t0 = time.monotonic()
    root, oracle = _start(inc, work)
    g1 = _run_job(work, root, 30, env={"SCOUT_MURPHY_CLOCK_SKEW_S": str(inc["skew_s"])})
    oracle.generation("skewed", g1)
    g2 = _run_job(work, root, 35)
    oracle.generation("true-clock", g2)
    final = oracle.final(root)
    return _record(
        inc,
        oracle,
        final,
        _outcome(g1, g2),
        True,
        time.monotonic() - t0,
        skew_s=inc["skew_s"],
        generations=[{"rc": g["rc"], "wall_s": g["wall_s"], "error": g["error"]} for g in (g1, g2)],
    )


def _in_flight(gc_doc: dict | None) -> bool:
    if not gc_doc:
        return False
    return "save in flight" in (gc_doc.get("reasons") or {}).values() or any(
        p.get("alive") for p in gc_doc.get("partial") or []
    )


def _run_gc_resave(inc: dict, work: Path) -> dict:
    t0 = time.monotonic()
    root, oracle = _start(inc, work)
    shard = max(
        (p for p in (root / "step-00000020").iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )
    os.truncate(shard, shard.stat().st_size // 2)  # the restart's load must reject 20 and walk back to 15
    oracle.damage(20)
    job = Job(work, root, 25, env={"SCOUT_MURPHY_SLOW_PUBLISH_S": str(SLOW_PUBLISH_S)})
    loop, seen = _cli_loop(job, "gc", root, "--keep", KEEP, "--json")
    g = job.wait()
    loop.join(timeout=180)
    oracle.generation("resave", g)
    _cli("gc", root, "--keep", KEEP, "--json")
    final = oracle.final(root, keep=KEEP)
    raced = sum(1 for s in seen if _in_flight(s["doc"]))
    deleted = sorted({d for s in seen if s["doc"] for d in s["doc"].get("delete") or []})
    return _record(
        inc,
        oracle,
        final,
        _outcome(g),
        raced > 0,
        time.monotonic() - t0,
        gc_runs=len(seen),
        gc_saw_in_flight=raced,
        gc_deleted=deleted,
        gc_errors=[s["err"] for s in seen if s["rc"] not in (0,)],
        restart={"rc": g["rc"], "wall_s": g["wall_s"], "error": g["error"]},
    )


def _unshare_works() -> str | None:
    try:
        p = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if p.returncode == 0 else (p.stderr.strip() or f"unshare exited {p.returncode}")


def _run_second_container(inc: dict, work: Path) -> dict:
    t0 = time.monotonic()
    why = _unshare_works()
    if why:
        return _skipped(inc, f"cannot make a PID namespace here (unshare --pid needs root): {why}")
    root, oracle = _start(inc, work)
    log = work / "murphy-faults.jsonl"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    job = Job(
        work,
        root,
        30,
        env={"SCOUT_MURPHY_SLOW_PUBLISH_S": str(SLOW_PUBLISH_S)},
        prefix=("unshare", "--pid", "--fork", "--mount-proc"),
    )
    loop, seen = _cli_loop(job, "certify", root, "--json")
    g = job.wait()
    loop.join(timeout=180)
    oracle.generation("other-pid-namespace", g)
    final = oracle.final(root)
    publishes = [json.loads(ln) for ln in log.read_text().splitlines()[before:]] if log.exists() else []
    windows = [(f["time"], f["time"] + SLOW_PUBLISH_S) for f in publishes if f["what"] == "slow_publish"]
    overlapped = sum(1 for s in seen if any(s["start"] < w1 and s["end"] > w0 for w0, w1 in windows))
    writing = sum(
        1 for s in seen if s["doc"] and any(r.get("state") == "writing" for r in s["doc"].get("results") or [])
    )
    interrupted = sorted(
        {r["step"] for s in seen if s["doc"] for r in s["doc"].get("results") or [] if r.get("state") == "rejected"}
    )
    return _record(
        inc,
        oracle,
        final,
        _outcome(g),
        overlapped > 0,
        time.monotonic() - t0,
        certify_runs=len(seen),
        certify_during_a_save=overlapped,
        certify_saw_writing=writing,
        certify_rejected=interrupted,
        restart={"rc": g["rc"], "wall_s": g["wall_s"], "error": g["error"]},
    )


# ---- the fast tier's kinds ------------------------------------------------------------------------------------
#
# A 2-rank DDP job as two nodes (LOCAL_WORLD_SIZE=1, each rank its own node-local directory, its peer copy on the
# other node): local saves at 2, 4, 6, durable saves at 3 and 6, the job's own digest at every step (the workers
# of tests/workers_one_truth.py, run on real gloo ranks by scout_ckpt.testing.launch). Each incident lowers or hides
# steps by real means and restarts; judged by the digests the job printed:
#
#   local_quarantine      `scout-ckpt quarantine` of step 6 (both tiers) and of step 4 (held by the fast tier
#                         only): the restart must load durable step 3.
#   tier_revocation       a shard update fault found at step 7 with a cycle of 2 (ShardEvidence.revoke): step 6 in
#                         both tiers is in its window; the restart must load local step 4.
#   eio_every_candidate   every step folder and node-local file answers EIO at the restart: it must refuse (not
#                         start from step 0) and reject nothing; the next restart (storage back) loads step 6.
#   local_verdict_race    step 2's local save holds a NaN, its commit slowed by 2 s; the durable save of step 3
#                         descends from it and must not be certified.
#
# wrongly_certified: a restart loaded a lowered step, or a digest other than the one printed at the step it
# loaded, or a durable save descending from a bad local save was certified. good_lost: a restart loaded an older
# step than the newest one nothing lowered, or a step was rejected that nothing damaged. fresh_start_over_checkpoints:
# a restart that returned no step while checkpoints existed.

TIER_ENV = {"LOCAL_WORLD_SIZE": "1"}
if str(REPO) not in sys.path:  # the workers are importable from the repo root (tests/workers_one_truth.py)
    sys.path.insert(0, str(REPO))


def _tiers_base(work: Path) -> tuple[Path, Path, dict[int, str]]:
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_one_truth as w

    base = work / "murphy-tiers-base"
    with _BASE_LOCK:
        done = base / "oracle.json"
        if not done.exists():
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            out = run_ranks(w.tiers_job, RANKS, str(base / "run"), str(base / "local"), timeout=600, env=TIER_ENV)
            done.write_text(json.dumps(out[0].result["digests"]))
        return base / "run", base / "local", {int(k): v for k, v in json.loads(done.read_text()).items()}


def _tiers_start(inc: dict, work: Path) -> tuple[Path, Path, dict[int, str]]:
    run, local, printed = _tiers_base(work)
    dest = work / inc["id"]
    shutil.copytree(run, dest / "run")
    shutil.copytree(local, dest / "local")
    return dest / "run", dest / "local", printed


def _tiers_restart(root: Path, local: Path, eio: bool = False) -> dict:
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_one_truth as w

    out = run_ranks(
        w.tiers_restart_eio if eio else w.tiers_restart,
        RANKS,
        str(root),
        str(local),
        timeout=600,
        env=TIER_ENV,
        allow_failures=True,
    )
    results = [o.result or {"crashed": o.error} for o in out]
    return results[0] if all(r == results[0] for r in results) else {"ranks_disagree": results}


def _tiers_record(
    inc: dict, t0: float, restart: dict, expect: int, printed: dict[int, str], lowered: set[int], **extra
) -> dict:
    loaded = restart.get("loaded")
    wrong = sorted({loaded} & lowered) if loaded is not None else []
    if loaded and restart.get("digest") != printed.get(loaded):
        wrong = sorted(set(wrong) | {loaded})
    lost = sorted(s for s in printed if loaded is not None and loaded < s <= expect and s not in lowered)
    fresh = int("loaded" in restart and not loaded)
    outcome = (
        "finished"
        if "loaded" in restart
        else f"refused: {restart['refused']}"
        if "refused" in restart
        else f"crashed: {str(restart)[:300]}"
    )
    handled = not wrong and not lost and not fresh and not outcome.startswith("crashed")
    return {
        "id": inc["id"],
        "kind": inc["kind"],
        "ranks": RANKS,
        "fired": True,
        "detected": handled,
        "blamed": [],
        "truth": [],
        "latency_s": None,
        "wall_s": round(time.monotonic() - t0, 1),
        "wrongly_certified": len(wrong),
        "wrongly_certified_steps": wrong,
        "good_lost": len(lost),
        "good_lost_steps": lost,
        "fresh_start_over_checkpoints": fresh,
        "outcome": outcome,
        "resume_step": loaded,
        "no_resume": loaded is None,
        "bad_resume": bool(wrong),
        "bad_resume_detail": [f"loaded a lowered step or other state: {wrong}"] if wrong else [],
        "restart": restart,
        **extra,
    }


def _run_local_quarantine(inc: dict, work: Path) -> dict:
    t0 = time.monotonic()
    root, local, printed = _tiers_start(inc, work)
    rcs = [_cli("quarantine", root, s, "--reason", "campaign")[0] for s in (6, 4)]
    got = _tiers_restart(root, local)
    return _tiers_record(inc, t0, got, 3, printed, {4, 6}, quarantine_rc=rcs)


def _run_tier_revocation(inc: dict, work: Path) -> dict:
    from types import SimpleNamespace

    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save.evidence.shard import ShardEvidence

    t0 = time.monotonic()
    root, local, printed = _tiers_start(inc, work)
    shard = ShardEvidence.__new__(ShardEvidence)
    shard.log = SimpleNamespace(cycle=2)
    with Ledger.open(root) as led:
        revoked = shard.revoke(
            led,
            root,
            [{"step": 7, "status": "fail", "ranks": [1], "reasons": [{"code": "shard_replay_mismatch", "ranks": [1]}]}],
        )
    got = _tiers_restart(root, local)
    return _tiers_record(inc, t0, got, 4, printed, {6}, revoked=revoked)


def _run_eio_every_candidate(inc: dict, work: Path) -> dict:
    t0 = time.monotonic()
    root, local, printed = _tiers_start(inc, work)
    during = _tiers_restart(root, local, eio=True)
    after = _tiers_restart(root, local)
    rec = _tiers_record(inc, t0, after, 6, printed, set(), during=during)
    if "loaded" in during:  # the outage was answered with a start: from step 0, or from a step it could read
        rec["fresh_start_over_checkpoints"] += int(not during["loaded"])
        rec["detected"] = False
    return rec


def _run_local_verdict_race(inc: dict, work: Path) -> dict:
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_one_truth as w

    t0 = time.monotonic()
    dest = work / inc["id"]
    out = run_ranks(w.local_verdict_races_durable_save, RANKS, str(dest / "run"), str(dest / "local"), timeout=600)
    r = out[0].result
    certified = r["durable"]["state"] == "certified"
    return {
        "id": inc["id"],
        "kind": inc["kind"],
        "ranks": RANKS,
        "fired": r["local"]["state"] == "rejected",
        "detected": not certified,
        "blamed": [],
        "truth": [],
        "latency_s": None,
        "wall_s": round(time.monotonic() - t0, 1),
        "wrongly_certified": int(certified),
        "wrongly_certified_steps": [3] if certified else [],
        "good_lost": 0,
        "fresh_start_over_checkpoints": 0,
        "outcome": "finished",
        "bad_resume": False,
        "no_resume": False,
        "durable": r["durable"],
        "local": r["local"],
    }


# ---- plans --------------------------------------------------------------------------------------------------


def _plan_lost_ledger(i, rng, world_sizes):
    return {"how": ("deleted", "truncated")[i % 2]}


def _plan_eio(i, rng, world_sizes):
    return {"shard": rng.randrange(RANKS)}


def _plan_none(i, rng, world_sizes):
    return {}


def _plan_skew(i, rng, world_sizes):
    return {"skew_s": (SKEW_S, -SKEW_S)[i % 2]}


def _no_fp(h: dict) -> bool:
    return False  # no Murphy detector runs on a healthy control


SCENARIOS = {
    "lost_ledger": {"plan": _plan_lost_ledger, "run": _run_lost_ledger, "false_positive": _no_fp},
    "transient_eio": {"plan": _plan_eio, "run": _run_transient_eio, "false_positive": _no_fp},
    "enospc": {"plan": _plan_none, "run": _run_enospc, "false_positive": _no_fp},
    "clock_skew": {"plan": _plan_skew, "run": _run_clock_skew, "false_positive": _no_fp},
    "gc_resave": {"plan": _plan_none, "run": _run_gc_resave, "false_positive": _no_fp},
    "second_container": {"plan": _plan_none, "run": _run_second_container, "false_positive": _no_fp},
    "local_quarantine": {"plan": _plan_none, "run": _run_local_quarantine, "false_positive": _no_fp},
    "tier_revocation": {"plan": _plan_none, "run": _run_tier_revocation, "false_positive": _no_fp},
    "eio_every_candidate": {"plan": _plan_none, "run": _run_eio_every_candidate, "false_positive": _no_fp},
    "local_verdict_race": {"plan": _plan_none, "run": _run_local_verdict_race, "false_positive": _no_fp},
}


if __name__ == "__main__":  # one kind by hand: python bench/campaign_murphy.py KIND [WORKDIR]
    kind = sys.argv[1]
    import random

    work = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp(prefix="scout-murphy-"))
    inc = {"kind": kind, "id": f"{kind}-0", **SCENARIOS[kind]["plan"](0, random.Random(0), (3,))}
    print(json.dumps(SCENARIOS[kind]["run"](inc, work), indent=1, default=str))
