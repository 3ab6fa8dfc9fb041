"""Integrations with training frameworks, one versioned package per supported release.

* :mod:`ps_mcore.integrations.verl080`: verl 0.8.0 (Megatron, MindSpeed and FSDP engines).

Only this floor (and ``ps_mcore.setup``, which wires it in) knows a training framework. A
package here imports the core, ``layer_specs`` / ``fsdp_bridge`` / ``mindspeed`` and the leaf
patch utilities (``ps_mcore.setup.patching`` / ``ps_mcore.setup.env``); nothing below imports
it. A new verl release gets a sibling package (``verl0XY``) and one entry in
``ps_mcore.setup.patchsets``.
"""
