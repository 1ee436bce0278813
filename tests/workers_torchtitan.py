"""Rank functions for tests/test_integration_torchtitan.py: TorchTitan's own optimizer container, LR schedulers and
checkpoint manager (subclassed by ScoutCheckpointManager) on a small replicated model, on real gloo ranks."""

import hashlib
import os
import signal

import torch
import torch.nn as nn


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def build(
    root: str, keep: int = 0, kill: tuple | None = None, async_mode: str = "disabled", corrupt_write: int | None = None
):
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from scout_ckpt.integrations.torchtitan import ScoutCheckpointManager

    class Killing(ScoutCheckpointManager):
        """SIGKILLs rank kill[0] in the middle of the save of step kill[1]: DCP wrote step-N, nothing certified."""

        @__import__("dataclasses").dataclass(kw_only=True, slots=True)
        class Config(ScoutCheckpointManager.Config):
            pass

        def _commit(self, step, *a):
            if kill and self.rank == kill[0] and step == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._commit(step, *a)

    class CorruptWrite(ScoutCheckpointManager):
        """On every rank DCP writes a weight one ulp off the live value the save's evidence signs (a fault in the
        staging path): the bytes written are self-consistent and certify; only the load-time signature check can
        tell."""

        @__import__("dataclasses").dataclass(kw_only=True, slots=True)
        class Config(ScoutCheckpointManager.Config):
            pass

        def dcp_save(self, state_dict, *a, **kw):
            if self.states["train_state"].step == corrupt_write:
                bad = state_dict["0.weight"].detach().clone()
                bad.view(-1)[0] = torch.nextafter(bad.view(-1)[0], torch.tensor(float("inf")))
                state_dict = {**state_dict, "0.weight": bad}
            return super().dcp_save(state_dict, *a, **kw)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = default_adamw(lr=1e-2).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=20)
    ts = TrainState()
    cls = Killing if kill else CorruptWrite if corrupt_write else ScoutCheckpointManager
    mgr = cls.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=keep, async_mode=async_mode).build(
        dataloader=None,
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=sched,
        states={"train_state": ts},
        sd_adapter=None,
        base_folder=root,
    )
    return model, opt, sched, ts, mgr


def fingerprint(model, opt) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for s in opt.optimizers[0].state.values():
        for k in sorted(s):
            h.update(s[k].detach().numpy().tobytes())
    return h.hexdigest()


def train(rank, world, root, steps, keep=0, kill=None, async_mode="disabled", corrupt_write=None):
    """Fresh or resumed (load(step=-1)) run up to `steps`, saving every step; returns what it saw."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's PROCESS-mode async (async_with_pinned_mem) needs it
    model, opt, sched, ts, mgr = build(root, keep, kill, async_mode, corrupt_write)
    loaded = mgr.load(step=-1)
    start = ts.step
    out = {"loaded": loaded, "load": mgr.loaded, "start": start, "fingerprints": {}, "verdicts": {}}
    if loaded:
        out["fingerprints"][start] = fingerprint(model, opt)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 8, generator=g) for _ in range(steps)]  # the same batches on every rank
    for step in range(start + 1, steps + 1):
        loss = model(data[step - 1]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ts.step = step
        mgr.save(step)
        out["fingerprints"][step] = fingerprint(model, opt)
        out["verdicts"][step] = dict(mgr.last_verdict or {})  # async: the previous step's, committed by now
    mgr.close()
    out["final"] = dict(mgr.last_verdict or {})
    return out


# ---- TorchTitan's own mesh: ParallelDims, TP and FSDP on 4 ranks --------------------------------------------------


class TitanState(TrainState):
    """Stands for TorchTitan's Trainer, which passes itself as `states["train_state"]` and holds `parallel_dims`."""

    def __init__(self, parallel_dims):
        super().__init__()
        self.parallel_dims = parallel_dims


def local_fingerprint(model, opt) -> str:
    """This rank's local shards of the parameters and optimizer state (an oracle independent of scout-ckpt)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to_local().numpy().tobytes())
    for s in opt.optimizers[0].state.values():
        for k in sorted(s):
            v = s[k].detach()
            h.update((v.to_local() if hasattr(v, "to_local") else v).numpy().tobytes())
    return h.hexdigest()


def build_mesh(dp_replicate: int, dp_shard: int, tp: int, world: int):
    """TorchTitan's ParallelDims and meshes on CPU. Two things TorchTitan assumes a GPU for: its device type falls
    back to "cuda" (set to "cpu"), and it puts mesh dims of size 1 on the "fake" backend, which torch registers in
    torch.testing._internal.distributed.fake_pg (no collective of the test or of scout-ckpt runs on those)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    import torchtitan.distributed.parallel_dims as pdm

    pdm.device_type = "cpu"
    pd = pdm.ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        cp=1,
        tp=tp,
        pp=1,
        ep=1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    pd.build_mesh()
    return pd


def build_tp(root: str, pd, keep: int = 0, implementation: str = "fused"):
    """A 2-layer MLP as TorchTitan's legacy path parallelizes: TP (colwise, rowwise) on the tp mesh, then FSDP2
    on (dp_replicate, fsdp) (HSDP when dp_replicate > 1); TorchTitan's optimizer, schedulers, and the manager."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from scout_ckpt.integrations.torchtitan import ScoutCheckpointManager

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    parallelize_module(model, pd.get_mesh("tp"), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=pd.get_mesh(["dp_replicate", "fsdp"] if pd.dp_replicate > 1 else "fsdp"))
    cfg = default_adamw(lr=1e-2)
    cfg.implementation = implementation
    opt = cfg.build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=20)
    ts = TitanState(pd)
    mgr = ScoutCheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=keep).build(
        dataloader=None,
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=sched,
        states={"train_state": ts},
        sd_adapter=None,
        base_folder=root,
    )
    return model, opt, sched, ts, mgr


def train_tp(rank, world, root, flip_rank=3, flip_step=2):
    """Two layouts on the 4 ranks. (a) dp_replicate 2 x tp 2: two steps saved, rank `flip_rank` flips a bit of its
    TP shard before the save of `flip_step`; then a fresh model loads step -1. (b) dp_shard 2 x tp 2 (FSDP over
    TP's dim 0: _StridedShard), a foreach AdamW so that shard evidence runs: one save."""
    out = {}
    pd = build_mesh(2, 1, 2, world)
    model, opt, sched, ts, mgr = build_tp(os.path.join(root, "a"), pd)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 8, generator=g) for _ in range(flip_step)]
    a = {"topology": mgr.topology, "fingerprints": {}, "verdicts": {}}
    for step in range(1, flip_step + 1):
        model(data[step - 1]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ts.step = step
        if step == flip_step and rank == flip_rank:
            w = model[0].weight.to_local()
            with torch.no_grad():
                w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")))
        a["fingerprints"][step] = local_fingerprint(model, opt)
        mgr.save(step)
        a["verdicts"][step] = dict(mgr.last_verdict)
    mgr.close()
    model, opt, sched, ts, mgr = build_tp(os.path.join(root, "a"), pd)
    a["loaded"] = mgr.load(step=-1)
    a["load"] = mgr.loaded
    a["start"] = ts.step
    a["after_load"] = local_fingerprint(model, opt)
    mgr.close()
    out["a"] = a
    pd = build_mesh(1, 2, 2, world)
    model, opt, sched, ts, mgr = build_tp(os.path.join(root, "b"), pd, implementation="foreach")
    model(data[0]).pow(2).mean().backward()
    opt.step()
    ts.step = 1
    mgr.save(1)
    out["b"] = {
        "topology": mgr.topology,
        "verdict": dict(mgr.last_verdict),
        "policy": mgr.scout_policy,
        "placements": {n: [type(p).__name__ for p in t.placements] for n, t in model.named_parameters()},
    }
    mgr.close()
    return out


# ---- FSDP2 on TorchTitan's mesh: replay and shard evidence in the manager ---------------------------------------


def build_fsdp(
    root: str, pd, *, interval: int = 2, fault: tuple | None = None, shard_evidence=None, async_mode: str = "disabled"
):
    """TorchTitan's pure-FSDP layout (dp_shard = world): a tiny LM with repeated blocks, `fully_shard` per block and
    at the root on its `fsdp` mesh, TorchTitan's AdamW container with implementation="foreach" (its default
    "fused" cannot be recomputed on a slice), its LR schedulers, and the manager at its defaults (replay and shard
    evidence on for FSDP). fault = (rank, from_step, param, index): from that step on, that rank's live AdamW
    update of one element of its shard lands one ulp off (a faulty ALU), inside the optimizer step."""
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from scout_ckpt.integrations.torchtitan import ScoutCheckpointManager
    from tests.workers_fsdp_evidence import TinyLM

    torch.manual_seed(0)
    model = TinyLM()
    mesh = pd.get_mesh("fsdp")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cfg = default_adamw(lr=1e-2)
    cfg.implementation = "foreach"
    opt = cfg.build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=20)
    ts = TitanState(pd)
    if fault is not None and fault[0] == torch.distributed.get_rank():
        _, since, pname, idx = fault

        def faulty(opt_, args, kwargs):  # registered before the manager's hooks: the evidence sees the bad update
            if ts.step + 1 >= since:
                with torch.no_grad():
                    t = dict(model.named_parameters())[pname].to_local().view(-1)
                    t[idx] = torch.nextafter(t[idx], torch.tensor(float("inf")))

        opt.optimizers[0].register_step_post_hook(faulty)
    extra = {} if shard_evidence is None else {"shard_evidence": shard_evidence}
    mgr = ScoutCheckpointManager.Config(
        enable=True, folder="ckpt", interval=interval, keep_latest_k=0, async_mode=async_mode, **extra
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=sched,
        states={"train_state": ts},
        sd_adapter=None,
        base_folder=root,
    )
    return model, opt, sched, ts, mgr


def _run_fsdp(root, pd, rank, steps, flip=None, **kw):
    """flip = (rank, step, param, index): that rank flips the lowest bit of one element of its shard after the
    optimizer step and before the save (a fault at rest)."""
    from tests.workers_fsdp_evidence import batch
    from tests.workers_fsdp_evidence import train_step as lm_step

    model, opt, sched, ts, mgr = build_fsdp(root, pd, **kw)
    mgr.load(step=-1)
    out = {
        "start": ts.step,
        "policy": mgr.scout_policy,
        "mode": mgr.mode,
        "verdicts": {},
        "fingerprints": {},
        "engines": [mgr.evidence.replay is not None, mgr.evidence.shard is not None],
    }
    out["fingerprints"][ts.step] = local_fingerprint(model, opt)
    for step in range(ts.step + 1, steps + 1):
        lm_step(model, opt, batch(step, rank))  # forward, backward, optimizer.step (the container), zero_grad
        sched.step()
        ts.step = step
        if flip and flip[0] == rank and flip[1] == step:
            with torch.no_grad():
                t = dict(model.named_parameters())[flip[2]].to_local().view(-1).view(torch.int32)
                t[flip[3]] ^= 1
        out["fingerprints"][step] = local_fingerprint(model, opt)
        mgr.save(step)  # TorchTitan's Trainer calls save() after every step; the manager saves on its interval
        if mgr.last_verdict and mgr.last_verdict["step"] == step:
            out["verdicts"][step] = dict(mgr.last_verdict)
    out["after"] = local_fingerprint(model, opt)
    mgr.close()
    out["final"] = dict(mgr.last_verdict or {})  # async: the last save is committed by close()
    return out


def train_fsdp(rank, world, root, steps=4, arms=("fault",)):
    """On TorchTitan's dp_shard mesh, saving every 2 steps. "fault": rank 0 flips a bit of its shard between step 2
    and its save, rank 1's live update of one element is one ulp off from step 3: both saves rejected, each naming
    its rank; "healthy": every save certified at its commit; "resumed" (after "healthy"): a fresh manager in
    TorchTitan's async mode loads the newest certified step and trains 4 more steps, saving two of them."""
    import time

    from scout_ckpt.options import ShardEvidenceOptions

    pd = build_mesh(1, world, 1, world)
    res = {}
    for arm in arms:
        t0 = time.monotonic()
        if arm == "fault":
            res[arm] = _run_fsdp(
                os.path.join(root, "fault"),
                pd,
                rank,
                steps,
                flip=(0, 2, "head.weight", 7),
                fault=(1, 3, "blocks.0.fc1.weight", 5),
                shard_evidence=ShardEvidenceOptions(per_step=64),
            )
        elif arm == "healthy":
            res[arm] = _run_fsdp(os.path.join(root, "healthy"), pd, rank, steps)
        else:  # resumed, with TorchTitan's async mode: the evidence runs while the upload is in flight
            res[arm] = _run_fsdp(os.path.join(root, "healthy"), pd, rank, steps + 4, async_mode="async")
        res[arm]["seconds"] = time.monotonic() - t0
    return res


def find_load_step_collective(rank, world, root, max_step):
    """titan_next.find_load_step_collective on every rank: the step each rank got."""
    from scout_ckpt.integrations import titan_next

    return titan_next.find_load_step_collective(root, max_step)
