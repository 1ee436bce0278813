"""Drop-ins for training frameworks whose checkpointing scout-ckpt does not write itself.

  torchtitan      ScoutCheckpointManager for TorchTitan 0.3 (its DCP CheckpointManager, subclassed)
  titan_evidence  SDC replay and FSDP shard evidence in that manager, with the core Checkpointer's calls; no framework
  transformers    ScoutTrainerCallback for the Hugging Face Trainer, latest_clean(output_dir)
  deepspeed       install(engine, save_dir): a ScoutCheckpointEngine on a DeepSpeed engine, latest_clean(save_dir)
  ds_folders      torch-free: DeepSpeed's global_stepN folders (registered for the CLI) and its `latest` pointer
  lightning       ScoutDDPStrategy / ScoutModelParallelStrategy / ScoutFSDPStrategy (a strategy mixin) for
                  PyTorch Lightning: core `step-N` checkpoints of Lightning's whole dump, ckpt_path="latest_clean"
  accelerate      ScoutCheckpointing for a loop around Hugging Face Accelerate: the prepared objects' state and
                  every prepared DataLoader's position (accelerate_data: TrackedDataLoader, DataPosition)
  megatron        MegatronCheckpointer: certified dist_checkpointing (torch_dist) saves, latest_clean(save_dir)
  mg_folders      torch-free: Megatron's iter_NNNNNNN folders (registered for the CLI) and its tracker file
  session         IntegrationRun: the save machinery both share (start-up, writing row, hashing split across the
                  ranks, manifest, commit); imports torch, no framework
  folders         torch-free pieces for non-DCP checkpoint folders (`checkpoint-N`): names, listing, share split,
                  and the core's settle / latest-clean / retention with what in-place writers need on top
  folder_tensors  tensors of a `checkpoint-N` folder for offline checks and export

Nothing here is imported by `import scout_ckpt`, and this package imports no framework itself: each framework's
module imports its framework, so the core install stays lean (`pip install scout-ckpt[transformers]`).
"""
