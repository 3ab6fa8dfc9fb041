"""The precision setups and wrappers users train HF models with, on trees: fp32 weights under
``torch.autocast`` (bf16 and fp16 on the CPU), FSDP2 ``MixedPrecisionPolicy``, HF gradient
checkpointing (``use_reentrant`` True and False), PEFT LoRA with fp32 adapters on a bf16 base.
Each runs the stock model under the same setup one sequence at a time beside ``forward_tree``;
where the setup computes in 16 bits both are held against the float64 model: the tree's error
must be no larger than about the stock run's (RMS over every token, and the gradients)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gloo_world import run_in_gloo_world  # noqa: E402
from test_fsdp_bridge import (  # noqa: E402
    _sample_weights,
    assert_tree_matches,
    make_model,
    per_sequence_reference,
    random_forest,
    tree_run,
)
from test_fsdp_variants import make_variant_model, window_forest  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402

# The tree's RMS log-prob error and gradient error against float64 may be at most this many
# times the stock run's (both are rounding of the same 16-bit computation in another order).
MAX_ERROR_RATIO = 2.0


def _rms(x: torch.Tensor) -> float:
    return x.double().square().mean().sqrt().item()


def _grad_error(grads: dict, ref: dict) -> float:
    """Largest relative error (norm over the tensor) of any parameter's gradient."""
    return max(((grads[n].double() - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item() for n in ref)


def errors_against_float64(model, seqs, wrap=lambda m: m, context=contextlib.nullcontext):
    """``(stock, tree)`` errors of the log-probs (RMS) and the gradients (largest relative)
    against the float64 model, both runs under ``wrap`` and inside ``context``."""
    weights = _sample_weights(seqs)
    _, lp64, _, g64 = per_sequence_reference(copy.deepcopy(model).double(), seqs, weights)
    stock = wrap(copy.deepcopy(model))
    tree = wrap(model)
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    with context():
        _, lp_stock, _, g_stock = per_sequence_reference(stock, seqs, weights)
        out, g_tree = tree_run(tree, plan, weights)
    assert g_tree.keys() == g_stock.keys() and g_tree.keys() <= g64.keys()
    g64 = {n: g64[n] for n in g_tree}
    stock_err = (_rms(lp_stock - lp64), _grad_error(g_stock, g64))
    tree_err = (_rms(out.logprobs.detach().double() - lp64), _grad_error(g_tree, g64))
    return stock_err, tree_err


def assert_no_worse_than_stock(stock_err, tree_err):
    for what, s, t in zip(("log-prob RMS", "gradient"), stock_err, tree_err):
        assert t <= MAX_ERROR_RATIO * s + 1e-6, f"{what} error: tree {t:.3g} vs stock {s:.3g}"


# ----------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_fp32_weights_qwen2_sdpa(dtype):
    """RoPE leaves q/k in fp32 under autocast while v comes out of the projection in the
    autocast dtype: the tree casts all three as SDPA does (this raised a dtype error before)."""
    model = make_model("qwen2-gqa2-d24", attn="sdpa")
    stock, tree = errors_against_float64(model, random_forest(3, 8), context=lambda: torch.autocast("cpu", dtype=dtype))
    assert_no_worse_than_stock(stock, tree)


def test_autocast_gpt_oss_windows_sinks_moe():
    model = make_variant_model("gpt-oss").float()
    stock, tree = errors_against_float64(model, window_forest(0, 5),
                                         context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert_no_worse_than_stock(stock, tree)


def test_autocast_output_dtype_is_stock_s():
    model = make_model("qwen2-gqa2-d24", attn="sdpa").eval()
    seqs = random_forest(1)
    from ps_mcore.fsdp_bridge import forward_tree

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = copy.deepcopy(model)(input_ids=torch.tensor(seqs[0])[None]).logits.dtype
        got = forward_tree(model, plan_prefix_tree(seqs, min_prefix_len=1)).logits.dtype
    assert got == want == torch.bfloat16


# ----------------------------------------------------------------------------- wrappers


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gpt_oss(reentrant):
    """Checkpointed layers recompute in backward (reentrant: through the autograd Function
    HF's checkpoint uses); the tree call must recompute with its window and sinks."""
    model = make_variant_model("gpt-oss")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert_tree_matches(model, window_forest(1, 5))


def test_peft_lora_fp32_adapters_on_bf16_base():
    peft = pytest.importorskip("peft")
    base = make_model("qwen2-gqa2-d24", attn="sdpa").to(torch.bfloat16)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, lora)  # adapters stay fp32 (autocast_adapter_dtype)
    adapter = next(p for n, p in model.named_parameters() if "lora_A" in n)
    assert adapter.dtype == torch.float32 and model.base_model.model.lm_head.weight.dtype == torch.bfloat16
    stock, tree = errors_against_float64(model, random_forest(3, 8))
    assert_no_worse_than_stock(stock, tree)


_FSDP2_MP_SCRIPT = """
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from test_fsdp_precision import errors_against_float64, assert_no_worse_than_stock
from test_fsdp_variants import make_variant_model, window_forest
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

def wrap(model):
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)

import test_fsdp_precision as P  # gradients of DTensor parameters: one rank holds the whole tensor
plain = P._grad_error
P._grad_error = lambda g, ref: plain({n: getattr(t, "full_tensor", lambda: t)() for n, t in g.items()}, ref)
model = make_variant_model("gpt-oss").float()
stock, tree = errors_against_float64(model, window_forest(0, 5), wrap=wrap)
assert_no_worse_than_stock(stock, tree)
print("fsdp2 mixed precision ok", stock, tree)
"""


def test_fsdp2_mixed_precision_policy():
    """Real FSDP2 (gloo, world size 1, CPU) with bf16 parameters and fp32 reductions, in a
    subprocess so no process group leaks into other tests."""
    assert "fsdp2 mixed precision ok" in run_in_gloo_world(_FSDP2_MP_SCRIPT, timeout=600)
