"""verl 0.9.1: what differs from the shared glue (:mod:`ps_mcore.integrations.verl_common`).

* :mod:`~ps_mcore.integrations.verl091.install`: which verl 0.9.1 attributes each patchset
  wraps (its two trainers: ``main_ppo``'s ``verl.trainer.ppo.v1`` and ``main_ppo_v0``'s
  ``RayPPOTrainer``; the Megatron engine, which builds models through Megatron-Bridge by default
  or mbridge, megatron-core 0.19; the FSDP engines).
* ``configs/``: hydra configs extending verl 0.9.1's trainer configs.

verl 0.9.1 reads ``actor_rollout_ref.actor.use_prefix_grouper`` itself (its PrefixGrouper
flag): no engine acts on it, ``main_ppo_v0``'s DP balancing keeps ``uid`` groups whole under it.
With ps-mcore installed the same key turns prefix sharing on (``mode: prompt_only``, the
default, shares whole prompts per ``uid`` group as PrefixGrouper does), and both trainers keep
groups whole.
"""

import os

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")

__all__ = ["CONFIG_DIR"]
