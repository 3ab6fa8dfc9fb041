"""Vision-language micro-batches on the tree, verl's FSDP engine (0.8.0 and 0.9.1), real transformers
Qwen2-VL and Qwen2.5-VL classes (tiny random configs built here: 2 text layers, GQA 4/2 heads,
3-D mrope sections, a 1-block vision tower with 2x2 patch merging; fp32, CPU).

Batches as verl's trainer hands them: nested ``input_ids`` with image placeholders inside the
prompt, nested 4-row ``position_ids`` (text position, then the temporal / height / width mrope
rows from the model's own ``get_rope_index``) and ``multi_modal_inputs`` per sample
(``pixel_values``, ``image_grid_thw``). Stock: verl's engine on the unshared batch with the
Hugging Face model (sdpa; its packed-sequence mask from the text positions). Tree: the same
engine patched. Compared: log-probs, entropy, the PPO loss and every gradient (vision tower
included), on batches with images, without images, with different images under one prompt,
and mixed. verl 0.8.0's own Qwen2-VL patches (``verl.models.transformers.qwen2_vl``) cannot
import on transformers 5 (they need ``Qwen2VLCausalLMOutputWithPast`` and
``apply_multimodal_rotary_pos_emb``, which transformers 5 removed), so the stock run is the
Hugging Face model as verl's engine feeds it; that a replaced attention forward (what verl's
patch does on transformers 4) still leaves tree calls on Hugging Face's forward is checked with
a stand-in.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
transformers = pytest.importorskip("transformers")

from test_verl_fsdp import _ppo, _run, _setting, impl  # noqa: E402,F401
from verl_batches import RTOL, assert_grads, assert_outputs, make_batch, step_tokens  # noqa: E402
from verl_helpers import fsdp_patchset  # noqa: E402
from vlm_samples import IMAGE, MERGE, VIDEO, VISION_END, VISION_START  # noqa: E402
from vlm_samples import image_prompt as _prompt  # noqa: E402
from vlm_samples import random_image as _image  # noqa: E402

VOCAB = 160


def make_vlm(kind: str, seed: int = 0):
    """A tiny random Qwen2-VL (``kind`` "qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl")."""
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    common = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
                  vision_end_token_id=VISION_END, attn_implementation="sdpa", tie_word_embeddings=False)
    if kind == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2,
                      temporal_patch_size=1, spatial_merge_size=MERGE, in_channels=3)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        cls = transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2,
                      patch_size=2, temporal_patch_size=1, spatial_merge_size=MERGE, in_channels=3,
                      window_size=8, fullatt_block_indexes=[0])
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).float()
    with torch.no_grad():  # weights large enough that images and positions matter
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    model.train()
    return model


def vlm_batch(model, rng, layout: str):
    """(samples, images per sample) of one layout; then the verl batch with 4-row positions."""
    samples, images = [], []
    if layout == "images":  # 2 prompts with their own image, 3 responses each
        for p in range(2):
            image = _image(rng)
            prompt = _prompt(rng, image)
            for _ in range(3):
                samples.append((prompt, rng.integers(1, 140, int(rng.integers(3, 7))).tolist(), f"u{p}"))
                images.append([image])
    elif layout == "text-only":
        for p in range(2):
            prompt = _prompt(rng, None)
            for _ in range(3):
                samples.append((prompt, rng.integers(1, 140, int(rng.integers(3, 7))).tolist(), f"u{p}"))
                images.append([])
    elif layout == "different-images":  # one text prompt, two images, two samples each
        text_image = _image(rng)
        prompt = _prompt(rng, text_image)
        for i in range(2):
            image = _image(rng, grid=(1, 4, 4))
            for _ in range(2):
                samples.append((prompt, rng.integers(1, 140, int(rng.integers(3, 7))).tolist(), "u0"))
                images.append([image])
    else:  # mixed: an image prompt group and a text-only group
        image = _image(rng)
        for p, img in enumerate((image, None)):
            prompt = _prompt(rng, img)
            for _ in range(2):
                samples.append((prompt, rng.integers(1, 140, int(rng.integers(3, 7))).tolist(), f"u{p}"))
                images.append([] if img is None else [img])
    data = make_batch(samples, rng)
    positions = []
    for (prompt, response, _), imgs in zip(samples, images):
        ids = torch.tensor(prompt + response)[None]
        grid = torch.tensor([g for _, g in imgs]) if imgs else None
        mrope, _ = model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grid)
        positions.append(torch.cat([torch.arange(ids.size(1))[None], mrope[:, 0]]))
    data["position_ids"] = torch.nested.as_nested_tensor(positions, layout=torch.jagged)
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    inputs = [{"pixel_values": torch.cat([p for p, _ in imgs]), "image_grid_thw": torch.tensor([g for _, g in imgs])}
              if imgs else {} for imgs in images]
    data["multi_modal_inputs"] = NonTensorStack.from_list([NonTensorData(x) for x in inputs])
    return data


LAYOUTS = ["images", "text-only", "different-images", "mixed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_language_matches_stock(impl, kind, layout):  # noqa: F811
    model = make_vlm(kind)
    data = vlm_batch(model, np.random.default_rng(LAYOUTS.index(layout)), layout)
    tree, g_tree = _matches_stock(impl, model, data)
    n, t = step_tokens(tree)
    assert t < n  # the tree path ran: the shared prompt (and its image) computed once
    visual = [g for (name, _), g in zip(model.named_parameters(), g_tree) if ".visual." in f".{name}"]
    assert (layout == "text-only") == all(g is None for g in visual)  # no image: the tower never runs


def _matches_stock(impl, model, data):  # noqa: F811
    """A PPO training step, stock vs tree: loss, every gradient (a parameter without one in
    stock, e.g. the vision tower of a text-only batch, has none on the tree either), outputs."""
    setting = _setting("prompt_only")
    stock, g_stock = _run(impl, model, data, setting, False, _ppo())
    tree, g_tree = _run(impl, model, data, setting, True, _ppo())
    np.testing.assert_allclose(sum(tree["loss"]), sum(stock["loss"]), rtol=RTOL)
    assert [g is None for g in g_stock] == [g is None for g in g_tree]
    assert_grads([g for g in g_stock if g is not None], [g for g in g_tree if g is not None])
    assert_outputs(stock, tree)
    return tree, g_tree


def test_vision_tower_runs_once_per_image_of_the_packed_rows(impl, monkeypatch):  # noqa: F811
    """A GRPO group of 3 under one image prompt: the vision tower sees that image once (stock:
    3 times); different images under one prompt: each once."""
    model = make_vlm("qwen2_vl")
    calls = []
    stock_forward = type(model.model.visual).forward

    def counting(self, hidden_states, grid_thw, **kwargs):
        calls.append(int(grid_thw.shape[0]))
        return stock_forward(self, hidden_states, grid_thw, **kwargs)

    monkeypatch.setattr(type(model.model.visual), "forward", counting)
    for layout, tree_images, stock_images in (("images", 2, 6), ("different-images", 2, 4)):
        data = vlm_batch(model, np.random.default_rng(LAYOUTS.index(layout)), layout)
        calls.clear()
        _run(impl, model, data, _setting("prompt_only"), False)
        assert sum(calls) == stock_images
        calls.clear()
        _run(impl, model, data, _setting("prompt_only"), True)
        assert sum(calls) == tree_images, layout


def test_attention_forward_replaced_after_install_still_runs_the_tree(impl, monkeypatch):  # noqa: F811
    """verl's ``apply_monkey_patch`` replaces the Qwen2-VL attention class's forward with its
    flash-attention one (which cannot import on transformers 5: verl 0.8.0's
    ``verl.models.transformers.qwen2_vl`` needs names transformers 5 removed, so it is stood in
    for here by a forward that refuses every call). Tree calls then run Hugging Face's own
    forward, recorded when the patchset was installed, and match the unpatched stock run."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    from ps_mcore import setup

    model = make_vlm("qwen2_vl", seed=1)
    data = vlm_batch(model, np.random.default_rng(9), "images")
    setting = _setting("prompt_only")
    stock, g_stock = _run(impl, model, data, setting, False, _ppo())
    setup.install([fsdp_patchset()])  # records Hugging Face's forwards

    def flash_only_forward(self, *args, **kwargs):
        raise NotImplementedError("verl's flash-attention forward (not runnable here)")

    flash_only_forward.__module__ = "verl.models.transformers.qwen2_vl"
    monkeypatch.setattr(hf.Qwen2VLAttention, "forward", flash_only_forward)
    tree, g_tree = _run(impl, model, data, setting, True, _ppo())
    np.testing.assert_allclose(sum(tree["loss"]), sum(stock["loss"]), rtol=RTOL)
    assert_grads(g_stock, g_tree)
    assert_outputs(stock, tree)
    setup.uninstall()
    assert hf.Qwen2VLAttention.forward is flash_only_forward  # the routing wrapper is undone


def test_vision_refusals_name_the_cause(impl, monkeypatch):  # noqa: F811
    """Under Ulysses SP a Qwen2-VL image batch runs on the tree (``tests/test_verl_ulysses.py``
    checks it against verl's Ulysses run); videos and other vision-language families keep
    verl's stock forward, by name."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from test_verl_fsdp import make_engine

    from ps_mcore.integrations.verl_common.vision import vlm_refusal

    model = make_vlm("qwen2_vl")
    data = vlm_batch(model, np.random.default_rng(0), "images")
    engine = make_engine(impl, impl.FSDPEngineWithLMHead, model, _setting("prompt_only"))
    monkeypatch.setattr(engine, "use_ulysses_sp", True, raising=False)
    assert vlm_refusal(engine, data) is None
    inputs = [dict(x.data if hasattr(x, "data") else x) for x in data["multi_modal_inputs"]]
    inputs[0]["pixel_values_videos"] = inputs[0]["pixel_values"]
    videos = data.clone()
    videos["multi_modal_inputs"] = NonTensorStack.from_list([NonTensorData(x) for x in inputs])
    assert "(videos)" in vlm_refusal(engine, videos)
    monkeypatch.setattr(model.config, "model_type", "qwen3_vl")
    assert "vision-language inputs on qwen3_vl" in vlm_refusal(engine, data)
