"""Drop-ins for training frameworks whose checkpointing scout-ckpt does not write itself.

  transformers   ScoutTrainerCallback for the Hugging Face Trainer, latest_clean(output_dir)
  folders        torch-free pieces for non-DCP checkpoint folders (`checkpoint-N`): names, byte verification,
                 latest-clean walk, retention plan, settling interrupted saves

Nothing here is imported by `import scout_ckpt`, and this package imports no framework itself: each framework's
module imports its framework, so the core install stays lean (`pip install scout-ckpt[transformers]`).
"""
