"""Training entry-point machinery: config -> model, data, optimizer, loop, checkpoints, logging.

* :mod:`.cli`            -- command line of ``pretrain/pretrain_wedlm.py`` and ``sft/sft_wedlm.py``.
* :mod:`.loop`           -- ``run_training(cfg, engine)``: the one step loop (both engines, skip non-finite).
* :mod:`.engine`         -- the engine contract: ``Engine``, ``RankRole``, ``StepUpdate``.
* :mod:`.megatron_engine`-- the Megatron-Core engine: model chunks, DDP, the one schedule call, forward step.
* :mod:`.run_data`       -- the data sources' manifests and this rank's resumable micro-batches.
* :mod:`.run_dir`        -- the run's claim on its output directory: lock, resume decision, lineage.
* :mod:`.objective`      -- ``Objective`` (WeDLM or AR): labels, loss contribution, logged loss.
* :mod:`.step_record`    -- what both backends do around a step: step totals, metrics record, non-finite
                            stop, save schedule, trainer state.
* :mod:`.model_setup`    -- ``ModelArgs`` from config / ``model.init_from``, the build settings the config names.
* :mod:`.memory_plan`    -- ``--dry-run``: parameters, layout, tokens per step and memory per GPU of a config.
* :mod:`.optimization`   -- Megatron DDP, distributed optimizer, lr schedule.
* :mod:`.checkpoint_index` -- checkpoint names, lineage, resume policy, atomic publish, keep-last-K.
* :mod:`.checkpointing`  -- Megatron torch_dist checkpoints (tensors, optimizer, RNG).
* :mod:`.metrics`        -- metrics.jsonl, wandb, progress bar.
"""
