"""HF bridge: real transformers model classes (tiny random configs, fp32, CPU) on packed
prefix forests vs. each sequence run alone through the stock attention."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from conftest import assert_grads_close, grads_of  # noqa: E402
from forests import assert_branches, forests  # noqa: E402
from gloo_world import run_in_gloo_world  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.fsdp_bridge import (  # noqa: E402
    ATTN_NAME,
    TreeCall,
    base_implementation,
    disable_tree_attention,
    enable_tree_attention,
    forward_tree,
    hf_call,
    prefix_tree_attention,
    register_attention,
    unwrap_model,
)
from ps_mcore.minibatch import plan_minibatch  # noqa: E402
from ps_mcore.schedule import ScheduleRunner  # noqa: E402

VOCAB = 61

# family, query heads, kv heads, head dim: GQA ratios 1, 2 and 3; odd head dims 24 and 40.
MODELS = {
    "qwen2-gqa2-d24": ("qwen2", 4, 2, 24),  # qkv bias
    "qwen3-mha-d40": ("qwen3", 4, 4, 40),  # qk-norm
    "llama-gqa3-d16": ("llama", 6, 2, 16),
}


def make_config(family: str, heads: int, kv_heads: int, head_dim: int, attn: str = "eager", **extra):
    common = dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
        attn_implementation=attn,
    )
    common.update(extra)
    cls = {
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "llama": transformers.LlamaConfig,
    }[family]
    return cls(**common)


def make_model(name: str = "qwen2-gqa2-d24", attn: str = "eager", seed: int = 0, **extra):
    family, heads, kv_heads, head_dim = MODELS[name]
    config = make_config(family, heads, kv_heads, head_dim, attn, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.train()  # attention dropout is 0: training mode must still be exact
    return model


# ----------------------------------------------------------------------------- forests


def _tokens(rng, n):
    return rng.integers(0, VOCAB, n).tolist()


def random_forest(seed: int, num_seqs: int = 6, alphabet: int = VOCAB) -> list[list[int]]:
    """Each sequence extends a random prefix (possibly empty or whole) of an earlier one, so
    duplicates, prefixes of others and branches all occur."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, alphabet, rng.integers(1, 12)).tolist()]
    while len(seqs) < num_seqs:
        base = seqs[rng.integers(len(seqs))]
        cut = int(rng.integers(0, len(base) + 1))
        tail = rng.integers(0, alphabet, rng.integers(0, 8)).tolist()
        seq = base[:cut] + tail
        seqs.append(seq if seq else [int(rng.integers(alphabet))])
    return seqs


def _nasty(name: str) -> list[list[int]]:
    rng = np.random.default_rng(7)
    a, b = _tokens(rng, 11), _tokens(rng, 9)
    if name == "single":
        return [a]
    if name == "duplicates":
        return [a, list(a), list(a)]
    if name == "prefix-of-another":
        return [a[:5], a, b, a[:1]]
    if name == "single-tokens":
        return [[3], [3], [5], a, [a[0]]]
    if name == "deep-chain":
        chain, seqs = [], []
        for step in range(7):
            chain = chain + _tokens(rng, 1 + step % 3)
            seqs.append(list(chain))
        return seqs
    if name == "no-sharing":
        return [[1] + a, [2] + b, [4] + a[:3]]
    if name == "grpo":
        prompt = _tokens(rng, 8)
        return [prompt + _tokens(rng, int(n)) for n in (3, 5, 1, 4)]
    if name == "tree":  # branches at depths 11, then 14 and 13; one sample ends at a branch point
        return assert_branches([a + [3, 4, 5] + t for t in ([6, 7], [8])] + [a + [9, 1] + t for t in ([2], [4, 4, 4])]
                               + [a + [9, 1]])
    raise ValueError(name)


NASTY = ("single", "duplicates", "prefix-of-another", "single-tokens", "deep-chain", "no-sharing", "grpo", "tree")


# ----------------------------------------------------------------------------- oracle


def _sample_weights(seqs, seed=0) -> list[float]:
    rng = np.random.default_rng(seed + 100)
    return rng.uniform(-1.0, 2.0, len(seqs)).tolist()


def per_sequence_reference(model, seqs, weights, entropy_coef=0.3):
    """Each sequence alone through the model's stock attention: concatenated logits [N, V],
    log-probs [N] (0 at each last token), entropy [N], and parameter gradients of the
    per-sample-weighted loss."""
    model.zero_grad(set_to_none=True)
    logits, logprobs, entropy = [], [], []
    loss = 0.0
    for seq, w in zip(seqs, weights):
        ids = torch.tensor(seq)[None]
        lg = model(input_ids=ids, use_cache=False).logits[0]
        logp = torch.log_softmax(lg.double(), -1)
        lp = torch.zeros(len(seq), dtype=torch.float64)
        lp[:-1] = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        loss = loss + w * (lp.sum() + entropy_coef * ent.sum())
        logits.append(lg)
        logprobs.append(lp)
        entropy.append(ent)
    loss.backward()
    return torch.cat(logits).detach(), torch.cat(logprobs), torch.cat(entropy).detach(), grads_of(model)


def tree_run(model, plan, weights, entropy_coef=0.3, backend="auto"):
    model.zero_grad(set_to_none=True)
    out = forward_tree(model, plan, compute_logprobs=True, compute_entropy=True, backend=backend)
    w = torch.repeat_interleave(torch.tensor(weights, dtype=torch.float64), torch.tensor(plan.seq_lens))
    loss = (w * (out.logprobs.double() + entropy_coef * out.entropy.double())).sum()
    loss.backward()
    return out, grads_of(model)


# Every parameter's gradient, relative to the largest gradient of the model: a gradient that is
# exactly 0 in theory (q/k of a single-token model) is float noise on both sides.
GRAD_TOL = dict(rtol=1e-4, atol=2e-6, scale="model")


def assert_tree_matches(model, seqs, min_prefix_len=1, backend="auto"):
    reference_model = copy.deepcopy(model)  # never switched to prefix_tree
    weights = _sample_weights(seqs)
    ref_logits, ref_lp, ref_ent, ref_grads = per_sequence_reference(reference_model, seqs, weights)

    plan = plan_prefix_tree(seqs, min_prefix_len=min_prefix_len)
    out, grads = tree_run(model, plan, weights, backend=backend)

    torch.testing.assert_close(plan.unpack(out.logits).detach(), ref_logits, rtol=1e-5, atol=1e-5)
    mask = plan.next_token_mask
    torch.testing.assert_close(out.logprobs.double(), ref_lp, rtol=1e-5, atol=1e-5)
    assert torch.all(out.logprobs[~mask] == 0)
    torch.testing.assert_close(out.entropy.double(), ref_ent.double(), rtol=1e-5, atol=1e-5)
    assert len(grads) == len(list(model.parameters()))
    assert_grads_close(grads, ref_grads, **GRAD_TOL)
    return plan


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("forest", NASTY)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_nasty_forests_match_per_sequence(model_name, forest):
    plan = assert_tree_matches(make_model(model_name), _nasty(forest))
    if forest in ("duplicates", "prefix-of-another", "deep-chain", "grpo"):
        assert plan.num_tokens < plan.num_input_tokens  # sharing really happened


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_random_forests_match_per_sequence(model_name, seed):
    min_prefix_len = 1 + seed % 3
    seqs = assert_branches(random_forest(seed))  # these seeds branch inside a branch
    assert_tree_matches(make_model(model_name), seqs, min_prefix_len=min_prefix_len)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=forests(max_seqs=6, max_len=12), min_prefix_len=st.integers(1, 4))
def test_hypothesis_forests_match_per_sequence(seqs, min_prefix_len):
    # Half random shapes (3-letter roots: shared runs, duplicates, branch points by chance),
    # half trees that branch inside a branch. In float64: random shapes hunt structural errors,
    # and a sample repeated five times sums its gradients in another order than five separate
    # runs, which in float32 can miss the tolerance by rounding alone (found by hypothesis:
    # [[0, 1, 2]] * 3 + [[0, 1, 2, 5, 11], [0, 1, 2]], 5e-5 on a gradient of scale 19).
    assert_tree_matches(make_model("qwen2-gqa2-d24").double(), seqs, min_prefix_len=min_prefix_len)


def test_sliding_window_wider_than_every_context_is_exact():
    seqs = _nasty("tree")
    model = make_model("qwen2-gqa2-d24", use_sliding_window=True, sliding_window=64, max_window_layers=0)
    assert_tree_matches(model, seqs)


def test_non_default_softmax_scale_gemma3():
    """Gemma3 scales by query_pre_attn_scalar**-0.5, not head_dim**-0.5: the scale must be
    the module's, and its wide sliding windows mask nothing here."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=5,
        sliding_window=512, initializer_range=0.2, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    assert model.model.layers[0].self_attn.scaling != 24**-0.5
    assert_tree_matches(model, random_forest(8))


def test_float64_model_forward_at_float64_precision():
    """A float64 model's tree forward equals its per-sequence forward to float64 precision:
    the CPU kernels compute float64 inputs in float64. (Gradients are compared at the usual
    tolerance: Hugging Face's RMSNorm computes in float32 whatever the dtype, and the tree and
    the unshared run sum shared rows' gradients at different sides of it.)"""
    model = make_model("qwen2-gqa2-d24", attn="sdpa").double()
    reference_model = copy.deepcopy(model)
    seqs = random_forest(3)
    weights = _sample_weights(seqs)
    ref_logits, ref_lp, ref_ent, ref_grads = per_sequence_reference(reference_model, seqs, weights)
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    assert plan.num_tokens < plan.num_input_tokens
    for backend in ("chunked", "reference"):
        out, grads = tree_run(model, plan, weights, backend=backend)
        assert out.logits.dtype == out.logprobs.dtype == torch.float64
        torch.testing.assert_close(plan.unpack(out.logits).detach(), ref_logits, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.logprobs, ref_lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.entropy.detach(), ref_ent, rtol=1e-12, atol=1e-12)
        assert_grads_close(grads, ref_grads, **GRAD_TOL)


def test_hidden_states_skip_the_lm_head():
    model = make_model("qwen3-mha-d40").eval()
    seqs = _nasty("prefix-of-another")
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    with torch.no_grad():
        ref = torch.cat([model.model(input_ids=torch.tensor(s)[None]).last_hidden_state[0] for s in seqs])
        out = forward_tree(model, plan, return_logits=False, return_hidden_states=True)
        bare = forward_tree(model.model, plan, return_logits=False, return_hidden_states=True)
    assert out.logits is None and out.logprobs is None
    torch.testing.assert_close(plan.unpack(out.hidden_states), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bare.hidden_states, out.hidden_states, rtol=0, atol=0)


def test_value_head_model():
    config = make_config("qwen2", 4, 2, 24, num_labels=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForTokenClassification.from_config(config).eval()
    seqs = _nasty("tree")
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    with torch.no_grad():
        ref = torch.cat([model(input_ids=torch.tensor(s)[None]).logits[0] for s in seqs])
        out = forward_tree(model, plan)
    assert out.logits.shape == (plan.num_tokens, 1)
    torch.testing.assert_close(plan.unpack(out.logits), ref, rtol=1e-5, atol=1e-5)


def test_peft_lora_wrapper():
    peft = pytest.importorskip("peft")
    model = make_model("qwen2-gqa2-d24")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(model, lora)
    assert unwrap_model(wrapped) is model
    seqs = random_forest(3)
    weights = _sample_weights(seqs)
    ref_logits, ref_lp, _, ref_grads = per_sequence_reference(wrapped, seqs, weights)
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    out, grads = tree_run(wrapped, plan, weights)
    torch.testing.assert_close(plan.unpack(out.logits).detach(), ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logprobs.double(), ref_lp, rtol=1e-5, atol=1e-5)
    assert any("lora" in n for n in grads)
    assert_grads_close(grads, ref_grads, **GRAD_TOL)


_FSDP_SCRIPT = """
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
from test_fsdp_bridge import make_model, random_forest, per_sequence_reference, _sample_weights
from ps_mcore import plan_prefix_tree
from ps_mcore.fsdp_bridge import forward_tree, unwrap_model
seqs = random_forest(5)
plan = plan_prefix_tree(seqs, min_prefix_len=1)
for kind in ("fsdp1", "fsdp2"):
    model = make_model("qwen2-gqa2-d24")
    ref_logits, ref_lp, _, _ = per_sequence_reference(model, seqs, _sample_weights(seqs))
    if kind == "fsdp1":
        wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    assert unwrap_model(wrapped) is model
    out = forward_tree(wrapped, plan, compute_logprobs=True)
    torch.testing.assert_close(plan.unpack(out.logits).detach(), ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logprobs.double(), ref_lp, rtol=1e-5, atol=1e-5)
    out.logprobs.sum().backward()
    assert all(p.grad is not None for p in wrapped.parameters())
    print(kind, "ok")
"""


def test_fsdp1_and_fsdp2_wrappers():
    """Real FSDP (gloo, world size 1) in a subprocess, so no process group leaks into others."""
    out = run_in_gloo_world(_FSDP_SCRIPT)
    assert "fsdp1 ok" in out and "fsdp2 ok" in out


_FSDP2_INPUT_CAST_SCRIPT = """
import copy
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from test_fsdp_bridge import GRAD_TOL, make_model, random_forest, tree_run, _sample_weights, assert_grads_close
from ps_mcore import plan_prefix_tree
seqs = random_forest(7)
weights = _sample_weights(seqs)
for dtype in (torch.float32, torch.bfloat16):
    model = make_model("qwen2-gqa2-d24", attn="sdpa")
    plain = copy.deepcopy(model)  # unwrapped, parameters in the policy's dtype (buffers kept, as FSDP2 keeps them)
    for p in plain.parameters():
        p.data = p.data.to(dtype)
    ref, ref_grads = tree_run(plain, plan_prefix_tree(seqs, min_prefix_len=1), weights)
    # verl's fsdp2 engine: bf16 (or the configured) parameters, inputs cast by FSDP's hook
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    wrapped = fully_shard(model, mp_policy=policy)
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    plan.to("meta")  # the plan and its moved copy link each other, as a GPU run's plan and host copy do
    out, grads = tree_run(wrapped, plan, weights)
    # every layer ran on this plan: the layout its first layer built is in its own memo
    assert torch.device("cpu") in plan.memo.cascade_layouts
    if dtype == torch.float32:
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.entropy, ref.entropy, rtol=1e-5, atol=1e-5)
        assert_grads_close(grads, ref_grads, **GRAD_TOL)
    else:  # the same bf16 forward; gradients reduced in fp32 vs the plain model's bf16
        assert out.logits.dtype == torch.bfloat16
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
        torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=0, atol=0)
        for name, g in grads.items():
            torch.testing.assert_close(g.to(dtype), ref_grads[name], rtol=2e-2, atol=2e-2, msg=name)
    print(dtype, "ok")
"""


def test_fsdp2_input_cast_leaves_the_plan_alone():
    """FSDP2 with a ``MixedPrecisionPolicy`` that casts forward inputs (verl's fsdp2 engine)
    walks the model's kwargs and rebuilds dataclasses field by field: the tree call must reach
    every layer untouched (its plan not rebuilt, so the plan's memo serves every layer, and a
    plan linked to its moved copy does not recurse), with results equal to the unwrapped
    model's. Real FSDP2 (gloo, world size 1) in a subprocess."""
    out = run_in_gloo_world(_FSDP2_INPUT_CAST_SCRIPT)
    assert "torch.float32 ok" in out and "torch.bfloat16 ok" in out


# ----------------------------------------------------------------------------- stock fallback


def _packed_batch(seqs):
    """Several sequences in one row, told apart only by position_ids restarting at 0."""
    ids = torch.tensor([t for s in seqs for t in s])[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return dict(input_ids=ids, position_ids=pos)


def _padded_batch(seqs, left: bool):
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s)
        mask[i, cols] = 1
    return dict(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_unshared_batches_fall_back_to_stock_bit_for_bit(attn):
    model = make_model("llama-gqa3-d16", attn=attn)
    stock = copy.deepcopy(model)
    enable_tree_attention(model)
    assert model.config._attn_implementation == ATTN_NAME
    assert base_implementation(model.config) == attn
    seqs = _nasty("prefix-of-another")
    batches = {
        "packed": _packed_batch(seqs),
        "right-padded": _padded_batch(seqs, left=False),
        "left-padded": _padded_batch(seqs, left=True),
        "plain": dict(input_ids=torch.tensor(seqs[1])[None]),
    }
    for name, batch in batches.items():
        got = model(**batch, use_cache=False).logits
        want = stock(**batch, use_cache=False).logits
        assert torch.equal(got, want), name
    # gradients too, through the packed (position_ids) path
    model(**batches["packed"], use_cache=False).logits.square().sum().backward()
    stock(**batches["packed"], use_cache=False).logits.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        assert torch.equal(p.grad, q.grad), name
    disable_tree_attention(model)
    assert model.config._attn_implementation == attn


def test_fallback_reports_the_base_name_to_the_stock_function():
    """Flash attention reads module.config._attn_implementation to pick its kernel; a
    registered stand-in checks the fallback shows it the base name, not "prefix_tree"."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen = []

    def stand_in(module, *args, **kwargs):
        seen.append(module.config._attn_implementation)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("ps_test_stand_in", stand_in)
    AttentionMaskInterface.register("ps_test_stand_in", sdpa_mask)
    model = make_model("qwen2-gqa2-d24", attn="ps_test_stand_in").eval()
    stock = copy.deepcopy(model)
    enable_tree_attention(model)
    batch = _packed_batch(_nasty("no-sharing"))
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, stock(**batch).logits)
    assert seen and set(seen) == {"ps_test_stand_in"}
    assert model.config._attn_implementation == ATTN_NAME


def test_mixed_calls_after_a_tree_forward():
    """forward_tree switches the model back; the next unshared call is stock again, also on a
    model switched for good (enable_tree_attention), which forward_tree leaves switched."""
    model = make_model("qwen2-gqa2-d24", attn="sdpa").eval()
    stock = copy.deepcopy(model)
    seqs = _nasty("duplicates")
    batch = _padded_batch(seqs + [[1, 2]], left=False)
    with torch.no_grad():
        forward_tree(model, plan_prefix_tree(seqs))
        assert model.config._attn_implementation == "sdpa"
        assert torch.equal(model(**batch).logits, stock(**batch).logits)
        enable_tree_attention(model)
        forward_tree(model, plan_prefix_tree(seqs))
        assert model.config._attn_implementation == ATTN_NAME
        assert torch.equal(model(**batch).logits, stock(**batch).logits)


# ----------------------------------------------------------------------------- side effects


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attn_implementation_is_restored_also_on_errors(attn):
    """verl, TRL, PEFT and save_pretrained read config._attn_implementation: forward_tree
    leaves it (and the layers' checkpoint functions) as the user set them."""
    model = make_model("qwen3-mha-d40", attn=attn)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer = model.model.layers[0]
    checkpoint = layer._gradient_checkpointing_func
    plan = plan_prefix_tree(_nasty("grpo"), min_prefix_len=1)
    out = forward_tree(model, plan, compute_logprobs=True)
    assert model.config._attn_implementation == attn
    assert layer._gradient_checkpointing_func is checkpoint
    out.logprobs.sum().backward()  # recomputes the checkpointed layers
    assert model.config._attn_implementation == attn
    with pytest.raises(ValueError, match="unknown tree attention backend"):
        forward_tree(model, plan, backend="no-such-kernel")  # raised inside the model forward
    assert model.config._attn_implementation == attn
    assert layer._gradient_checkpointing_func is checkpoint
    assert "prefix_tree" not in model.config.to_json_string()


@pytest.mark.parametrize("model_name, attn, backend, reentrant", [
    ("qwen2-gqa2-d24", "sdpa", "auto", False),
    ("qwen2-gqa2-d24", "sdpa", "auto", True),
    ("llama-gqa3-d16", "eager", "reference", False),
])
def test_checkpointed_layers_recompute_with_tree_attention_after_the_switch_back(model_name, attn, backend, reentrant):
    """Backward runs after forward_tree gave the model its own implementation back; the
    recomputed layers must still run tree attention (sdpa would see a tree mask it cannot
    apply). Gradients equal the unshared run's."""
    model = make_model(model_name, attn=attn)
    reference_model = copy.deepcopy(model)
    seqs = random_forest(12)
    weights = _sample_weights(seqs)
    _, ref_lp, _, ref_grads = per_sequence_reference(reference_model, seqs, weights)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    out = forward_tree(model, plan, compute_logprobs=True, compute_entropy=True, backend=backend)
    assert model.config._attn_implementation == attn
    w = torch.repeat_interleave(torch.tensor(weights, dtype=torch.float64), torch.tensor(plan.seq_lens))
    (w * (out.logprobs.double() + 0.3 * out.entropy.double())).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(out.logprobs.double(), ref_lp, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, **GRAD_TOL)


# ----------------------------------------------------------------------------- registration


def test_registration_is_explicit_and_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    code = (
        "import ps_mcore, ps_mcore.fsdp_bridge\n"
        "from transformers import AttentionInterface\n"
        "assert 'prefix_tree' not in AttentionInterface._global_mapping\n"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
    register_attention()
    size = len(AttentionInterface._global_mapping), len(AttentionMaskInterface._global_mapping)
    register_attention()
    assert AttentionInterface._global_mapping[ATTN_NAME] is prefix_tree_attention
    assert (len(AttentionInterface._global_mapping), len(AttentionMaskInterface._global_mapping)) == size


def test_enable_twice_keeps_the_base_implementation():
    model = make_model(attn="sdpa")
    assert enable_tree_attention(model) == [model.config]
    assert enable_tree_attention(model) == []
    assert base_implementation(model.config) == "sdpa"
    disable_tree_attention(model)
    assert model.config._attn_implementation == "sdpa"


# ----------------------------------------------------------------------------- bad inputs


@pytest.fixture
def small():
    model = make_model("qwen2-gqa2-d24").eval()
    seqs = _nasty("grpo")
    return model, seqs, plan_prefix_tree(seqs, min_prefix_len=1)


def test_forward_tree_rejects_bad_arguments(small):
    model, seqs, plan = small
    with pytest.raises(TypeError, match="TreePlan"):
        forward_tree(model, seqs)
    with pytest.raises(ValueError, match="attention_mask"):
        forward_tree(model, plan, attention_mask=torch.ones(1, plan.num_tokens))
    with pytest.raises(ValueError, match="KV cache"):
        forward_tree(model, plan, use_cache=True)
    with pytest.raises(ValueError, match="return_dict"):
        forward_tree(model, plan, return_dict=False)
    with pytest.raises(ValueError, match="temperature"):
        forward_tree(model, plan, compute_logprobs=True, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        forward_tree(model, plan_prefix_tree([[1, 2, VOCAB]]))
    with pytest.raises(ValueError, match="no logits"):
        forward_tree(model.model, plan)
    with pytest.raises(ValueError, match="PreTrainedModel"):
        forward_tree(torch.nn.Sequential(torch.nn.Linear(2, 2)), plan)


def test_direct_model_calls_with_a_plan_are_checked(small):
    model, _, plan = small
    enable_tree_attention(model)
    ids, pos = plan.input_ids[None], plan.position_ids[None]
    with torch.no_grad():
        good = model(input_ids=ids, position_ids=pos, tree_call=TreeCall(plan), use_cache=False).logits
        via_forward_tree = forward_tree(model, plan).logits
        assert torch.equal(good[0], via_forward_tree)
        with pytest.raises(ValueError, match="one row"):
            model(input_ids=ids.expand(2, -1), position_ids=pos.expand(2, -1), tree_call=TreeCall(plan))
        with pytest.raises(ValueError, match="position_ids must be plan.position_ids"):
            model(input_ids=ids, position_ids=torch.arange(plan.num_tokens)[None], tree_call=TreeCall(plan))
        padding = torch.ones_like(ids)
        padding[0, -1] = 0
        with pytest.raises(ValueError, match="padding"):
            model(input_ids=ids, position_ids=pos, attention_mask=padding, tree_call=TreeCall(plan))
        with pytest.raises(TypeError, match="tree_call must be a TreeCall"):
            model(input_ids=ids, position_ids=pos, tree_call=plan)
        with pytest.raises(TypeError, match="TreeCall needs a TreePlan"):
            TreeCall("plan")
        # a bare plan would reach the stock attention, which ignores it: refused by name
        with pytest.raises(TypeError, match="tree_plan=.*tree_call=TreeCall"):
            model(input_ids=ids, position_ids=pos, tree_plan=plan)
        with pytest.raises(ValueError, match="tree_plan"):
            forward_tree(model, plan, tree_plan=plan)


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_model_matches_eager_without_recompiling_per_plan(checkpointing):
    """torch.compile(model) then forward_tree: the tree attention runs between the compiled
    graphs (its host-side layouts never enter one), outputs and gradients equal the eager
    tree run, and plans of other lengths and shapes reuse the compiled graphs; also with
    activation checkpointing. (aot_eager: Dynamo and AOTAutograd as inductor sees them,
    without CPU code generation.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = make_model("llama-gqa3-d16", attn="sdpa", num_hidden_layers=1)
    eager = copy.deepcopy(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    batches = [random_forest(5), _nasty("grpo"), _nasty("deep-chain")]
    graphs = []
    for seqs in batches:
        plan = plan_prefix_tree(seqs, min_prefix_len=1)
        weights = _sample_weights(seqs)
        out, grads = tree_run(compiled, plan, weights)
        grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
        ref, ref_grads = tree_run(eager, plan, weights)
        torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.entropy, ref.entropy, rtol=1e-6, atol=1e-6)
        assert_grads_close(grads, ref_grads, **GRAD_TOL)
        assert model.config._attn_implementation == "sdpa"
        graphs.append(counters["stats"]["unique_graphs"])
    assert len({plan_prefix_tree(f).num_tokens for f in batches}) == 3
    assert len({len(f) for f in batches}) == 3  # and sequence counts
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs  # no recompile for new plans


# ----------------------------------------------------------------------------- dropout


def phi3_model(resid_pdrop=0.0, attn="sdpa", seed=0):
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        resid_pdrop=resid_pdrop, embd_pdrop=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        initializer_range=0.2, attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _refusal(model, plan, *keys):
    with pytest.raises(ValueError, match="shared_dropout=True") as err:
        forward_tree(model, plan)
    for key in keys:
        assert key in str(err.value), str(err.value)
    return str(err.value)


def test_dropout_outside_attention_is_refused_per_module_kind():
    """Every active dropout that would see a shared row, each named with its config key, in
    one message: HF residual dropouts, a value head's classifier dropout, PEFT's lora_dropout
    and functional dropouts (OPT's float rates)."""
    peft = pytest.importorskip("peft")
    plan = plan_prefix_tree(_nasty("grpo"), min_prefix_len=1)
    msg = _refusal(phi3_model(resid_pdrop=0.1), plan, "resid_attn_dropout", "resid_mlp_dropout", "resid_pdrop")
    assert "embd_pdrop" not in msg  # keys are matched to the sites they set

    config = make_config("qwen2", 4, 2, 24, num_labels=1, classifier_dropout=0.2)
    value_model = transformers.AutoModelForTokenClassification.from_config(config).train()
    _refusal(value_model, plan, "dropout (p=0.2", "classifier_dropout")

    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
    wrapped = peft.get_peft_model(make_model("qwen2-gqa2-d24"), lora)
    _refusal(wrapped, plan, "q_proj.lora_dropout", "v_proj.lora_dropout", "lora_dropout (the PEFT")

    opt = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=1, num_attention_heads=2,
        word_embed_proj_dim=32, max_position_embeddings=256, dropout=0.1, attention_dropout=0.0,
    )
    _refusal(transformers.AutoModelForCausalLM.from_config(opt).train(), plan, "layers.*.dropout", "config key dropout")

    # a dropout module switched to eval inside a training model does not run: not refused
    value_model.dropout.eval()
    assert forward_tree(value_model, plan).logits.shape == (plan.num_tokens, 1)


def test_dropout_in_eval_mode_is_exact():
    """model.eval() turns every dropout off: the tree run is the unshared one."""
    assert_tree_matches(phi3_model(resid_pdrop=0.3).eval(), random_forest(4))


def test_shared_dropout_opt_in():
    """shared_dropout=True runs the dropouts on the packed rows: reproducible under a seed, a
    mask per packed row (samples sharing a row share its mask, where the unshared run draws
    one per sample), and on a plan without sharing exactly the stock run of the packed batch."""
    model = phi3_model(resid_pdrop=0.3)
    seqs = _nasty("duplicates")  # three identical samples: every row shared by all three
    plan = plan_prefix_tree(seqs, min_prefix_len=1)

    def tree(seed):
        torch.manual_seed(seed)
        return forward_tree(model, plan, compute_logprobs=True, shared_dropout=True).logprobs

    first, again, other = tree(0), tree(0), tree(1)
    assert torch.equal(first, again) and not torch.equal(first, other)
    with torch.no_grad():
        assert not torch.allclose(first, forward_tree(model.eval(), plan, compute_logprobs=True).logprobs)
    model.train()
    per_sample = first.view(3, -1)
    assert torch.equal(per_sample[0], per_sample[1]) and torch.equal(per_sample[0], per_sample[2])
    torch.manual_seed(0)  # the unshared run: independent masks per sample
    stock = [model(input_ids=torch.tensor(s)[None]).logits for s in seqs]
    assert not torch.equal(stock[0], stock[1])

    unshared = plan_prefix_tree(_nasty("no-sharing"))
    assert unshared.is_trivial  # rows = the batch concatenated: the same masks as stock
    torch.manual_seed(3)
    got = forward_tree(model, unshared, shared_dropout=True).logits
    torch.manual_seed(3)
    want = model(**_packed_batch(_nasty("no-sharing")), use_cache=False).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_training_attention_dropout_is_refused():
    """Attention dropout has no shared-mask variant: refused with or without the opt-in
    (forward_tree before the forward; the attention itself on a direct model call)."""
    model = make_model(attention_dropout=0.1)  # train mode
    plan = plan_prefix_tree(_nasty("grpo"))
    for shared_dropout in (False, True):
        with pytest.raises(ValueError, match="attention dropout is not supported.*attention_dropout to 0"):
            forward_tree(model, plan, shared_dropout=shared_dropout)
    enable_tree_attention(model)
    with pytest.raises(NotImplementedError, match="attention dropout"):
        model(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None], tree_call=TreeCall(plan))
    model.eval()
    assert forward_tree(model, plan).logits.shape == (plan.num_tokens, VOCAB)


def test_unsupported_attention_features_are_refused(small):
    model, _, plan = small
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, plan.num_tokens, 24)
    kv = torch.zeros(1, 2, plan.num_tokens, 24)
    with pytest.raises(NotImplementedError, match="position bias"):
        prefix_tree_attention(attn, q, kv, kv, None, tree_call=TreeCall(plan), position_bias=torch.zeros(1, 4, 1, 1))
    dense = torch.zeros(1, 1, plan.num_tokens, plan.num_tokens)
    with pytest.raises(ValueError, match="prepared attention mask"):
        prefix_tree_attention(attn, q, kv, kv, dense, tree_call=TreeCall(plan))
    with pytest.raises(ValueError, match="KV cache"):
        prefix_tree_attention(attn, q, kv[:, :, :-1], kv[:, :, :-1], None, tree_call=TreeCall(plan))
    with pytest.raises(NotImplementedError, match="not causal"):
        prefix_tree_attention(attn, q, kv, kv, None, tree_call=TreeCall(plan), is_causal=False)


# ----------------------------------------------------------------------------- schedules


def schedule_run(model, seqs, weights, budget=None, kv_row_cost=0.25, entropy_coef=0.3, plan=None, training=True):
    """A cross-micro-batch schedule of ``seqs`` (or of ``plan``) on an HF model: ``hf_call``
    per call, the per-sample-weighted loss per step, releases (``training=False``: a
    forward-only plan under no_grad). Returns (log-probs [N], entropy [N], grads)."""
    if plan is None:
        plan = plan_minibatch(seqs, budget, kv_row_cost=kv_row_cost, min_prefix_len=1, training=training)
    assert plan.num_steps > 1 and any(c.kept for c in plan.calls)
    model.zero_grad(set_to_none=True)
    runner = ScheduleRunner(plan, hf_call(model, compute_entropy=True), training=training)
    w = torch.repeat_interleave(torch.tensor(weights, dtype=torch.float64), torch.tensor(plan.tree.seq_lens))
    lp = torch.zeros(plan.tree.num_input_tokens, dtype=torch.float64)
    ent = torch.zeros_like(lp)
    with torch.set_grad_enabled(training):
        for j, step in enumerate(plan.steps):
            out = runner.forward(j)
            tokens = torch.from_numpy(plan.sample_tokens(step.samples))
            lp[tokens], ent[tokens] = out["log_probs"].detach().double(), out["entropy"].detach().double()
            if training:
                (w[tokens] * (out["log_probs"].double() + entropy_coef * out["entropy"].double())).sum().backward()
            runner.release(j)
        runner.finish()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp, ent, grads


@pytest.mark.parametrize("name,checkpointing", [("qwen2-gqa2-d24", False), ("llama-gqa3-d16", True)])
def test_cross_micro_batch_schedule_matches_per_sequence(name, checkpointing):
    """Hugging Face models run a mini-batch plan through the same attention function: every
    row once across micro-batches (a prompt longer than the budget kept as a K/V chain), equal
    to each sequence alone; with activation checkpointing too."""
    model = make_model(name)
    reference_model = copy.deepcopy(model)
    rng = np.random.default_rng(5)
    prompt = _tokens(rng, 30)
    seqs = assert_branches([prompt + _tokens(rng, int(rng.integers(2, 8))) for _ in range(4)] + random_forest(12))
    weights = _sample_weights(seqs)
    _, ref_lp, ref_ent, ref_grads = per_sequence_reference(reference_model, seqs, weights)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lp, ent, grads = schedule_run(model, seqs, weights, budget=12, kv_row_cost=0.2)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.double(), rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, **GRAD_TOL)


@pytest.mark.parametrize("forest", NASTY)
@pytest.mark.parametrize("sp", [2, 3, 4])
def test_sequence_parallel_ranks_split_the_labelled_pairs(forest, sp):
    """Under Ulysses SP each rank runs verl's fused kernel on the (row, label) pairs of the rows
    it holds (``SequenceParallelPlan.local_pairs``): over the ranks, those pairs are every
    pair once, in order, with rows local to the rank's chunk (ranks holding only padding rows
    get none)."""
    from ps_mcore.fsdp_bridge.sequence_parallel import SequenceParallelPlan
    from ps_mcore.logprobs import labelled_rows

    plan = plan_prefix_tree(_nasty(forest), min_prefix_len=1)
    pairs = labelled_rows(plan)
    rows, labels, start = [], [], 0
    for rank in range(sp):
        sp_plan = SequenceParallelPlan(plan, None, sp, rank)
        local = sp_plan.local_pairs(pairs)
        lo, hi = sp_plan.row_range
        assert local.start == start and local.num_pairs == pairs.num_pairs
        assert ((local.rows >= 0) & (local.rows < hi - lo)).all()
        rows.append(local.rows + lo)
        labels.append(local.labels)
        start += local.rows.numel()
    assert torch.equal(torch.cat(rows), pairs.rows) and torch.equal(torch.cat(labels), pairs.labels)
