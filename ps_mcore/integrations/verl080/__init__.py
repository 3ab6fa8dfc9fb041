"""verl 0.8.0 glue (knows verl; imported only by ``ps_mcore.setup`` patchsets and tests).

* :mod:`~ps_mcore.verl.config`: the ``prefix_grouper`` sub-config and its validation.
* :mod:`~ps_mcore.verl.microbatch`: prefix-aware micro-batching.
* :mod:`~ps_mcore.verl.megatron`: tree specs and the tree forward for the Megatron engine.
* :mod:`~ps_mcore.verl.trainer`: DP balancing keeping groups together, step metrics.
* ``config/``: hydra configs extending verl's trainer configs.
"""

import os

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "config")

__all__ = ["CONFIG_DIR"]
