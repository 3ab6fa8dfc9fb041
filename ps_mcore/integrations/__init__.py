"""Integrations with training frameworks, one versioned package per supported release.

* :mod:`ps_mcore.integrations.verl_common`: the glue every supported verl release shares.
* :mod:`ps_mcore.integrations.verl080`: verl 0.8.0 (Megatron, MindSpeed and FSDP engines).
* :mod:`ps_mcore.integrations.verl091`: verl 0.9.1 (Megatron engine through Megatron-Bridge or
  mbridge, megatron-core 0.19; FSDP engines).

Only this floor (and ``ps_mcore.setup``, which wires it in) knows a training framework. A
package here imports the core, ``layer_specs`` / ``fsdp_bridge`` / ``mindspeed`` and this
floor's own leaf utilities (:mod:`~ps_mcore.integrations.patching`: reversible patches and
one-time warnings; :mod:`~ps_mcore.integrations.env`: the ``ENABLE_PREFIX_SHARING`` switch and
probes of the installed stack); nothing below imports it. A new verl release gets a sibling package (``verl0XY``: what it changed) and one entry in
``ps_mcore.setup.patchsets``.
"""
