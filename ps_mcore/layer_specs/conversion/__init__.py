"""Stock Megatron spec -> tree spec: ``gpt`` (``to_tree_spec`` and the GPT builders), ``layer``
(one transformer layer), ``hybrid`` (hybrid stacks), ``bridge`` (Megatron-Bridge callables),
``recurrent`` (the recurrent-mixer table), ``spec_class`` (what a spec builds)."""
