"""The sweep sends a target's parameters only where some peer's own copy differs (replay/shared_params.py).

Single-process: real captures of a real block (capture.py), each "rank"'s words made from its own capture, the
gathered words assembled by the test as the all_gather would (rank -> words). The expected answers come from
how the test built the copies (the same bits, one bit flipped, no copy), never from the digests themselves; and a
replay of the stripped payload completed with a peer's own copy gives the same signatures as the payload sent
whole.
"""

from __future__ import annotations

import torch
from torch import nn

from scout_ckpt.consensus.signatures import replica_signatures
from scout_ckpt.replay import shared_params
from scout_ckpt.replay.capture import ModuleCapture
from scout_ckpt.replay.execute import replay_module

TARGETS = [("block", "a"), ("block", "b"), ("optimizer", "optimizer")]


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))


def _captured(block: nn.Module, seed: int) -> ModuleCapture:
    cap = ModuleCapture(block, params=True, live=True)
    cap.arm()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    block(x).square().sum().backward()
    cap.disarm()
    return cap


def _words(caps: dict) -> list[int]:
    return shared_params.digest_words(TARGETS, caps)


def test_a_target_travels_without_parameters_only_when_every_peer_holds_the_sources_bits():
    a0, a1, a2 = _block(), _block(), _block()
    b0, b1 = _block(), _block()
    with torch.no_grad():  # rank 1's copy of b differs from the source's in one bit of one element
        w = b1[2].weight.view(-1).view(torch.int32)
        w[5] ^= 1
    ranks = {
        0: {"a": _captured(a0, 0), "b": _captured(b0, 0)},
        1: {"a": _captured(a1, 1), "b": _captured(b1, 1)},
    }  # other inputs, same parameters for a
    gathered = {r: [1] + _words(c) for r, c in ranks.items()}
    assert len(gathered[0]) == 1 + shared_params.WORDS * len(TARGETS)
    assert shared_params.shared(gathered, TARGETS, src=0, offset=1) == {"a"}
    # a peer without a copy (self-check off) or without a capture: the source's copy travels
    gathered[2] = [1] + _words({"a": _captured(a2, 2)} | {"b": ModuleCapture(b0, params=False)})
    assert shared_params.shared(gathered, TARGETS, src=0, offset=1) == {"a"}
    gathered[2] = [0] + _words(None)
    assert shared_params.shared(gathered, TARGETS, src=0, offset=1) == set()


def test_a_capture_without_parameters_or_written_since_has_no_copy_to_share():
    block = _block()
    cap = ModuleCapture(block, params=False, live=True)
    cap.arm()
    block(torch.randn(3, 8)).sum()
    cap.disarm()
    assert _words({"a": cap, "b": cap}) == [0] * (shared_params.WORDS * len(TARGETS))
    refs = ModuleCapture(block, params=True, refs=True)
    refs.arm()
    x = torch.randn(3, 8)
    block(x)
    refs.disarm()
    x.add_(1.0)  # the referenced input written in place after the capture: not intact, never replayed
    assert _words({"a": refs, "b": refs})[:3] == [0, 0, 0]


def test_a_stripped_payload_completed_with_a_peers_own_copy_replays_to_the_same_signatures():
    src_block, peer_block = _block(), _block()
    src, peer = _captured(src_block, 0), _captured(peer_block, 7)
    sent = shared_params.without_params(src.invocation)
    assert sent.params == {} and sent.buffers == {} and src.invocation.params  # the capture keeps its copy
    whole = replica_signatures(replay_module(src_block, src.invocation)[1])
    completed = shared_params.with_own(sent, peer)
    assert completed.params is peer.invocation.params
    assert torch.equal(replica_signatures(replay_module(peer_block, completed)[1]), whole)
