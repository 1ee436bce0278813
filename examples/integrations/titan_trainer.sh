#!/usr/bin/env bash
# TorchTitan's own Trainer (llama3 debug model) with ScoutCheckpointManager, enabled by its override flag alone;
# one rank is SIGKILLed mid-run, then the job is restarted and loads the newest *certified* step.
#
#   TORCHTITAN_SRC=/path/to/torchtitan-v0.3.0 examples/integrations/titan_trainer.sh [NGPU] [OUT]
#
# Needs: GPUs (TorchTitan's Trainer does not run on CPU: its device falls back to "cuda"), torchtitan 0.3.0 and
# triton installed, and a TorchTitan v0.3.0 source checkout for the debug model's assets (tests/assets/tokenizer,
# tests/assets/c4_test; the wheel does not ship them). Prints the ledger (`scout-ckpt ls`) after each phase and
# exits non-zero if the restart did not load a certified step. The debug model trains under FSDP (dp_shard = NGPU):
# its single-owner shards are certified by the manager's shard evidence, which needs a non-fused AdamW
# (--optimizer.implementation foreach; TorchTitan's default "fused" leaves every step `committed`). Not yet run: no
# GPU was lent to this work, and the shard replay's bitwise oracle is verified on CPU only (see shard_optimizer.py).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
NGPU=${1:-2}
OUT=$(realpath -m "${2:-/tmp/scout-titan-trainer}")
PY=${PYTHON:-python}
STEPS=${STEPS:-12}
: "${TORCHTITAN_SRC:?set TORCHTITAN_SRC to a TorchTitan v0.3.0 checkout (for tests/assets)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # README: restarted generations under torchrun
CKPT="$OUT/checkpoint"
SCOUT=("$PY" -c "from scout_ckpt.cli import main; main()")
run_trainer() {
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m torchtitan.train \
    --module llama3 --config llama3_debugmodel --dump_folder "$OUT" --training.steps "$STEPS" \
    --checkpoint.enable --checkpoint.interval 2 --checkpoint.keep_latest_k 3 --optimizer.implementation foreach \
    --override.imports scout_ckpt.integrations.torchtitan.scout_checkpoint "$@"
}
certified() {  # the newest certified step in the ledger, or 0
  "${SCOUT[@]}" ls "$CKPT" --json 2>/dev/null | "$PY" -c \
    'import json,sys; d=json.load(sys.stdin); print(max([r["step"] for r in d["checkpoints"] if r["state"]=="certified"] or [0]))' \
    || echo 0
}

rm -rf "$OUT"
cd "$TORCHTITAN_SRC"
echo "== phase 1: train, SIGKILL rank $((NGPU - 1)) once step 6 is certified"
run_trainer > "$OUT.phase1.log" 2>&1 &
LAUNCHER=$!
while kill -0 "$LAUNCHER" 2>/dev/null && [ "$(certified)" -lt 6 ]; do sleep 1; done
victim=$(pgrep -f "torchtitan.train" -P "$(pgrep -P "$LAUNCHER" | head -1)" | tail -1 || true)
[ -n "$victim" ] || victim=$(pgrep -f "torchtitan.train" | tail -1)
kill -9 "$victim" || true
wait "$LAUNCHER" || echo "phase 1 exited non-zero, as expected after the kill"
"${SCOUT[@]}" ls "$CKPT"

echo "== phase 2: restart; load(step=-1) takes the newest certified step"
expect=$(certified)
run_trainer 2>&1 | tee "$OUT.phase2.log" | grep -E "Loading the checkpoint|scout-ckpt|Training starts|step: *[0-9]+ " || true
"${SCOUT[@]}" ls "$CKPT"
"${SCOUT[@]}" resume "$CKPT" --latest-clean
grep -q "Loading the checkpoint from .*step-$expect" "$OUT.phase2.log" \
  && echo "OK: resumed from step $expect, the newest certified step at the restart" \
  || { echo "FAILED: the restart did not load step-$expect"; exit 1; }
