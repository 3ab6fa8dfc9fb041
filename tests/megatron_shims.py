"""Test-only shims and helpers to run real megatron-core GPTModels on CPU (gloo).

Shims (never in the library): megatron allocates many buffers on
``torch.cuda.current_device()`` (RoPE tables, the global memory buffer of the stock
DotProductAttention, TP all-gathers), so it is pointed at the CPU; the stock attention needs
an RNG tracker whose ``fork`` does not touch CUDA (``inference_rng_tracker=True``) and an
explicit causal mask.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB = 128


def _cpu_device():
    return "cpu"


def init_cpu_megatron(tp: int = 1, cp: int = 1, pp: int = 1, vpp: int | None = None) -> None:
    """gloo (world 1 in-process, or torchrun's world) + megatron parallel state with TP=tp,
    CP=cp, PP=pp (and VPP=vpp virtual stages)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.current_device = _cpu_device
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group("gloo")
        else:  # an in-process store: no port, so xdist workers cannot collide
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if ps.model_parallel_is_initialized():
        sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size(),
                 ps.get_pipeline_model_parallel_world_size(),
                 ps.get_virtual_pipeline_model_parallel_world_size())
        if sizes == (tp, cp, pp, vpp):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)


def init_gpu_megatron() -> None:
    """The GPU tests' world: NCCL world 1 (an in-process store), megatron parallel state of one
    rank, megatron's CUDA RNG tracker."""
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def tiny_config(kind: str = "qwen2", **overrides):
    """Tiny fp32 TransformerConfig. qwen2: GQA 4/2 heads, qkv bias, RMSNorm, SwiGLU.
    qwen3: GQA 6/2 heads, head dim 10 (decoupled from hidden/heads), qk-layernorm.
    qwen2-swa-sinks: qwen2 with a sliding window of 3 in every other layer and learnable sinks.
    gpt-oss: Megatron-Bridge's GPT-OSS settings at tiny scale: 4 layers alternating a sliding
    window of 5 (``window_size=(4, 0)``, ``window_attn_skip_freq=2``) and full attention,
    learnable sinks, MoE in every layer (4 experts, top 2, router and linear biases, no
    balancing loss, alltoall), clamped quick-GELU GLU, GQA 4/2. Needs ``enable_cpu_moe()`` and
    ``enable_cpu_sliding_window()``. gemma3: Gemma 3's layer pattern, 6 layers with 5 local
    (window 4) : 1 global (``window_attn_skip_freq=6``), GeGLU, qk-layernorm, GQA 6/2."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(
        num_layers=2, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, layernorm_epsilon=1e-6,
        use_cpu_initialization=True, params_dtype=torch.float32, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    kinds = {
        "qwen2": dict(hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, add_qkv_bias=True),
        "qwen3": dict(hidden_size=48, num_attention_heads=6, num_query_groups=2, kv_channels=10,
                      ffn_hidden_size=80, qk_layernorm=True),
        "qwen2-swa-sinks": dict(hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=96, add_qkv_bias=True, window_size=(2, 0),
                                window_attn_skip_freq=2, softmax_type="learnable"),
        "gpt-oss": _gpt_oss_kind(),
        "gemma3": dict(hidden_size=48, num_attention_heads=6, num_query_groups=2, kv_channels=8,
                       ffn_hidden_size=80, qk_layernorm=True, activation_func=F.gelu, num_layers=6,
                       window_size=(3, 0), window_attn_skip_freq=6),
    }
    if kind not in kinds:
        raise ValueError(f"unknown tiny config {kind!r}")
    return TransformerConfig(**{**common, **kinds[kind], **overrides})


def _gpt_oss_kind() -> dict:
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    # megatron's quick_gelu as written, not through its jit_fuser (torch.compile per new
    # shape: minutes of CPU compiling for per-sequence references)
    quick_gelu = getattr(quick_gelu, "_torchdynamo_orig_callable", quick_gelu)
    return dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                ffn_hidden_size=96, num_layers=4, add_bias_linear=True, activation_func=quick_gelu,
                activation_func_clamp_value=7.0, glu_linear_offset=1.0, window_size=(4, 0),
                window_attn_skip_freq=2, softmax_type="learnable", num_moe_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=32, moe_router_load_balancing_type="none",
                moe_token_dispatcher_type="alltoall", moe_router_pre_softmax=False)


def layer_spec_args(config) -> dict:
    return dict(qk_layernorm=config.qk_layernorm, normalization=config.normalization)


def build_gpt(config, spec, vocab: int = VOCAB, **model_kwargs):
    """GPTModel with rope base 1e6 and an untied LM head (Qwen2.5-1.5B+ style) unless
    ``share_embeddings_and_output_weights``; extra keywords (e.g. ``pre_process``/``post_process``
    of a pipeline stage) go to GPTModel."""
    from megatron.core.models.gpt import GPTModel

    model_kwargs = {"share_embeddings_and_output_weights": False, **model_kwargs}
    return GPTModel(
        config, spec, vocab_size=vocab, max_sequence_length=512, position_embedding_type="rope",
        rotary_base=1_000_000, **model_kwargs,
    )


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> None:
    """Weights large enough for sharp attention (so RoPE or mask errors show), biases and
    norm scales away from their 0/1 init (so those paths are exercised)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(std * noise)


def causal_mask(length: int) -> torch.Tensor:
    """``[1, 1, s, s]`` bool, True = masked (the stock DotProductAttention needs it)."""
    return torch.ones(1, 1, length, length, dtype=torch.bool).triu(1)


def stock_forward(model, seq) -> torch.Tensor:
    """Logits ``[L, V]`` of one sequence through a model, sbhd with an explicit causal mask."""
    ids = torch.as_tensor(np.asarray(seq), dtype=torch.long)[None]
    pos = torch.arange(ids.size(1))[None]
    return model(input_ids=ids, position_ids=pos, attention_mask=causal_mask(ids.size(1)))[0]


def reference_logprobs(per_seq_logits, seqs) -> torch.Tensor:
    """``[N]`` log-probs of each sequence's next tokens from its own logits (0 at its last
    token, as ``token_logprobs`` returns there)."""
    out = []
    for lg, s in zip(per_seq_logits, seqs):
        lp = torch.log_softmax(lg, -1)
        nxt = torch.as_tensor(np.asarray(s[1:]), dtype=torch.long)
        out.append(torch.cat([lp[:-1].gather(1, nxt[:, None])[:, 0], lp.new_zeros(1)]))
    return torch.cat(out)


def assert_tree_matches_stock(stock, tree, seqs) -> None:
    """The tree model's logits on the prefix forest of ``seqs`` (``min_prefix_len=1``) equal the
    stock model's per-sequence logits (fp32 oracle tolerance)."""
    from ps_mcore import plan_prefix_tree
    from ps_mcore.layer_specs import TreePackedSeqParams

    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan)
    with torch.no_grad():
        got = tree(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None],
                   attention_mask=None, packed_seq_params=psp)[0]
        ref = torch.cat([stock_forward(stock, s) for s in seqs])
    torch.testing.assert_close(plan.unpack(got), ref, rtol=1e-5, atol=1e-5)


def local_hybrid_stack_spec(stack, submodules_cls, gdn_config=None, mamba=False):
    """A hybrid stack spec (0.19's ``HybridStack`` / 0.16's ``MambaStack`` with its submodules
    dataclass) built from Megatron's local layers: attention (the GPT local layer, with its MLP),
    MLP, given a GDN config a Gated DeltaNet layer laid out as 0.19's ``hybrid_stack_spec``
    lays it out (a TransformerLayer with the stock GatedDeltaNet as self_attention, no MLP), and
    with ``mamba`` a MambaLayer (norm + the stock MambaMixer with local linears; its kernels
    need ``mamba_shims.shim_mamba_for_cpu()`` on CPU)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    gpt = get_gpt_layer_local_spec(normalization="RMSNorm")
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.submodules.pre_mlp_layernorm, mlp=gpt.submodules.mlp,
        mlp_bda=gpt.submodules.mlp_bda))
    layers = dict(attention_layer=gpt, mlp_layer=mlp)
    if gdn_config is not None:
        from gdn_shims import gdn_layer_spec

        mixer_only = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=gpt.submodules.input_layernorm, self_attn_bda=gpt.submodules.self_attn_bda))
        layers["gdn_layer"] = gdn_layer_spec(gdn_config, mixer_only)
    if mamba:
        from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
        from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        mixer = ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
        layers["mamba_layer"] = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=gpt.submodules.input_layernorm, mixer=mixer, mamba_bda=gpt.submodules.self_attn_bda))
    return ModuleSpec(module=stack, submodules=submodules_cls(**layers))


def shard_(full: torch.Tensor, param: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of a full TP=1 tensor, following megatron's partition attributes
    (``partition_stride`` 2 = SwiGLU fc1: each rank holds its slice of gate AND of up)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = full.chunk(stride * tp, dim)
    return torch.cat(chunks[rank::tp], dim)


def unshard(local: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`shard_`: the full tensor from every rank's shard (all-gather)."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    tp = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [p.chunk(stride, dim) for p in parts]  # pieces[rank][s]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim)


# ----------------------------------------------------------------------------- model parallel


class SPTorchNorm:
    """torch RMSNorm/LayerNorm for sequence parallelism (test-only: megatron's WrappedTorchNorm
    refuses SP; TE's and apex's norms, which allow it, do not exist on CPU). Like TENorm it marks
    its weights ``sequence_parallel`` so their grads are TP-summed (:func:`finalize_grads`)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        norm_cls = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def sp_block_spec(layer_spec, num_layers: int):
    """A block spec of ``layer_spec`` with megatron's torch norms (layer, qk and final)
    replaced by :class:`SPTorchNorm`."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def swap(sub, names):
        return dataclasses.replace(
            sub, **{n: SPTorchNorm for n in names if getattr(sub, n) is WrappedTorchNorm})

    attn = layer_spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=swap(attn.submodules, ("q_layernorm", "k_layernorm")))
    sub = swap(layer_spec.submodules, ("input_layernorm", "pre_mlp_layernorm"))
    layer = dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, self_attention=attn))
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=SPTorchNorm)


def sp_mtp_block_spec(mtp_spec):
    """megatron's MTP block spec with its torch norms (enorm, hnorm, final) replaced by
    :class:`SPTorchNorm` (its transformer layer: build the spec from :func:`sp_block_spec`'s)."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    names = ("enorm", "hnorm", "layer_norm")
    layers = [dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, **{
        n: SPTorchNorm for n in names if getattr(layer.submodules, n) is WrappedTorchNorm})) for layer in mtp_spec.layer_specs]
    return dataclasses.replace(mtp_spec, layer_specs=layers)


def finalize_grads(model, config, tp_group=None, cp_group=None) -> None:
    """Megatron's finalize_model_grads rules without a DDP wrapper: every grad is summed over
    CP (each CP rank saw its own rows); SP norm weights and qk-layernorm weights (replicated,
    but each TP rank saw its own rows / heads) are summed over TP."""
    for name, p in model.named_parameters():
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            dist.all_reduce(p.grad, group=cp_group)
        tp_summed = (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
            config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))
        if tp_summed and tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(p.grad, group=tp_group)


class _CpuScheduleTorch:
    """``torch`` as megatron's pipeline schedules see it: ``zeros(..., device="cuda")`` (the
    token counter, hard-coded) lands on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _gloo_batch_isend_irecv(ops):
    """``batch_isend_irecv`` for gloo, which matches messages per peer in posting order.

    Megatron's batched p2p lists are ``send_prev, recv_prev, send_next, recv_next``: with two
    stages the previous and next stage are one peer, whose ``recv_prev`` (posted first) wants
    this rank's ``send_next``; so two sends to one peer go next-first."""
    ops = list(ops)
    sends = [i for i, op in enumerate(ops) if op.op is dist.isend]
    if len(sends) == 2 and ops[sends[0]].peer == ops[sends[1]].peer:
        ops[sends[0]], ops[sends[1]] = ops[sends[1]], ops[sends[0]]
    return [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]


def enable_cpu_pipeline() -> None:
    """Test-only shims for megatron's pipeline schedules on gloo: the schedules allocate their
    token counter on ``"cuda"``, the p2p shape exchange calls ``torch.cuda.synchronize()``, and
    the interleaved (VPP) schedule's batched p2p needs gloo's per-peer ordering
    (:func:`_gloo_batch_isend_irecv`; also set ``batch_p2p_comm=False``)."""
    from megatron.core.pipeline_parallel import schedules

    torch.cuda.synchronize = lambda *args, **kwargs: None
    schedules.torch = _CpuScheduleTorch()
    dist.batch_isend_irecv = _gloo_batch_isend_irecv


def write_reports(report: dict, out_path: str) -> None:
    """Gather every rank's ``report`` and write the list as JSON from rank 0 (what the test
    that started the torchrun world reads back)."""
    import json

    import torch.distributed as dist

    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(reports, f)


def run_torchrun(script, nproc: int, *args, timeout: int = 300) -> None:
    """``torchrun --standalone --nproc_per_node nproc script *args`` on gloo in a clean
    environment (tests/ on PYTHONPATH, no inherited rank variables); raises with its output."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(script.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


# ----------------------------------------------------------------------------- TE-like specs


def te_like_core_attention():
    """Megatron's local ``DotProductAttention`` with the checkpoint behaviour of TE's
    ``DotProductAttention`` (test-only: TE needs CUDA): ``_extra_state`` is TE's byte tensor
    (empty for a module that never ran FP8, as ``TransformerEngineBaseModule.get_extra_state``
    returns), nothing in the sharded state dict with vanilla softmax (``TEDotProductAttention``;
    with ``learnable``: the offset and the extra state), and a missing key tolerated on load (TE's ``remove_extra_states_check`` hook)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class TELikeDotProductAttention(DotProductAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.fp8_state = torch.empty(0, dtype=torch.uint8)

            def tolerate_missing(module, keys):
                for key in list(keys.missing_keys):
                    if "core_attention._extra_state" in key:
                        keys.missing_keys.remove(key)

            self.register_load_state_dict_post_hook(tolerate_missing)

        def get_extra_state(self):
            return self.fp8_state

        def set_extra_state(self, state):
            if state is not None:
                self.fp8_state = state

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            if self.config.softmax_type != "learnable":
                return {}
            # TE's: the learnable offset split over TP, with the extra state (stock megatron code)
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0},
                sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    return TELikeDotProductAttention


def with_core_attention(layer_spec, core):
    """A GPT layer spec whose self attention's core attention is ``core`` (the rest shared)."""
    import dataclasses

    attn = layer_spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=core))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attn))


def te_like_layer_spec(**kwargs):
    """``get_gpt_layer_local_spec(**kwargs)`` whose core attention keys are TE's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return with_core_attention(get_gpt_layer_local_spec(**kwargs), te_like_core_attention())


def enable_cpu_sliding_window() -> None:
    """Test-only: megatron's local ``DotProductAttention`` builds its sliding-window mask with
    ``device="cuda"`` (``get_sliding_window_causal_mask``); the same mask on the CPU."""
    from megatron.core.fusions import fused_softmax

    def sliding_window_causal_mask(sq, skv, window_size):
        keep = torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq - window_size[0])
        return ~keep.tril(skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = sliding_window_causal_mask


def enable_cpu_dist_checkpointing() -> None:
    """Test-only: megatron's dist-checkpoint writer calls ``torch.cuda.synchronize()``."""
    torch.cuda.synchronize = lambda *args, **kwargs: None


# ----------------------------------------------------------------------------- MoE


class _CpuStream:
    """A stand-in for ``torch.cuda.Stream`` where everything runs in order (CPU)."""

    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


def enable_cpu_moe() -> None:
    """Test-only shims for megatron-core 0.16.1 MoE layers on CPU: ``moe_utils.te_general_gemm``
    exists only when TE imports, and the alltoall dispatcher copies its split sizes to the host
    on a side CUDA stream (as numpy split sizes, which on CPU stay tensors that gloo's
    all_to_all_single rejects)."""
    import contextlib

    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def to_host(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy().tolist()
        return tensor

    moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    stream = _CpuStream()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()


def allow_local_expert_bias_backward() -> None:
    """Test-only workaround for a megatron-core bug (0.16.1, still in 0.19.2) in the local-spec
    experts: with linear biases (GPT-OSS's ``add_bias_linear``) ``MLP.forward`` adds the expert
    bias in place (``output += ...``) to the output of ``linear_fc2``, which at TP=1 (expert
    RowParallelLinear without explicit expert communication) is the all-reduce
    ``_ReduceFromModelParallelRegion`` returning its input as is, a view autograd forbids to
    modify in place. The reduction of a world of 1 returns a copy instead (same values).
    Stock and tree models both run through it; TE's grouped experts take another path."""
    from megatron.core.tensor_parallel import mappings

    reduce = mappings._ReduceFromModelParallelRegion
    if getattr(reduce, "_copies_world_of_one", False):
        return
    original = reduce.forward

    def forward(ctx, input_, group):
        out = original(ctx, input_, group)
        return out.clone() if out is input_ else out

    reduce.forward = staticmethod(forward)
    reduce._copies_world_of_one = True


def enable_cpu_mla() -> None:
    """Test-only shim for megatron-core 0.16.1 MLA without TE: its module sets ``HAVE_TE = True``
    when megatron's TE extension module imports (it does, with a MagicMock ``TELinear`` when TE
    is missing) and then calls ``isinstance(x, TELinear)``."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def enable_cpu_recompute() -> None:
    """Test-only: megatron's activation checkpointing saves and restores the CUDA RNG state
    around the recomputed forward; on a CPU-only torch that state does not exist (the tests
    use no dropout), so saving returns an empty tensor and restoring does nothing."""
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda *args, **kwargs: None


def cpu_linear_cross_entropy(hidden, weight, labels, temperature, reduction, group, rows_seen=None):
    """CPU stand-in for verl's Triton ``linear_cross_entropy`` (same signature): ``(log_probs
    [R], entropy [R])`` of ``hidden [..., D]`` (R rows) against ``weight [V / tp, D]``. TP of
    one: verl's torch kernel ``FusedLinearForPPO``; vocab-parallel: the logits and verl's
    vocab-parallel entropy / log-prob functions, as its unfused Megatron path computes them.
    ``rows_seen``: a list the row count R is appended to."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO
    from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy, vocab_parallel_log_probs_from_logits

    assert reduction == "none"
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if rows_seen is not None:
        rows_seen.append(hidden.shape[0])
    if dist.get_world_size(group) == 1:
        return FusedLinearForPPO()(hidden, weight, labels, temperature)
    logits = (hidden @ weight.T).float() / temperature  # [R, V / tp]
    entropy = vocab_parallel_entropy(logits.clone())
    return vocab_parallel_log_probs_from_logits(logits[None], labels[None])[0], entropy
