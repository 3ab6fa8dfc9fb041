"""``ps-mcore analyze``: how much prefix sharing would save on your own rollouts.

Reads rollout files, cuts every file (one training step's batch) into micro-batches the way
verl does (fixed micro-batch size, ``uid`` groups kept together), packs each micro-batch as
:func:`~ps_mcore.planner.plan_prefix_tree` would and reports, per mode, the token dedup N/T and
the attention-FLOP ratio, then how the thresholds (``min_prefix_len``, ``min_group_size``)
change the dedup (all thresholds from one pass over the data). ``--plot`` draws the sharing
structure of one micro-batch.

Inputs:

* JSONL (``.jsonl``/``.json``), one object per line, e.g. verl's ``trainer.rollout_data_dir``
  dumps (``input``/``output`` text, ``score``, ``step``; ``uid`` when present); or a ``.json``
  file holding one JSON array of such objects. Text must be UTF-8.
* Parquet (``.parquet``) with token-id list columns (or text columns).
* A directory: all its ``.jsonl``/``.json``/``.parquet`` files, in name order.

Columns are detected by name: token ids ``prompt_ids``+``response_ids``,
``prompt_token_ids``+``response_token_ids``, ``prompts``+``responses``, ``input_ids`` or
``token_ids``; text ``input``+``output`` (verl's dump), ``prompt``+``response`` or ``text``
(text needs ``--tokenizer PATH``, a local Hugging Face tokenizer directory). ``--column``
names one column (whole sequences) or two (prompt, response) instead. A prompt/response split
gives prompt lengths, which ``prompt_only`` needs. ``uid`` groups samples; verl's TransferQueue
keys ``{uid}_{session}_{index}`` are grouped by their ``uid`` part.
"""

from ps_mcore.analyze.command import add_analyze_arguments, run_analyze
from ps_mcore.analyze.plot import node_layout, plot_figure, plot_plan
from ps_mcore.analyze.progress import Progress
from ps_mcore.analyze.read import AnalyzeError, Rollouts, expand_paths, read_rollouts
from ps_mcore.analyze.report import (
    DEFAULTS,
    FALLBACK_SAVED,
    batch_table,
    build_tries,
    micro_batches,
    mode_table,
    plan_micro_batch,
    threshold_table,
)
from ps_mcore.analyze.sweep import ModeTries, Sharing

__all__ = [
    "DEFAULTS",
    "FALLBACK_SAVED",
    "AnalyzeError",
    "ModeTries",
    "Progress",
    "Rollouts",
    "Sharing",
    "add_analyze_arguments",
    "batch_table",
    "build_tries",
    "expand_paths",
    "micro_batches",
    "mode_table",
    "node_layout",
    "plan_micro_batch",
    "plot_figure",
    "plot_plan",
    "read_rollouts",
    "run_analyze",
    "threshold_table",
]
