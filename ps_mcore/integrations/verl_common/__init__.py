"""The verl glue every supported verl release shares (knows verl; installed through a version
package's ``install.py``, imported by tests).

* :mod:`~ps_mcore.integrations.verl_common.config`: the ``prefix_grouper`` keys on verl's config
  dataclasses and the "follow the actor's setting" rule.
* :mod:`~ps_mcore.integrations.verl_common.batch`: verl batches -> sequences, plans, flags.
* :mod:`~ps_mcore.integrations.verl_common.microbatch`: prefix-aware micro-batching.
* :mod:`~ps_mcore.integrations.verl_common.engine`: the engine / micro-batch context shared by
  the engines, and the tree-or-stock decision.
* :mod:`~ps_mcore.integrations.verl_common.megatron`: tree specs at model build (mbridge and
  Megatron-Bridge, GPT and hybrid providers) and the tree forward of the Megatron engine.
* :mod:`~ps_mcore.integrations.verl_common.mtp`: verl's MTP training loss on the tree (Megatron).
* :mod:`~ps_mcore.integrations.verl_common.fsdp`: the FSDP engines (through ``fsdp_bridge``).
* :mod:`~ps_mcore.integrations.verl_common.fused`: verl's fused LM-head kernels on the tree (FSDP).
* :mod:`~ps_mcore.integrations.verl_common.vision`: Qwen2-VL / Qwen2.5-VL micro-batches (FSDP).
* :mod:`~ps_mcore.integrations.verl_common.trainer`: DP balancing keeping groups together, step
  metrics, ref / critic following the actor.

What a release changed lives in its own package (``verl080``, ``verl091``): which verl
attributes are wrapped (``install.py``), its hydra configs, and engines only it has.
"""
