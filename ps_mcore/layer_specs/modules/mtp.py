"""megatron-core's multi-token prediction (MTP) layers run on a prefix tree.

``MultiTokenPredictionLayer.forward`` rolls ``input_ids`` / ``position_ids`` left by one per
depth inside each packed sequence; on a tree the token after a shared row depends on the
branch, so the rows of each depth come from :func:`ps_mcore.multi_token.depth_plans` instead
and the layer's own parts run on them: the embedding of each depth-k row's token, its source
row of the previous depth, ``_proj_and_transformer_layer`` (eh-projection, the tree-spec
transformer layer on the depth's own prefix forest, final norm), recompute as the stock
forward does it. Across megatron-core versions: 0.19's ``mtp_use_repeated_layer`` runs its one
layer at every depth, ``mtp_detach_heads`` detaches the layers' inputs as verl's
``detach_encoder`` does, and its recompute takes the layer's arguments by name (0.16's takes
the function and the arguments in order). Under tensor parallelism each depth's rows are
laid out as the decoder's: every TP rank holds them all, or under sequence parallelism its
chunk of them padded to a multiple of the TP size (the embedding scatters its output, each
depth gathers the previous depth's rows to read its source rows).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from ps_mcore.layer_specs.modules.core_attention import TreeCoreAttention
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams
from ps_mcore.multi_token import DepthPlan
from ps_mcore.planner import TreePlan


def tree_mtp_refusal(model) -> str | None:
    """Why ``model``'s MTP block cannot run on a tree (None: it can)."""
    config = model.config
    if mpu.get_context_parallel_world_size() > 1:
        return ("MTP with context parallelism (stock MTP divides each depth's loss by each CP rank's own "
                "token count, set by how the unshared sequences split over the CP ranks; the tree's depth "
                "rows are laid out whole on every rank)")
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        return ("MTP with pipeline parallelism (not verified on a tree: the MTP block on the last "
                "stage and its copy of the word embedding)")
    if getattr(config, "num_moe_experts", None):
        return "MTP with MoE layers (stock routes the rows past each sequence's end too)"
    mtp = getattr(model, "mtp", None)
    if mtp is None or not any(isinstance(m, TreeCoreAttention) for m in mtp.modules()):
        return "an MTP block without tree layer specs"
    if getattr(mtp, "mtp_layer_pattern", None) is not None:
        return "MTP layers of a hybrid layer pattern (mtp_hybrid_override_pattern)"
    return None


def _layer_arguments(layer, **given) -> dict:
    """``layer._proj_and_transformer_layer``'s parameters, in their order, set from ``given``
    (None where not given: 0.19 adds ``padding_mask``, which only MoE routing reads)."""
    names = inspect.signature(layer._proj_and_transformer_layer).parameters
    return {name: given.get(name) for name in names}


def _run_layer(layer, arguments: dict) -> torch.Tensor:
    """``_proj_and_transformer_layer`` with recompute as the stock forward does it:
    megatron-core 0.16's ``_checkpointed_forward(function, *args)`` (arguments positionally,
    verl's patch of it takes them by name too) or 0.19's ``_checkpointed_forward(**args)``."""
    if not (layer.config.recompute_granularity == "full" and layer.training):
        return layer._proj_and_transformer_layer(**arguments)
    if next(iter(inspect.signature(layer._checkpointed_forward).parameters)) == "forward_func":
        return layer._checkpointed_forward(layer._proj_and_transformer_layer, **arguments)
    return layer._checkpointed_forward(**arguments)


def tree_mtp_hidden_states(
    model,
    hidden_states: torch.Tensor,
    plan: TreePlan,
    depths: list[DepthPlan],
    rotary_pos_emb=None,
    detach_inputs: bool = False,
    shared_dropout: bool = False,
) -> list[torch.Tensor]:
    """Outputs of ``model.mtp``'s layers on the tree.

    Args:
        model: the (unwrapped) GPTModel with an MTP block.
        hidden_states: ``[T_pad, 1, h]`` the decoder's output on the packed rows (under
            sequence parallelism this TP rank's chunk ``[T_pad / tp, 1, h]``).
        plan: the micro-batch's plan; depths: its :class:`DepthPlan` per MTP layer (on the
            model's device).
        rotary_pos_emb: the model's rotary table (tree attention indexes it per row).
        detach_inputs: verl's ``mtp.detach_encoder``: detach every depth's embeddings and the
            decoder's hidden states fed to depth 1, so the MTP loss does not reach the decoder
            or the embedding. (verl's patch detaches its hidden-state input only when that is a
            view: the decoder's output chunk is, a previous MTP layer's viewless output is not,
            so depth k >= 2 still trains depth k-1.) megatron-core 0.19's ``mtp_detach_heads``
            detaches the same inputs and implies it.
        shared_dropout: the micro-batch's opt-in to shared dropout masks
            (``TreePackedSeqParams.shared_dropout``), given to each depth's packed params.

    Returns:
        ``[T_k, 1, h]`` per depth: row q is the depth-k row ``depths[k-1].plan`` row q (under
        sequence parallelism: this TP rank's chunk of the rows padded to a multiple of tp).
    """
    detach_inputs = detach_inputs or bool(getattr(model.config, "mtp_detach_heads", False))
    repeated = bool(getattr(model.mtp, "mtp_use_repeated_layer", False))
    sp = _SequenceParallelRows.of(model.config)
    outputs = []
    previous = sp.gather(hidden_states)[: plan.num_tokens]
    for depth in depths:
        layer = model.mtp.layers[0 if repeated else depth.depth - 1]
        rows = sp.pad(depth.rows)  # padding rows read row 0; no token reads their outputs
        decoder_input = model.embedding(  # under SP: this rank's chunk of the rows
            input_ids=plan.input_ids[rows][None], position_ids=plan.position_ids[rows][None]
        )
        source = previous.index_select(0, sp.local(sp.pad(depth.source)))
        if detach_inputs:
            decoder_input = decoder_input.detach()
            if depth.depth == 1:
                source = source.detach().requires_grad_()
        arguments = _layer_arguments(
            layer,
            hidden_states=source,
            decoder_input=decoder_input,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=TreePackedSeqParams.from_plan(
                depth.plan, pad_to_multiple_of=sp.size, shared_dropout=shared_dropout
            ),
        )
        out = _run_layer(layer, arguments)
        outputs.append(out)
        previous = sp.gather(out)
    return outputs


@dataclass(frozen=True)
class _SequenceParallelRows:
    """Each depth's rows under sequence parallelism, laid out as the decoder's: padded to a
    multiple of the TP size, each TP rank holding its contiguous chunk (``size`` 1: no SP, every
    rank holds all rows)."""

    size: int
    rank: int

    @classmethod
    def of(cls, config) -> _SequenceParallelRows:
        if not config.sequence_parallel:
            return cls(1, 0)
        return cls(mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank())

    def pad(self, index: torch.Tensor) -> torch.Tensor:
        """``[T]`` row indices padded with 0 to ``[T_pad]``."""
        return torch.nn.functional.pad(index, (0, -index.numel() % self.size))

    def local(self, index: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``[T_pad]``."""
        return index.chunk(self.size)[self.rank] if self.size > 1 else index

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``[T_pad / size, 1, h]`` -> ``[T_pad, 1, h]``: every rank's chunk. Each rank then
        reads its own rows of the result, so the backward sums the ranks' partial gradients
        (a reduce-scatter)."""
        if self.size == 1:
            return rows
        return gather_from_sequence_parallel_region(rows, tensor_parallel_output_grad=True)
