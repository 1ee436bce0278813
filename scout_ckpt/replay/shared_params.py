"""Which of the sweep source's parameter copies need to travel: none that a peer already holds bit for bit.

Why: with the self-check on (replay.live), every rank keeps a copy of each target's parameters and buffers as its
own forward used them (capture.py), and on healthy replicas (DDP, or FSDP2's unsharded parameters) those copies
are the same bits on every rank. Sending the source's copy with the inputs regardless would be half the bytes of
a sweep's transfer, copied into the send buffer on the source and out of the socket on every peer. So each rank
signs its copies (every tensor's replica signature, then one xxh3-128 over those and the names, shapes and dtypes)
and the digests ride in the sweep's first gather, which the sweep makes anyway (no collective added). A target
whose digest is the source's on EVERY peer is sent without parameters, and every peer, the source too, replays
it with its own copy -- the same bits the source would have sent, so the replay, its signatures and the row are
those of the copy sent. Where any peer's copy differs or is missing (the self-check off, a capture not intact,
replicas that diverged), the source's copy travels as before. The decision is a function of the gathered words,
the same on every rank.
"""

from __future__ import annotations

from dataclasses import replace

import xxhash

from scout_ckpt.consensus.signatures import digest_row, replica_signatures

WORDS = 3  # per target: has a copy (0/1), then the digest's two 64-bit halves


def _copy_of(recipe: str, cap):
    inv = getattr(cap, "invocation", None)
    if recipe == "optimizer" or inv is None or not inv.params or not inv.intact():
        return None
    return inv


def digest_words(targets: list, caps: dict | None) -> list[int]:
    """This rank's words for the sweep's first gather: per target of `targets` (every target, in the runner's
    order, so every rank sends as many), whether it holds a parameter copy and its digest. `caps`: target name ->
    this rank's capture, None when this rank has none for the step (zeros then)."""
    invs = [(_copy_of(t[0], caps[t[1]]) if caps is not None and t[1] in caps else None) for t in targets]
    tensors = [x for inv in invs if inv is not None for x in [*inv.params.values(), *inv.buffers.values()]]
    sigs = replica_signatures(tensors) if tensors else None
    words: list[int] = []
    at = 0
    for inv in invs:
        if inv is None:
            words += [0, 0, 0]
            continue
        named = [*inv.params.items(), *(("buffer:" + n, b) for n, b in inv.buffers.items())]
        h = xxhash.xxh3_128()
        h.update(repr([(n, str(x.dtype), tuple(x.shape)) for n, x in named]).encode())
        h.update(sigs[at : at + len(named)].contiguous().numpy().tobytes())
        at += len(named)
        words += [1, *digest_row(h.intdigest())]
    return words


def shared(gathered: dict[int, list[int]], targets: list, src: int, offset: int = 0) -> set[str]:
    """The targets whose parameter copy every peer holds with the source's digest (`gathered`: rank -> its words,
    this module's starting at `offset`): these travel without parameters."""
    out = set()
    for k, t in enumerate(targets):
        at = offset + WORDS * k
        mine = gathered[src][at : at + WORDS]
        if mine[0] and all(w[at : at + WORDS] == mine for w in gathered.values()):
            out.add(t[1])
    return out


def without_params(inv):
    """The invocation to send for a shared target: everything but the parameters and buffers."""
    return replace(inv, params={}, buffers={})


def with_own(payload, cap):
    """A shared target's payload completed with this rank's own copy (the same bits as the source's)."""
    payload.params, payload.buffers = cap.invocation.params, cap.invocation.buffers
    return payload


__all__ = ["WORDS", "digest_words", "shared", "with_own", "without_params"]
