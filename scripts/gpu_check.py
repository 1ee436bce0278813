#!/usr/bin/env python3
"""The GPU proof: scout-ckpt's device checks in one command, on a machine with one CUDA GPU (docs/gpu.md).

    python scripts/gpu_check.py [--device cuda|cpu] [--out FILE] [--wheels DIR] [--no-install] [--only S,...]
                                [--replays N]

Every stage runs real processes on the device and is judged by an oracle of its own (a job's printed sha256 of its
state, computed without scout-ckpt; the CLI's JSON; NVML's own readings; a timed device copy). Stages, in order:

  env       the device, torch, CUDA, driver and Python
  install   the distributions this Python lacks, from the wheel folder (`pip install --no-deps --no-index
            --find-links DIR --target .gpu-check/site`), then the project itself the same way: the machine's torch
            is never touched, nothing is downloaded (`make gpu-wheels` fills DIR beforehand, on a machine with network)
  tests     the suite's CUDA tests (`pytest -m cuda tests/test_cuda*.py`) with SCOUT_REQUIRE_GPU=1: a skip fails
  resume_1  a one-GPU job under torchrun saves, is SIGKILLed, restarts and loads exactly the state it saved, and ends
            where an uninterrupted run of it ends (its own digests)
  resume_2  the same with two processes sharing the GPU over gloo with CUDA tensors (NCCL refuses two ranks on one
            device)
  bitflip   one bit of resume_1's newest checkpoint flipped on disk: `scout-ckpt resume --latest-clean` walks past it
  sdc       three processes on the GPU, one computing a block wrongly from step S: replay rejects the first save at or
            after S and names that rank
  replay    N replays (100) of captured live steps of the demo transformer's pieces on the device, under the default
            settings, determinism.enable() and enable(warn_only=False) (replay/determinism.py): no replay differs
            from its live step or from another replay
  nvml      the health source on the real device: what it reads, the events of its polls, the raw recording (the
            same form as tests/data/nvml/), replayed through the parsing to the same readings
  bench     bench/signature_throughput.py --device cuda --json: the signature's GB/s over a device-to-device copy's
            in the same run (goal >= 0.5)

The results file (--out, JSON) holds every stage's outcome and figures, written after each stage, for
docs/benchmarks.md. Exit 0: every stage passed; 1: some stage failed; 2: nothing could run here (no CUDA device, no
torch, a missing wheel folder, a bad option), said in one line on stderr. `--device cpu` runs the same stages on
the host (nvml is skipped; the bench runs as a smoke test): the CPU tests use it. `--budget-s` (480) bounds the
whole run: no subprocess outlives it, and a stage that would start past it fails as out of time.

The script is also its own job (`job`), replay probe (`replays`) and NVML probe (`nvml-probe`), run as
subprocesses, so that the whole check is this one file.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITE = REPO / ".gpu-check" / "site"
NO_SITE = "SCOUT_GPU_CHECK_NO_SITE"  # set by --no-install: this Python's packages as they are, in every subprocess
TAG = "GPU-CHECK "
DEADLINE: list[float] = []  # monotonic time by which every stage must be done (--budget-s): no subprocess outlives it
STAGES = ("env", "install", "tests", "resume_1", "resume_2", "bitflip", "sdc", "replay", "nvml", "bench")


class Refused(Exception):
    """Nothing can run here: one line on stderr, exit 2."""


# ---- the launch plan (pure: tested on CPU with a fake device count) ----------------------------------------------


def launch_plan(nproc: int, device: str, device_count: int) -> dict:
    """How `nproc` local ranks run on `device` ("cuda" or "cpu") with `device_count` GPUs: the backend (gloo
    always: NCCL refuses two ranks on one GPU, and one backend keeps the one- and two-process jobs alike; gloo
    moves CUDA tensors through host memory), each local rank's device (round-robin over the GPUs), and whether
    ranks share a GPU. Raises Refused when `device` is cuda and there is none."""
    if nproc < 1:
        raise Refused(f"need at least one process (got {nproc})")
    if device == "cpu":
        return {"backend": "gloo", "devices": ["cpu"] * nproc, "shared": False}
    if device != "cuda":
        raise Refused(f"--device must be cuda or cpu (got {device!r})")
    if device_count < 1:
        raise Refused("no CUDA device")
    return {
        "backend": "gloo",
        "devices": [f"cuda:{r % device_count}" for r in range(nproc)],
        "shared": nproc > device_count,
    }


def torchrun_command(nproc: int, max_restarts: int, job_args: list[str]) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`) running this script's `job` on `nproc` local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        str(Path(__file__).resolve()),
        "job",
        *job_args,
    ]


def child_env(extra: dict | None = None) -> dict:
    """The environment of every subprocess: the checkout first on the path (tests/ and bench/ import from it), then
    the folder the install stage filled; one thread per rank; torchrun's restarts made reliable (docs/integrate.md)."""
    env = dict(os.environ)
    path = [str(REPO)] + ([str(SITE)] if SITE.is_dir() and os.environ.get(NO_SITE) != "1" else [])
    path += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    env.update(extra or {})
    return env


def tagged(text: str) -> list[dict]:
    """The `GPU-CHECK {json}` records a job or probe printed, in order. Every rank of a job writes to the same
    pipe, so a record is read wherever its tag is, not only at a line's start: another rank's record or a warning
    may share its line."""
    out = []
    dec = json.JSONDecoder()
    for chunk in text.split(TAG)[1:]:
        try:
            out.append(dec.raw_decode(chunk)[0])
        except ValueError:
            pass
    return out


def run(
    cmd: list[str], timeout: float, log: Path | None = None, env: dict | None = None, stdout_only: bool = False
) -> tuple[int, str]:
    """A subprocess to its end (killed as a group past `timeout`): (return code, its stdout and stderr together,
    or with `stdout_only` its stdout alone: a command's --json document). Both go to `log`."""
    if DEADLINE:
        timeout = max(1.0, min(timeout, DEADLINE[0] - time.monotonic()))
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stdout_only else subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=env or child_env(),
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        err = (err or "") + f"\n[gpu-check: killed after {timeout:.0f} s]"
        p.returncode = 124
    err = err or ""
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out + err)
    return p.returncode, out if stdout_only else out + err


# ---- the job (under torchrun) ------------------------------------------------------------------------------------


def state_digest(model, opt) -> str:
    """sha256 of the model's tensors and the optimizer's state, in name order, computed without scout-ckpt: the
    job's own oracle (bytes copied to the host)."""
    import torch

    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}.{k}".encode())
            if torch.is_tensor(v):
                h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def say(event: str, **fields) -> None:
    # one write per record: print() writes the text and its newline apart when stdout is unbuffered (the job runs
    # with PYTHONUNBUFFERED=1), and another rank's record then lands between them on the shared pipe
    sys.stdout.write(TAG + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def job(argv: list[str]) -> int:
    """One rank of the check's training job: the demo's tiny transformer on this rank's device, gradients averaged
    by explicit all_reduce over gloo (CUDA tensors), the Checkpointer's defaults (consensus off on one rank, which
    has no replica to compare); prints its digest at every save,
    after loading and at the end; SIGKILLs itself at --kill-step in the first attempt; computes one Linear wrongly
    from --sdc-step on --sdc-rank (the demo's persistent fault)."""
    ap = argparse.ArgumentParser(prog="gpu_check.py job")
    ap.add_argument("root")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--sdc-rank", type=int, default=-1)
    ap.add_argument("--sdc-step", type=int, default=-1)
    ap.add_argument("--sdc-layer", default="blocks.1.mlp.fc1")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="determinism.enable(warn_only=False): the whole step deterministic, live gradients signed",
    )
    a = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from scout_ckpt import Checkpointer, LiveStateCorrupt, ModelOptimizerState
    from scout_ckpt.demo.model import TinyTransformer, sdc_target, set_sdc
    from scout_ckpt.replay import determinism

    if a.deterministic:  # before the first CUDA matmul: the cuBLAS workspace size is read once
        determinism.enable(warn_only=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    count = torch.cuda.device_count() if a.device == "cuda" else 0
    plan = launch_plan(int(os.environ.get("LOCAL_WORLD_SIZE", world)), a.device, count)
    dev = torch.device(plan["devices"][local])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = TinyTransformer(vocab=256, d_model=64, n_heads=4, n_blocks=2, seq_len=32).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # one rank has no replica to compare: consensus off there, or no save is ever certified (docs/gpu.md)
    ckpt = Checkpointer(a.root, model=model, optimizer=opt, consensus=world > 1)
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    say(
        "loaded",
        rank=rank,
        attempt=attempt,
        step=start,
        digest=state_digest(model, opt),
        device=str(dev),
        plan=plan,
        comparison=determinism.comparison(dev),
    )
    rc = 0
    try:
        for step in range(start + 1, a.steps + 1):
            if a.sdc_step > 0 and rank == a.sdc_rank and step >= a.sdc_step and sdc_target() is None:
                set_sdc(a.sdc_layer, -1)
                say("sdc", rank=rank, attempt=attempt, step=step, layer=a.sdc_layer)
            g = torch.Generator().manual_seed(1_000_003 * step + rank)  # the data of a step: the same after a restart
            tokens = torch.randint(0, 256, (8, 32), generator=g).to(dev)
            # cross entropy by hand: torch has no deterministic NLLLoss on CUDA, and strict mode refuses it
            logp = torch.log_softmax(model(tokens)[:, :-1].float(), dim=-1)
            loss = -logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).mean()
            opt.zero_grad()
            loss.backward()
            if world > 1:
                for p in model.parameters():  # gloo all_reduce of CUDA tensors, in a fixed order
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            opt.step()
            ckpt.step(step)
            if attempt == 0 and rank == a.kill_rank and step == a.kill_step:
                say("crash", rank=rank, attempt=attempt, step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            if step % a.save_every == 0:
                try:
                    verdict = ckpt.save(step, state)
                except LiveStateCorrupt as e:
                    say("live_fault", rank=rank, attempt=attempt, step=step, error=str(e)[:500])
                    rc = 3
                    break
                say(
                    "saved",
                    rank=rank,
                    attempt=attempt,
                    step=step,
                    digest=state_digest(model, opt),
                    state=verdict.get("state"),
                    reasons=[r.get("code") for r in verdict.get("reasons", [])],
                )
        else:
            say("final", rank=rank, attempt=attempt, step=a.steps, digest=state_digest(model, opt))
    finally:
        ckpt.close()
        dist.barrier()  # before destroy_process_group: a rank can hang in it without one (README)
        dist.destroy_process_group()
    return rc


# ---- the probes (subprocesses) -----------------------------------------------------------------------------------


def replays_probe(argv: list[str]) -> int:
    """`replays`: replay.repeat.repeat_check on the demo transformer's embedding, blocks (with and without bf16
    autocast) and head on the device, under --settings: the defaults, determinism.enable() (`deterministic`), or
    determinism.enable(warn_only=False) (`strict`, the live gradients signed too)."""
    ap = argparse.ArgumentParser(prog="gpu_check.py replays")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--settings", choices=("default", "deterministic", "strict"), default="default")
    a = ap.parse_args(argv)
    import torch

    from scout_ckpt.demo.model import TinyTransformer
    from scout_ckpt.replay import determinism
    from scout_ckpt.replay.repeat import repeat_check

    if a.settings != "default":  # before the first CUDA matmul
        determinism.enable(warn_only=a.settings == "deterministic")
    torch.set_num_threads(1)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = TinyTransformer(vocab=256, d_model=128, n_heads=4, n_blocks=2, seq_len=64).to(dev)
    tokens = torch.randint(0, 256, (8, 64), device=dev)
    x = torch.randn(8, 64, 128, device=dev, requires_grad=True)
    cases = {"embedding": (model.embedding, (tokens,)), "block": (model.blocks[0], (x,)), "head": (model.head, (x,))}
    out = {}
    for name, (mod, args) in cases.items():
        out[name] = repeat_check(mod, args, a.n)
    if dev.type == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out["block_bf16_autocast"] = repeat_check(model.blocks[1], (x,), a.n)
    say("replays", device=str(dev), n=a.n, cases=out, settings=determinism.settings(dev).as_dict())
    return 0


def nvml_probe(argv: list[str]) -> int:
    """`nvml-probe`: the observer's NVML source on GPU 0 through a recorder: availability, the metrics it reads
    and drops, the events of two polls, the recording, and the same polls replayed from the recording."""
    from scout_ckpt.observer.health import NvmlHealthSource, NvmlRecorder, RecordedNvml

    try:
        import pynvml
    except ImportError as e:
        say("nvml", available=False, error=f"pynvml not importable: {e}")
        return 0
    rec = NvmlRecorder(pynvml)
    src = NvmlHealthSource(0, nvml=rec)
    if not src.available:
        say("nvml", available=False, calls=rec.calls)
        return 0
    polls = [src.poll(), src.poll()]
    readings = dict(src._last)
    about = {}
    for key, fn in (("device_name", "nvmlDeviceGetName"), ("driver", "nvmlSystemGetDriverVersion")):
        try:
            v = getattr(pynvml, fn)(src.handle) if fn.startswith("nvmlDevice") else getattr(pynvml, fn)()
            about[key] = v.decode() if isinstance(v, bytes) else v
        except Exception as e:  # noqa: BLE001 -- a name is a nicety, not a check
            about[key] = f"unavailable: {e}"
    recording = rec.recording(**about, source="scripts/gpu_check.py nvml-probe")
    again = NvmlHealthSource(0, nvml=RecordedNvml(json.loads(json.dumps(recording))))
    replayed = [again.poll(), again.poll()]
    say(
        "nvml",
        available=True,
        readings=readings,
        unsupported=sorted(src._unsupported),
        polls=polls,
        replayed_polls=replayed,
        replay_readings_equal=dict(again._last) == readings,
        recording=recording,
        **about,
    )
    return 0


# ---- the stages --------------------------------------------------------------------------------------------------


class Check:
    """The run: options, the results written after every stage, the work directory."""

    def __init__(self, a):
        self.a = a
        self.device = a.device
        self.work = REPO / ".gpu-check" / "runs" / time.strftime("%Y%m%dT%H%M%S")
        self.out = Path(a.out)
        self.results: dict = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": a.device,
            "logs": str(self.work),
            "stages": {},
        }

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        os.replace(tmp, self.out)

    def stage(self, name: str, fn) -> bool:
        t = time.monotonic()
        print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
        try:
            if name != "env" and DEADLINE and time.monotonic() > DEADLINE[0] - 5:
                res = {"ok": False, "why": f"out of time (--budget-s {self.a.budget_s:.0f})"}
            else:
                res = fn()
        except Refused:
            raise
        except Exception as e:  # noqa: BLE001 -- a stage that breaks is a failed stage; the others still run
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        res["seconds"] = round(time.monotonic() - t, 1)
        self.results["stages"][name] = res
        self.save()
        mark = {True: "passed", False: "FAILED", None: "skipped"}[res.get("ok")]
        print(
            f"gpu-check: {name} {mark} ({res['seconds']} s){': ' + res['why'] if res.get('why') else ''}",
            file=sys.stderr,
            flush=True,
        )
        return res.get("ok") is not False

    # -- env, install ----------------------------------------------------------------------------------------------

    def env(self) -> dict:
        import platform

        import torch

        info = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "host": platform.node(),
        }
        if self.device == "cuda":
            info.update(
                gpu=torch.cuda.get_device_name(0),
                gpus=torch.cuda.device_count(),
                capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            )
            try:
                smi = subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                info["driver"] = smi.stdout.strip()
            except (OSError, subprocess.SubprocessError):
                info["driver"] = None
        self.results["env"] = info
        return {"ok": True, **info}

    def install(self) -> dict:
        if self.a.no_install:
            return {"ok": None, "why": "--no-install"}
        from importlib import metadata

        wheels = Path(self.a.wheels)
        have = {
            re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in metadata.distributions() if d.metadata["Name"]
        }
        found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
        names = {re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower() for w in found}
        missing = sorted(names - have - {"scout-ckpt", "setuptools", "wheel", "torch"})
        needed = [m for m in ("sqlite-utils", "xxhash", "typer", "safetensors", "pytest") if m not in have]
        if needed and not found:
            raise Refused(
                f"this Python lacks {', '.join(needed)} and {wheels} holds no wheels: run `make gpu-wheels` "
                "on a machine with network and carry the folder (docs/gpu.md)"
            )
        SITE.mkdir(parents=True, exist_ok=True)
        pip = [
            sys.executable,
            "-m",
            "pip",
            "--isolated",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--find-links",
            str(wheels),
            "--target",
            str(SITE),
            "--upgrade",
        ]
        log = self.work / "install.log"
        if missing:
            rc, out = run(pip + missing, 600, log)
            if rc:
                return {
                    "ok": False,
                    "why": "pip could not install the missing wheels",
                    "missing": missing,
                    "tail": out[-2000:],
                }
        # the project: built by this Python's own setuptools where it can build a wheel alone (70.1 and later; a
        # pip-installed torch requires 77 or later), else in an isolated build environment from the carried wheel
        try:
            have_st = tuple(int(x) for x in metadata.version("setuptools").split(".")[:2])
        except (metadata.PackageNotFoundError, ValueError):
            have_st = (0, 0)
        build = ["--no-build-isolation"] if have_st >= (70, 1) else []
        rc, out = run(pip + build + [str(REPO)], 600, self.work / "install-project.log")
        return {
            "ok": rc == 0,
            "installed": missing,
            "already_there": sorted(names & have),
            "project": rc == 0,
            "site": str(SITE),
            **({} if rc == 0 else {"tail": out[-2000:]}),
        }

    # -- tests -----------------------------------------------------------------------------------------------------

    def tests(self) -> dict:
        xml = self.work / "cuda-tests.xml"
        env = child_env({"SCOUT_REQUIRE_GPU": "1"} if self.device == "cuda" else {})
        files = sorted(str(p.relative_to(REPO)) for p in REPO.glob("tests/test_cuda*.py"))
        rc, out = run(
            [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={xml}", *files],
            420,
            self.work / "cuda-tests.log",
            env,
        )
        counts = _junit_counts(xml)
        ok = rc == 0 if self.device == "cuda" else rc in (0, 5) and counts.get("failures", 0) == 0
        return {"ok": ok, "rc": rc, **counts, "tail": out[-1500:]}

    # -- the jobs --------------------------------------------------------------------------------------------------

    def _job(self, name: str, nproc: int, restarts: int, extra: list[str], timeout: float = 300) -> tuple[int, list]:
        root = self.work / name
        args = [str(root), "--device", self.device, "--deterministic", *extra]
        rc, out = run(torchrun_command(nproc, restarts, args), timeout, self.work / f"{name}.log")
        return rc, tagged(out)

    def resume(self, nproc: int) -> dict:
        """The job killed at step 10 (saves every 4): the restart must load step 8 with the digest printed when 8
        was saved, and end with the digest of the same job run without the kill."""
        tag = f"resume_{nproc}"
        rc, ev = self._job(
            tag, nproc, 1, ["--steps", "16", "--save-every", "4", "--kill-rank", str(nproc - 1), "--kill-step", "10"]
        )
        rc_ref, ref = self._job(f"{tag}_reference", nproc, 0, ["--steps", "16", "--save-every", "4"])
        saved8 = {e["rank"]: e["digest"] for e in ev if e["event"] == "saved" and e["attempt"] == 0 and e["step"] == 8}
        loaded = {e["rank"]: e for e in ev if e["event"] == "loaded" and e["attempt"] == 1}
        final = {e["rank"]: e["digest"] for e in ev if e["event"] == "final"}
        final_ref = {e["rank"]: e["digest"] for e in ref if e["event"] == "final"}
        crashed = [e for e in ev if e["event"] == "crash"]
        states = sorted({(e["step"], e["state"]) for e in ev if e["event"] == "saved"})
        checks = {
            "job_completed": rc == 0,
            "killed_once": len(crashed) == 1,
            "restart_loaded_step_8": sorted(loaded) == list(range(nproc))
            and all(e["step"] == 8 for e in loaded.values()),
            "loaded_digest_is_saved_digest": bool(saved8)
            and all(loaded.get(r, {}).get("digest") == d for r, d in saved8.items()),
            "final_equals_uninterrupted_run": rc_ref == 0 and bool(final) and final == final_ref,
            "every_save_certified": bool(states) and all(s == "certified" for _, s in states),
        }
        first = next(iter(loaded.values()), {})
        return {
            "ok": all(checks.values()),
            "checks": checks,
            "ranks": nproc,
            "plan": first.get("plan"),
            "comparison": first.get("comparison"),
            "saves": states,
            "root": str(self.work / tag),
        }

    def bitflip(self) -> dict:
        root = self.work / "resume_1"
        if not (root / "scout-ledger.db").exists():
            return {"ok": False, "why": "resume_1 left no checkpoints"}
        env = child_env()
        flip = [
            sys.executable,
            "-c",
            "import json,sys; from scout_ckpt.demo.faults import flip_file_bit; "
            "print(json.dumps(flip_file_bit(sys.argv[1], 16)))",
            str(root),
        ]
        rc, out = run(flip, 120, self.work / "bitflip.log", env, stdout_only=True)
        if rc:
            return {"ok": False, "why": "could not flip a bit", "tail": out[-1500:]}
        flipped = json.loads(out)
        rc, out = run(
            [sys.executable, "-m", "scout_ckpt.cli", "resume", str(root), "--latest-clean", "--json"],
            300,
            self.work / "bitflip-resume.log",
            env,
            stdout_only=True,
        )
        try:
            got = json.loads(out)
        except ValueError:
            return {"ok": False, "why": "resume printed no JSON", "tail": out[-1500:]}
        checks = {
            "resume_exit_0": rc == 0,
            "walked_past_step_16": got.get("step") == 12,
            "verified": bool(got.get("verified")),
        }
        return {"ok": all(checks.values()), "checks": checks, "flipped": flipped, "resume": got}

    def sdc(self) -> dict:
        """Three ranks, rank 2 computing blocks.1.mlp.fc1 wrongly from step 6 (saves every 4): step 4 certified,
        the save at 8 rejected by replay with rank 2 named, and the generation ended on every rank."""
        rc, ev = self._job(
            "sdc", 3, 0, ["--steps", "12", "--save-every", "4", "--sdc-rank", "2", "--sdc-step", "6"], timeout=360
        )
        root = self.work / "sdc"
        rc_ls, out = run(
            [sys.executable, "-m", "scout_ckpt.cli", "ls", str(root), "--json"],
            300,
            self.work / "sdc-ls.log",
            child_env(),
            stdout_only=True,
        )
        try:
            rows = {r["step"]: r for r in json.loads(out)["checkpoints"]}
        except (ValueError, KeyError):
            rows = {}
        r8 = rows.get(8, {})
        sdc_reasons = [x for x in r8.get("reasons", []) if x.get("code") == "replay_sdc"]
        faults = {e["rank"] for e in ev if e["event"] == "live_fault"}
        checks = {
            "step_4_certified": rows.get(4, {}).get("state") == "certified",
            "step_8_rejected": r8.get("state") == "rejected",
            "replay_sdc_names_rank_2": any(2 in (x.get("ranks") or []) for x in sdc_reasons),
            "generation_ended_on_every_rank": faults == {0, 1, 2},
        }
        return {
            "ok": all(checks.values()),
            "checks": checks,
            "job_rc": rc,
            "reasons_8": r8.get("reasons"),
            "comparison": sorted({x.get("comparison") for x in sdc_reasons if x.get("comparison")}),
        }

    # -- replay, nvml, bench ---------------------------------------------------------------------------------------

    def replay(self) -> dict:
        n = self.a.replays
        out: dict = {"replays": n}
        ok = True
        for mode in ("default", "deterministic", "strict"):
            args = [
                sys.executable,
                str(Path(__file__).resolve()),
                "replays",
                "--device",
                self.device,
                "-n",
                str(n),
                "--settings",
                mode,
            ]
            rc, text = run(args, 420, self.work / f"replays-{mode}.log")
            got = [e for e in tagged(text) if e["event"] == "replays"]
            if rc or not got:
                out[mode] = {"ok": False, "rc": rc, "tail": text[-1500:]}
                ok = False
                continue
            cases = got[0]["cases"]
            false_sdc = {k: sum(c["self_check_failed"].values()) + c["replays_differ"] for k, c in cases.items()}
            out[mode] = {"false_sdc": false_sdc, "comparison": got[0]["settings"]["comparison"], "cases": cases}
            ok = ok and not any(false_sdc.values())
        return {"ok": ok, **out}

    def nvml(self) -> dict:
        if self.device != "cuda":
            return {"ok": None, "why": "no GPU on --device cpu"}
        rc, text = run([sys.executable, str(Path(__file__).resolve()), "nvml-probe"], 120, self.work / "nvml.log")
        got = [e for e in tagged(text) if e["event"] == "nvml"]
        if rc or not got:
            return {"ok": False, "rc": rc, "tail": text[-1500:]}
        g = got[0]
        checks = {
            "available": bool(g.get("available")),
            "temperature_read": "temperature" in (g.get("readings") or {}),
            "recording_replays_to_the_same_readings": bool(g.get("replay_readings_equal")),
        }
        return {"ok": all(checks.values()), "checks": checks, **{k: v for k, v in g.items() if k != "event"}}

    def bench(self) -> dict:
        rc, text = run(
            [
                sys.executable,
                "bench/signature_throughput.py",
                "--device",
                self.device,
                "--json",
                "--mb",
                str(self.a.bench_mb),
                "--repeats",
                "5",
            ],
            300,
            self.work / "bench.log",
        )
        try:
            got = json.loads(text[text.index("{") : text.rindex("}") + 1])
        except ValueError:
            return {"ok": False, "rc": rc, "tail": text[-1500:]}
        fig = {
            k: got.get(k)
            for k in (
                "ratio",
                "ratios",
                "bandwidth_gb_per_s",
                "signature_gb_per_s",
                "gb_per_s",
                "median_s",
                "bytes",
                "device_name",
                "torch",
                "cuda",
                "target",
            )
        }
        met = got.get("target_met")
        return {"ok": rc == 0 and (met is not False), "target_met": met, **fig}


def _junit_counts(xml: Path) -> dict:
    try:
        text = xml.read_text()
    except OSError:
        return {}
    m = re.search(r"<testsuite [^>]*", text)
    if not m:
        return {}
    return {k: int(v) for k, v in re.findall(r'(tests|failures|errors|skipped)="(\d+)"', m.group(0))}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("job", "replays", "nvml-probe"):
        return {"job": job, "replays": replays_probe, "nvml-probe": nvml_probe}[argv[0]](argv[1:])
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=str(REPO / "gpu-check-results.json"))
    ap.add_argument("--wheels", default=str(REPO / "wheelhouse"))
    ap.add_argument("--no-install", action="store_true", help="use this Python's packages as they are")
    ap.add_argument("--only", default=None, help=f"comma-separated stages of {', '.join(STAGES)}")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--bench-mb", type=int, default=1024)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="every stage done within this many seconds (a stage past it fails, out of time)",
    )
    a = ap.parse_args(argv)
    only = STAGES if a.only is None else tuple(s.strip() for s in a.only.split(",") if s.strip())
    bad = [s for s in only if s not in STAGES]
    if bad:
        raise Refused(f"unknown stage {bad[0]!r} (stages: {', '.join(STAGES)})")
    if a.no_install:
        os.environ[NO_SITE] = "1"
    elif SITE.is_dir():  # what an earlier install put there (numpy, for one) serves this process too
        sys.path.append(str(SITE))
    try:
        import warnings

        with warnings.catch_warnings():  # e.g. "Failed to initialize NumPy" on a bare machine: not a refusal
            warnings.simplefilter("ignore")
            import torch
    except ImportError as e:
        raise Refused(
            f"torch is not importable with {sys.executable} ({e}); run it with the GPU machine's Python"
        ) from None
    if a.device == "cuda" and not torch.cuda.is_available():
        raise Refused(
            f"no CUDA device here (torch {torch.__version__}: torch.cuda.is_available() is False); nothing was run"
        )
    DEADLINE.append(time.monotonic() + a.budget_s)
    c = Check(a)
    steps = {
        "env": c.env,
        "install": c.install,
        "tests": c.tests,
        "resume_1": lambda: c.resume(1),
        "resume_2": lambda: c.resume(2),
        "bitflip": c.bitflip,
        "sdc": c.sdc,
        "replay": c.replay,
        "nvml": c.nvml,
        "bench": c.bench,
    }
    ok = True
    for name in STAGES:
        if name in only or name == "env":
            ok = c.stage(name, steps[name]) and ok
    c.results["ok"] = ok
    c.results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    c.save()
    print(f"gpu-check: {'every stage passed' if ok else 'some stage FAILED'}; results in {c.out}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Refused as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("gpu-check: interrupted", file=sys.stderr)
        sys.exit(130)
