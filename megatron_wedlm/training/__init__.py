"""Training entry-point machinery: config -> model, data, optimizer, loop, checkpoints, logging.

* :mod:`.cli`            -- command line of ``pretrain/pretrain_wedlm.py`` and ``sft/sft_wedlm.py``.
* :mod:`.loop`           -- ``run_training(cfg, engine)``: the one step loop (both engines, skip non-finite).
* :mod:`.megatron_engine`-- the Megatron-Core engine: model chunks, DDP, schedule, forward step.
* :mod:`.objective`      -- ``Objective`` (WeDLM or AR): labels, loss contribution, logged loss.
* :mod:`.step_record`    -- what both backends do around a step: data, metrics record, non-finite
                            stop, save schedule, trainer state.
* :mod:`.model_setup`    -- ``ModelArgs`` from config / ``model.init_from``, the build settings the config names.
* :mod:`.optimization`   -- Megatron DDP, distributed optimizer, lr schedule.
* :mod:`.checkpointing`  -- atomic torch_dist checkpoints, resume, keep-last-K.
* :mod:`.metrics`        -- metrics.jsonl, wandb, progress bar.
* :mod:`.megatron_compat`-- native-torch Adam checkpoint fixes for Megatron-Core (documented there).
"""
