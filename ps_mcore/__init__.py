"""ps-mcore: prefix sharing for Megatron-core (and Hugging Face models through verl FSDP).

One way through the data: tokens -> :func:`plan_prefix_tree` -> model with tree attention ->
packed outputs -> ``plan.unpack`` / :func:`token_logprobs` -> the unchanged loss.
Importing ``ps_mcore`` patches nothing; see ``ps_mcore.setup`` and ``import prefix_sharing``.
"""

from ps_mcore.attention import tree_attention
from ps_mcore.logprobs import token_logprobs
from ps_mcore.planner import TreePlan, plan_prefix_tree, plan_unshared

__version__ = "0.1.0"

__all__ = ["TreePlan", "plan_prefix_tree", "plan_unshared", "token_logprobs", "tree_attention", "__version__"]
