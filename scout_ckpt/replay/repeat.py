"""The healthy-device oracle for replay: one live step captured, replayed N times, every replay compared.

Why apart from determinism.py: this needs the capture and the replay itself (capture.py, execute.py), which need
determinism.py; the settings stay a leaf that both import. scripts/gpu_check.py runs it 100 times per module on a
GPU under each setting (docs/gpu.md); the CUDA and CPU tests run it too.
"""

from __future__ import annotations

import torch

from scout_ckpt.consensus.signatures import replica_signatures
from scout_ckpt.replay import determinism, live
from scout_ckpt.replay.capture import ModuleCapture, device_of
from scout_ckpt.replay.execute import replay_module


def repeat_check(module, args: tuple, n: int, grads: bool = True) -> dict:
    """The healthy-device oracle: one live forward and backward of `module` on `args` captured as a save step's
    would be (capture.ModuleCapture, live signatures on), then `n` replays of that capture on copies, each compared
    with the live signatures (live.self_check) and with the first replay's signatures. On a healthy device every
    count but `replays` is 0. Returns {"replays", "self_check_failed": {outcome name: count}, "replays_differ",
    "signatures", "grad_note", "comparison", "settings"}."""
    names = frozenset(n_ for n_, _ in module.named_parameters())
    cap = ModuleCapture(module, live=True, refs=False, grads=grads, grad_params=names if grads else None)
    cap.arm()
    try:
        out = module(*args)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().square().mean().backward()
    finally:
        cap.disarm()
    inv = cap.invocation
    if inv is None:
        raise RuntimeError("the module's forward was not captured (no call reached it)")
    outcome = {
        live.SELF_AGREE: "agree",
        live.SELF_OUTPUT: "output",
        live.SELF_GRAD: "gradient",
        live.SELF_UNCHECKED: "unchecked",
    }
    failed: dict[str, int] = {}
    first = None
    differ = 0
    sigs = None
    for _ in range(n):
        labels, tensors = replay_module(module, inv, hook_ids=cap.hook_ids)
        sigs = replica_signatures(tensors)
        code = live.self_check(labels, sigs, inv)
        if code != live.SELF_AGREE:
            name = outcome.get(code, str(code))
            failed[name] = failed.get(name, 0) + 1
        if first is None:
            first = sigs
        elif not torch.equal(first, sigs):
            differ += 1
    dev = device_of(module)
    return {
        "replays": n,
        "self_check_failed": failed,
        "replays_differ": differ,
        "signatures": 0 if sigs is None else int(sigs.shape[0]),
        "live_signed": sorted(inv.live_grads or {}),
        "grad_note": inv.grad_note,
        "comparison": determinism.comparison(dev),
        "settings": determinism.settings(dev).as_dict(),
    }


__all__ = ["repeat_check"]
