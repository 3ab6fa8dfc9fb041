"""verl 0.8.0 glue (knows verl; installed by ``ps_mcore.setup.patchsets``, imported by tests).

* :mod:`~ps_mcore.integrations.verl080.config`: the ``prefix_grouper`` keys on verl's config
  dataclasses and the "follow the actor's setting" rule.
* :mod:`~ps_mcore.integrations.verl080.batch`: verl batches -> sequences, plans, flags.
* :mod:`~ps_mcore.integrations.verl080.microbatch`: prefix-aware micro-batching.
* :mod:`~ps_mcore.integrations.verl080.engine`: the engine / micro-batch context shared by
  both engines, and the tree-or-stock decision.
* :mod:`~ps_mcore.integrations.verl080.megatron`: tree specs and the tree forward for the
  Megatron engine.
* :mod:`~ps_mcore.integrations.verl080.mindspeed`: the ``mindspeed_megatron`` engine building
  its model with the MindSpeed tree spec.
* :mod:`~ps_mcore.integrations.verl080.fsdp`: the FSDP engines (through ``fsdp_bridge``).
* :mod:`~ps_mcore.integrations.verl080.trainer`: DP balancing keeping groups together, step
  metrics.
* :mod:`~ps_mcore.integrations.verl080.install`: which verl attributes each patchset wraps.
* ``configs/``: hydra configs extending verl's trainer configs.
"""

import os

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")

__all__ = ["CONFIG_DIR"]
