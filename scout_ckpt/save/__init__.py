"""What runs inside a training job: the commit protocol of a save boundary, the DCP writer and the pass it makes
over the bytes it writes, async saves, loading with walk-back, the evidence assembled at a save (`evidence/`),
app-state helpers and rank placement. The `Checkpointer` facade (scout_ckpt/checkpointer.py) drives these."""
