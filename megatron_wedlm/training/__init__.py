"""Training: config -> model, data, optimizer, loop, checkpoints, logging.

:mod:`.cli` (the entry points' command line), :mod:`.loop` (``run_training``, the one loop),
:mod:`.engine` (the engine contract) and :mod:`.megatron_engine`, :mod:`.objective` (WeDLM or AR),
:mod:`.run_data`, :mod:`.run_dir` (the output directory's claim), :mod:`.step_record` and
:mod:`.metrics` (what is logged), :mod:`.model_setup`, :mod:`.optimization`, :mod:`.memory_plan`
(``--dry-run``), :mod:`.checkpoint_index` (names, lineage, resume) and :mod:`.checkpointing`
(Megatron torch_dist), :mod:`.hf_export` (a run's checkpoint as a model to decode).
"""
