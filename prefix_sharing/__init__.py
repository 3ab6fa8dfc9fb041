"""``import prefix_sharing``: turn on prefix sharing for verl.

Importing this package installs every ps-mcore patchset compatible with the installed
stack, or only those named in ``PREFIX_SHARING_PATCHSET`` (comma separated; an unknown
name or a missing stack raises with what was detected). It imports no verl or Megatron code
itself: each verl module is patched as the program imports it. It is what verl's plugin
hooks load, in the driver and in every worker::

    VERL_USE_EXTERNAL_MODULES=prefix_sharing python -m verl.trainer.main_ppo ...
    python -m verl.trainer.main_ppo ... actor_rollout_ref.model.external_lib=prefix_sharing

``ENABLE_PREFIX_SHARING=0`` keeps it installed but makes every patched path verl's own.
"""

from __future__ import annotations

import logging

from ps_mcore.setup import install, requested_patchsets, uninstall
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig

__all__ = ["INSTALLED", "PrefixGrouperConfig", "install", "uninstall"]

INSTALLED: list[str] = install(requested_patchsets())
if not INSTALLED:
    logging.getLogger("ps_mcore").warning(
        "[prefix_sharing] no compatible stack found; nothing was patched (see ps_mcore.setup.detect())"
    )
