"""Real Megatron-Bridge 0.6.2 Qwen2.5-VL (Hugging Face's vision tower in front of a megatron-core
GPTModel with multimodal RoPE, built by the provider with its TE spec) on a prefix tree, CPU
(gloo world 1, fp32, megatron-core 0.19).

The test writes a tiny Qwen2.5-VL checkpoint (2 text layers, GQA 4/2, mrope sections 2/3/3; a
2-block vision tower, windowed then full attention, 2x2 patch merging),
``AutoBridge.from_hf_pretrained`` makes the provider, which builds the stock model and, with
:func:`~ps_mcore.layer_specs.tree_provider_spec`, the tree model; Bridge loads the checkpoint
into both strictly. Stock: the model's own forward on the unshared batch as verl's Megatron
engine feeds it (THD, one segment per sample, every sample's image; the model computes the
mrope positions itself per segment). Tree: the forest planned on image-keyed sequences, the
vision tower on the images of the packed rows, the language model on the tree with each packed
row's mrope positions (:func:`~ps_mcore.layer_specs.vision_language_tree_forward`). Compared:
log-probs and every gradient of a per-sample-weighted loss (vision tower included), on batches
with images, without images, with different images under one prompt, mixed, and responses that
branch at several depths. The stock model is checked against the Hugging Face model per sample.
Through verl 0.9.1's Megatron engine (the model built by verl's own Bridge path): the log-prob
pass and a PPO update, patched vs stock, on the same layouts (log-probs, entropy, loss, every
gradient).
Megatron-Bridge 0.6.2 does not carry ``mrope_section`` over from the checkpoint (it keeps
Qwen2.5-VL's 16/24/24): the test sets the tiny model's on the provider.

Test-only shims: tests/te_cpu_shims.py (TE needs a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bridge_helpers import require_bridge

require_bridge()

from bridge_helpers import bridge_and_provider, build, cpu_bridge, load_strictly, write_hf_checkpoint  # noqa: E402,F401

from conftest import assert_grads_close, grads_of  # noqa: E402

from ps_mcore import plan_prefix_tree, token_logprobs  # noqa: E402
from ps_mcore.layer_specs import (  # noqa: E402
    TreeCoreAttention,
    TreePackedSeqParams,
    provider_spec_field,
    tree_provider_spec,
    vision_language_tree_forward,
    vision_language_tree_refusal,
)
from ps_mcore.multimodal import image_key, keyed_sequence, packed_image_order, row_values, with_tokens  # noqa: E402

from vlm_samples import IMAGE, MERGE, image_prompt, random_image  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("qwen2_5_vl"))


def build_models(path):
    """(HF model, stock model, tree model), both Megatron models loaded from one checkpoint."""
    hf, tensors = write_hf_checkpoint("qwen2_5_vl", path, seed=5)
    # Megatron-Bridge 0.6.2 keeps Qwen2.5-VL's mrope sections (16/24/24, for head dim 128) whatever
    # the checkpoint says: the tiny model's (head dim 16) are set on the provider
    bridge, provider = bridge_and_provider(path, mrope_section=hf.config.text_config.rope_parameters["mrope_section"])
    stock = build(provider)
    load_strictly(bridge, stock, tensors)
    setattr(provider, provider_spec_field(provider), tree_provider_spec(provider))
    tree = build(provider)
    load_strictly(bridge, tree, tensors)
    return hf, stock[0], tree[0]


def _image(rng, grid=(1, 8, 4)):
    return random_image(rng, grid)


def _prompt(rng, image):
    return image_prompt(rng, image, text_below=128, head=(2, 5), tail=(1, 4))


def _text(rng, low, high):
    return rng.integers(1, 128, int(rng.integers(low, high))).tolist()


def vlm_triples(rng, layout: str):
    """((prompt, response, uid) per sample, the image of each sample or None)."""
    samples, images = [], []

    def group(prompt_image, n, uid, responses=None, prompt=None):
        prompt = prompt or _prompt(rng, prompt_image)
        for i in range(n):
            samples.append((prompt, responses[i] if responses else _text(rng, 2, 6), uid))
            images.append(prompt_image)

    if layout == "images":  # 2 GRPO groups, each prompt with its own image
        group(_image(rng), 3, "u0")
        group(_image(rng, (1, 4, 6)), 3, "u1")
    elif layout == "text-only":
        group(None, 3, "u0")
        group(None, 2, "u1")
    elif layout == "different-images":  # one text prompt, two images, two samples each
        prompt = _prompt(rng, _image(rng))
        group(_image(rng), 2, "u0", prompt=prompt)
        group(_image(rng), 2, "u0", prompt=prompt)
    elif layout == "mixed":
        group(_image(rng), 2, "u0")
        group(None, 2, "u1")
    else:  # "branching": responses that share a first part, then branch again (3 depths)
        a, b = _text(rng, 2, 4), _text(rng, 1, 3)
        responses = [a + b + _text(rng, 1, 3), a + b + _text(rng, 1, 3), a + _text(rng, 1, 4), [a[0]], _text(rng, 1, 3)]
        group(_image(rng), 5, "u0", responses)
    return samples, images


def vlm_sequences(rng, layout: str):
    """(token sequences, the image of each sample or None)."""
    samples, images = vlm_triples(rng, layout)
    return [np.asarray(p + r, dtype=np.int64) for p, r, _ in samples], images


def _image_inputs(images):
    shown = [im for im in images if im is not None]
    if not shown:
        return {}
    return {"pixel_values": torch.cat([p for p, _ in shown]), "image_grid_thw": torch.tensor([g for _, g in shown])}


def _weights(seqs):
    gen = torch.Generator().manual_seed(len(seqs))
    return [torch.rand(len(s) - 1, generator=gen) + 0.5 for s in seqs]


def _loss(logp, seqs, weights):
    """sum over samples of weights x log p(token t+1), from ``[N]`` log-probs (row t)."""
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    return sum((logp[a: b - 1] * w).sum() for a, b, w in zip(offsets[:-1], offsets[1:], weights))


def stock_logprobs(model, seqs, images) -> torch.Tensor:
    """The model's own forward on the unshared THD batch: ``[N]`` log-probs (0 at each last token)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=int(lens.max()), max_seqlen_kv=int(lens.max()),
                          total_tokens=int(lens.sum()))
    ids = torch.from_numpy(np.concatenate(seqs))[None]
    logits = model(input_ids=ids, attention_mask=None, packed_seq_params=psp, **_image_inputs(images))[0]
    logp = torch.log_softmax(logits.float(), -1)
    nxt = torch.cat([torch.from_numpy(np.append(s[1:], 0)) for s in seqs])
    out = logp.gather(-1, nxt[:, None])[:, 0]
    return out * torch.cat([torch.arange(len(s)) < len(s) - 1 for s in seqs])


def mrope_positions(model, seqs, images) -> torch.Tensor:
    """``[3, N]``: each sample's temporal / height / width positions (the model's get_rope_index)."""
    out = []
    for seq, image in zip(seqs, images):
        ids = torch.from_numpy(seq)[None]
        grid = None if image is None else torch.tensor([image[1]])
        positions, _ = model.get_rope_index(ids, (ids == IMAGE).int(), grid)
        out.append(positions[:, 0])
    return torch.cat(out, dim=1)


def tree_logprobs(model, seqs, images):
    """(plan, ``[N]`` log-probs) of the tree path: image-keyed plan, images of the packed rows."""
    table: dict[bytes, int] = {}
    keys = [[] if im is None else [table.setdefault(image_key(*im), len(table))] for im in images]
    counts = [[] if im is None else [int(np.prod(im[1])) // MERGE**2] for im in images]
    keyed = [keyed_sequence(s, IMAGE, c, k) for s, c, k in zip(seqs, counts, keys)]
    plan = with_tokens(plan_prefix_tree(keyed, min_prefix_len=1), seqs)
    order = packed_image_order(plan, seqs, IMAGE, counts)
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=4)  # padding rows too
    rows = row_values(plan, mrope_positions(model, seqs, images))  # [3, T]
    positions = psp.pad_rows(rows.T).T[:, None]  # [3, 1, T_pad]
    logits = vision_language_tree_forward(
        model, psp.pad_rows(plan.input_ids)[None], positions, psp, **_image_inputs([images[s] for s, _ in order]))
    logp, _ = token_logprobs(logits[0][: plan.num_tokens], plan)
    return plan, order, logp


LAYOUTS = ["images", "text-only", "different-images", "mixed", "branching"]


def test_stock_model_equals_hugging_face(models):
    """The loaded checkpoint means the same model on both sides (an independent reference)."""
    hf, stock, _ = models
    seqs, images = vlm_sequences(np.random.default_rng(0), "mixed")
    with torch.no_grad():
        got = stock_logprobs(stock, seqs, images)
        offset = 0
        for seq, image in zip(seqs, images):
            ids = torch.from_numpy(seq)[None]
            inputs = _image_inputs([image] if image is not None else [])
            # the token types make Hugging Face compute the mrope positions itself
            logits = hf(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), use_cache=False, **inputs).logits[0]
            want = torch.log_softmax(logits[:-1], -1).gather(-1, torch.from_numpy(seq[1:])[:, None])[:, 0]
            torch.testing.assert_close(got[offset: offset + len(seq) - 1], want, rtol=1e-5, atol=2e-5)
            offset += len(seq)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tree_equals_stock(models, layout):
    _, stock, tree = models
    assert any(isinstance(m, TreeCoreAttention) for m in tree.modules())
    seqs, images = vlm_sequences(np.random.default_rng(LAYOUTS.index(layout) + 1), layout)
    weights = _weights(seqs)
    for m in (stock, tree):
        m.zero_grad(set_to_none=True)
    want = stock_logprobs(stock, seqs, images)
    plan, order, got = tree_logprobs(tree, seqs, images)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    assert plan.num_tokens < sum(len(s) for s in seqs)  # shared rows computed once
    distinct = {image_key(*im) for im in images if im is not None}
    assert len(order) == len(distinct)  # the vision tower saw each distinct image once
    _loss(want, seqs, weights).backward()
    _loss(got, seqs, weights).backward()
    g_stock, g_tree = grads_of(stock), grads_of(tree)
    assert_grads_close(g_tree, g_stock)  # every parameter with a gradient in stock has one on the tree
    visual = [name for name in g_stock if name.startswith("visual.")]
    assert visual == [] if layout == "text-only" else len(visual) == sum(1 for n, _ in tree.named_parameters()
                                                                         if n.startswith("visual."))


def test_refusals(models):
    _, _, tree = models
    plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4]], min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan)
    assert "is not a Megatron-Bridge Qwen2.5-VL-style model" in vision_language_tree_refusal(tree.language_model, psp)
    assert "TreePackedSeqParams" in vision_language_tree_refusal(tree, object())
    assert vision_language_tree_refusal(tree, psp) is None and vision_language_tree_refusal(tree) is None
    with pytest.raises(ValueError, match=r"position_ids must be \[3, 1, T_pad=4\]"):
        vision_language_tree_forward(tree, plan.input_ids[None], psp.position_ids[None], psp)
    # 1-D tree positions handed to the mrope language model: its table does not cover the rows
    with pytest.raises(ValueError, match="multimodal RoPE on a tree: the rotary table has"):
        tree.language_model(input_ids=plan.input_ids[None], position_ids=torch.zeros(3, 1, 2, dtype=torch.long),
                            attention_mask=None, packed_seq_params=psp)


# ----------------------------------------------------------------------------- verl's engine


@pytest.fixture(scope="module")
def engine_impl():
    pytest.importorskip("verl")
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl_batches import cpu_forward_backward_func

    from ps_mcore import setup

    stock = impl.get_forward_backward_func
    impl.get_forward_backward_func = cpu_forward_backward_func
    yield impl
    impl.get_forward_backward_func = stock
    setup.uninstall()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl_engine")
    hf, _ = write_hf_checkpoint("qwen2_5_vl", path, seed=7)
    return path, hf


def _engine(impl, path, hf, patched: bool, remove_padding: bool):
    from bridge_helpers import ENGINE_CPU_OVERRIDES, bridge_engine
    from verl_helpers import megatron_patchset

    from ps_mcore import setup
    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig, PrefixSharingSetting

    if patched:
        setup.install([megatron_patchset()])
    else:
        setup.uninstall()
    setting = PrefixSharingSetting(True, PrefixGrouperConfig(mode="prompt_only", min_prefix_len=4,
                                                             min_saved_fraction=0.0))
    overrides = dict(ENGINE_CPU_OVERRIDES, mrope_section=hf.config.text_config.rope_parameters["mrope_section"])
    return bridge_engine(impl.MegatronEngineWithLMHead, path, setting, use_remove_padding=remove_padding,
                         override_transformer_config=overrides)


def verl_vlm_batch(hf, samples, images, rng):
    """verl's worker batch: nested ids, 4-row positions (text, then mrope), multi_modal_inputs."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl_batches import make_batch

    data = make_batch(samples, rng)
    seqs = [np.asarray(p + r) for p, r, _ in samples]
    positions = mrope_positions(hf.model, seqs, images)
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    rows = [torch.cat([torch.arange(b - a)[None], positions[:, a:b]]) for a, b in zip(offsets[:-1], offsets[1:])]
    data["position_ids"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    inputs = [{} if im is None else {"pixel_values": im[0], "image_grid_thw": torch.tensor([im[1]])} for im in images]
    data["multi_modal_inputs"] = NonTensorStack.from_list([NonTensorData(x) for x in inputs])
    return data


def _engine_step(engine, data, loss_fn=None):
    model = engine.module[0]
    model.zero_grad(set_to_none=True)
    out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
    return out, grads_of(model)


def _ppo():
    from functools import partial

    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=McoreActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01))


@pytest.mark.parametrize("layout", ["images", "text-only", "different-images", "mixed"])
def test_verl_engine_tree_equals_stock(engine_impl, checkpoint, layout):
    """verl 0.9.1's Megatron engine, Bridge-built Qwen2.5-VL: the log-prob pass and a PPO
    update, patched vs stock: log-probs, entropy, the loss and every gradient (vision tower
    included). Stock runs verl's padded VLM layout (``use_remove_padding=False``): its THD
    layout hands Bridge 0.6.2's model padded ``[B, S]`` ids with THD params, which the model
    refuses for more than one sample (checked below); the tree path runs either way."""
    from verl_batches import RTOL, assert_outputs, step_tokens

    path, hf = checkpoint
    rng = np.random.default_rng(LAYOUTS.index(layout) + 20)
    samples, images = vlm_triples(rng, layout)
    data = verl_vlm_batch(hf, samples, images, rng)
    stock = _engine(engine_impl, path, hf, patched=False, remove_padding=False)
    stock_i, _ = _engine_step(stock, data)
    stock_t, g_stock = _engine_step(stock, data, _ppo())
    for remove_padding in (False, True):
        tree = _engine(engine_impl, path, hf, patched=True, remove_padding=remove_padding)
        tree_i, _ = _engine_step(tree, data)
        tree_t, g_tree = _engine_step(tree, data, _ppo())
        assert "forward" not in vars(tree.module[0])  # the model's own forward is back after each call
        n, t = step_tokens(tree_i)
        assert n == int(data["input_ids"].offsets()[-1]) and t < n  # the tree path ran
        assert_outputs(stock_i, tree_i)
        np.testing.assert_allclose(sum(tree_t["loss"]), sum(stock_t["loss"]), rtol=RTOL)
        assert_grads_close(g_tree, g_stock)
    assert any(name.startswith("visual.") for name in g_stock) == (layout != "text-only")
    if layout == "images":
        with pytest.raises(ValueError, match=r"expects a tensor with shape \[1, total_tokens\]"):
            _engine_step(_engine(engine_impl, path, hf, patched=False, remove_padding=True), data)
