"""The tree modules a converted spec builds: ``core_attention``, ``self_attention``, ``mla``,
``moe_router``, ``gdn``, ``mamba``, ``tree_context`` (the batch the current layer runs on,
for the MoE router, which never sees ``packed_seq_params``) and ``dropout`` (the active dropout
a tree batch refuses)."""
