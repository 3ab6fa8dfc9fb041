"""Old home of the verl 0.8.0 glue, kept so ``ps_mcore.verl.<module>`` imports keep working.

The code lives in :mod:`ps_mcore.integrations.verl080`. Each old submodule name is the very
same module object (not a copy), so monkeypatching ``ps_mcore.verl.engine`` patches the glue.
"""

import importlib
import sys

from ps_mcore.integrations.verl080 import CONFIG_DIR

_MODULES = ("batch", "config", "engine", "fsdp", "megatron", "microbatch", "trainer")

for _name in _MODULES:
    _module = importlib.import_module(f"ps_mcore.integrations.verl080.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module

__all__ = ["CONFIG_DIR", *_MODULES]
