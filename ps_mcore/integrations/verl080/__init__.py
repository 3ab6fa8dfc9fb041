"""verl 0.8.0: what differs from the shared glue (:mod:`ps_mcore.integrations.verl_common`).

* :mod:`~ps_mcore.integrations.verl080.install`: which verl 0.8.0 attributes each patchset
  wraps (trainers ``main_ppo`` / ``main_ppo_sync``, the Megatron, MindSpeed and FSDP engines).
* :mod:`~ps_mcore.integrations.verl080.mindspeed`: verl 0.8.0's ``mindspeed_megatron`` engine
  building its model with the MindSpeed tree spec.
* ``configs/``: hydra configs extending verl 0.8.0's trainer configs.
"""

import os

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")

__all__ = ["CONFIG_DIR"]
