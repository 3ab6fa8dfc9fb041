"""A Qwen2.5-VL-like vision-language model (random init, bf16): forward + backward with
per-token log-probs on VLM GRPO batches (one image per prompt, n responses per prompt), stock
vs prefix tree, the vision tower included.

    python benchmarks/vlm.py [--layers 9] [--vision-blocks 8] [--out FILE]   # CUDA
    python benchmarks/vlm.py --tiny                                          # CPU smoke run

Model: transformers' ``Qwen2_5_VLForConditionalGeneration`` built from a hand-written config
of Qwen2.5-VL-3B's shapes with fewer layers: text hidden 2048, 16/2 heads x 128, ffn 11008,
vocab 151936, tied embeddings, mrope sections 16/24/24; vision tower 1280 wide, 16 heads, ffn
3420, 14-pixel patches over 2 frames, 2x2 merge into 2048, 112-pixel windows and every 8th
block full attention (the 3B has 36 text layers and 32 vision blocks; the defaults keep a
quarter of each).

Workloads (lengths +-25 % around the stated means, random pixels):
  * ``vlm-geometry``: 4 prompts of ~128 text tokens around one 448x448 image (256 image
    tokens), n=8 responses of ~512 (geometry-reasoning GRPO);
  * ``vlm-gui``: 2 prompts of ~256 text tokens and one 1092x616 screenshot (858 image
    tokens), n=8 responses of ~192 (GUI-agent GRPO);
  * ``vlm-chart``: 8 prompts of ~64 text tokens and one 336x336 image (144 image tokens), n=8
    responses of ~256.

Baseline: what verl's FSDP engine runs with ``use_remove_padding`` (its default path): the
model on the unshared samples packed back to back into one row (``input_ids [1, N]``,
``position_ids [4, 1, N]``: text positions restarting per sample, then the temporal / height /
width mrope rows from the model's own ``get_rope_index``), with every sample's image (n
copies of each prompt's) in ``pixel_values``. Attention: FlashAttention-2 where flash-attn is
installed, else ``varlen_fa2`` (``verl_flash_fallback.py``: FlashAttention-2's contract on
torch's varlen flash kernel): the text decoder one causal segment per sample, the vision tower
one bidirectional segment per image (full blocks) or window (the others), in one varlen call.

Tree: as verl's FSDP engine runs a vision-language micro-batch with prefix sharing
(``ps_mcore.integrations.verl_common.vision``): planned on the sequences with each image's
placeholders keyed by the image's content (``ps_mcore.multimodal``), the real token ids put
back; the model gets the packed rows, each row's 4-row positions and the images of the packed
rows in row order, so the vision tower runs once per distinct image; the text decoder runs
``"prefix_tree"`` attention (``ps_mcore.fsdp_bridge``, auto backend). Same weights.

Ideal: unshared / tree FLOPs of the step, decoder (``ps_mcore.flops.DecoderShape`` on the
plan) plus vision tower (``ps_mcore.flops.VisionShape`` on the images each run encodes, the
windows from the model's own partition). Parity: max |log-prob difference| and the largest
relative gradient difference over the parameters (vision tower included), tree vs stock.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import verl_flash_fallback  # noqa: E402
from common import PairedSteps, add_run_arguments, environment, markdown_table, measure, parse_model_benchmark_args, write_report  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared  # noqa: E402
from ps_mcore.attention import resolve_backend  # noqa: E402
from ps_mcore.flops import DecoderShape, VisionShape, vlm_ideal_speedup  # noqa: E402
from ps_mcore.fsdp_bridge import TreeCall, disable_tree_attention, enable_tree_attention  # noqa: E402
from ps_mcore.fsdp_bridge.scope import tree_attention_scope  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402
from ps_mcore.multimodal import image_key, keyed_sequence, packed_image_order, row_values, with_tokens  # noqa: E402

IMAGE, VIDEO, VISION_START, VISION_END = 151655, 151656, 151652, 151653  # Qwen2.5-VL's ids
TEXT_3B = dict(
    hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=128000,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
)
VISION_3B = dict(
    hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=14,
    temporal_patch_size=2, spatial_merge_size=2, window_size=112, in_channels=3, hidden_act="silu",
)
TINY_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=600,
    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
)
TINY_VISION = dict(
    hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14, temporal_patch_size=2,
    spatial_merge_size=2, window_size=56, in_channels=3, hidden_act="silu",
)
TINY_IDS = dict(IMAGE=590, VIDEO=591, VISION_START=592, VISION_END=593)  # inside the tiny vocab
FULL_ATTENTION_EVERY = 8  # Qwen2.5-VL: blocks 7, 15, 23, 31 of 32 attend to the whole image


@dataclass(frozen=True)
class VLMWorkload:
    """GRPO groups: ``prompts`` prompts of ~``text`` tokens around one image of ``image``
    pixels (height, width), ``n`` responses of ~``response`` tokens each."""

    prompts: int
    text: int
    image: tuple[int, int]
    n: int
    response: int


WORKLOADS = {
    "vlm-geometry": VLMWorkload(4, 128, (448, 448), 8, 512),
    "vlm-gui": VLMWorkload(2, 256, (616, 1092), 8, 192),
    "vlm-chart": VLMWorkload(8, 64, (336, 336), 8, 256),
}
TINY_WORKLOADS = {  # the same groups, small: 2 windows x 2 windows of the tiny tower per image
    "vlm-geometry": VLMWorkload(2, 12, (112, 112), 8, 24),
    "vlm-gui": VLMWorkload(1, 16, (84, 140), 8, 12),
}


def build_model(tiny: bool, layers: int, blocks: int, device: str, dtype: torch.dtype):
    """The model with the baseline's attention (FlashAttention-2 where flash-attn is installed,
    else ``varlen_fa2`` for the decoder and the vision tower)."""
    import transformers
    from transformers.utils import is_flash_attn_2_available

    ids = TINY_IDS if tiny else dict(IMAGE=IMAGE, VIDEO=VIDEO, VISION_START=VISION_START, VISION_END=VISION_END)
    flash = is_flash_attn_2_available() and device == "cuda"
    if not flash:
        verl_flash_fallback.register_attention()
    full = [i for i in range(blocks) if (i + 1) % FULL_ATTENTION_EVERY == 0] or [blocks - 1]
    vision = dict(TINY_VISION if tiny else VISION_3B, depth=blocks, fullatt_block_indexes=full)
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(TINY_TEXT if tiny else TEXT_3B, num_hidden_layers=layers), vision_config=vision,
        image_token_id=ids["IMAGE"], video_token_id=ids["VIDEO"], vision_start_token_id=ids["VISION_START"],
        vision_end_token_id=ids["VISION_END"], tie_word_embeddings=True,
        attn_implementation="flash_attention_2" if flash else verl_flash_fallback.ATTN_NAME,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    if not flash:
        verl_flash_fallback.use_for_vision(model.model.visual.config)
    return model.to(dtype).train(), ids


def decoder_shape(model) -> DecoderShape:
    c = model.config.text_config
    return DecoderShape(
        layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
        ffn=c.intermediate_size, vocab=c.vocab_size,
    )


def vision_shape(model) -> VisionShape:
    v = model.config.vision_config
    return VisionShape(
        blocks=v.depth, hidden=v.hidden_size, ffn=v.intermediate_size,
        patch_dim=v.in_channels * v.temporal_patch_size * v.patch_size**2, merge=v.spatial_merge_size,
        out_hidden=v.out_hidden_size, full_blocks=len(v.fullatt_block_indexes),
    )


def image_work(model, grids: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    """``(patches, full-attention pairs, windowed pairs)`` of encoding these images: a frame of
    P patches attends over P^2 pairs in a full block; windowed blocks use the model's own
    window partition (``transformers.vision_utils.get_vision_window_index``)."""
    from transformers.vision_utils import get_vision_window_index

    if not grids:
        return 0, 0, 0
    v = model.config.vision_config
    grid = torch.tensor(grids)
    _, cu_windows = get_vision_window_index(grid, v.spatial_merge_size, v.window_size, v.patch_size)
    windows = cu_windows.diff().long()
    patches = int(grid.prod(-1).sum())
    full = sum(t * (h * w) ** 2 for t, h, w in grids)
    return patches, full, int((windows**2).sum())


@dataclass
class VLMBatch:
    """Samples in batch order: token ids, each sample's image ``(pixels [P, patch_dim], (t, h,
    w))`` and its 4-row positions ``[4, L]`` (text, then mrope)."""

    sequences: list[np.ndarray]
    images: list[tuple[torch.Tensor, tuple[int, int, int]]]
    positions: list[torch.Tensor]


def make_batch(model, ids: dict, w: VLMWorkload, seed: int, dtype) -> VLMBatch:
    v = model.config.vision_config
    vocab = min(model.config.text_config.vocab_size, ids["IMAGE"]) - 1  # text ids below the vision ids
    rng = np.random.default_rng(seed)
    length = lambda mean: max(1, int(round(mean * rng.uniform(0.75, 1.25))))  # noqa: E731
    unit = v.patch_size * v.spatial_merge_size  # pixels of one image token's side
    grid = (1, w.image[0] // unit * v.spatial_merge_size, w.image[1] // unit * v.spatial_merge_size)
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    batch = VLMBatch([], [], [])
    for _ in range(w.prompts):
        pixels = torch.from_numpy(rng.normal(size=(grid[1] * grid[2], patch_dim)).astype(np.float32)).to(dtype)
        placeholders = np.full(grid[1] * grid[2] // v.spatial_merge_size**2, ids["IMAGE"])
        prompt = np.concatenate([
            rng.integers(1, vocab, length(w.text // 2)), [ids["VISION_START"]], placeholders,
            [ids["VISION_END"]], rng.integers(1, vocab, length(w.text - w.text // 2)),
        ])
        for _ in range(w.n):
            seq = np.concatenate([prompt, rng.integers(1, vocab, length(w.response))]).astype(np.int64)
            tokens = torch.from_numpy(seq)[None]
            mrope, _ = model.model.get_rope_index(tokens, (tokens == ids["IMAGE"]).int(),
                                                  image_grid_thw=torch.tensor([grid]))
            batch.sequences.append(seq)
            batch.images.append((pixels, grid))
            batch.positions.append(torch.cat([torch.arange(len(seq))[None], mrope[:, 0]]))
    return batch


class Steps(PairedSteps):
    """The baseline and tree fwd+bwd steps of one VLM batch (weights: one per sample)."""

    def __init__(self, model, batch: VLMBatch, image_token: int, device):
        self.model, self.models = model, (model,)
        merge = model.config.vision_config.spatial_merge_size
        seqs = batch.sequences
        positions = torch.cat(batch.positions, dim=1)  # [4, N]
        # stock: every sample's tokens, positions and image
        self.flat_plan = plan_unshared(seqs).to(device)
        self.base_inputs = dict(
            input_ids=self.flat_plan.input_ids[None], position_ids=positions[:, None].to(device),
            pixel_values=torch.cat([p for p, _ in batch.images]).to(device),
            image_grid_thw=torch.tensor([g for _, g in batch.images], device=device),
        )
        # tree: planned on image-keyed sequences, one image per distinct image of the packed rows
        table: dict[bytes, int] = {}
        keys = [table.setdefault(image_key(p, g), len(table)) for p, g in batch.images]
        counts = [[g[0] * g[1] * g[2] // merge**2] for _, g in batch.images]
        keyed = [keyed_sequence(s, image_token, c, [k]) for s, c, k in zip(seqs, counts, keys)]
        plan = with_tokens(plan_prefix_tree(keyed), seqs)
        order = packed_image_order(plan, seqs, image_token, counts)
        self.plan = plan.to(device)
        self.tree_inputs = dict(
            input_ids=self.plan.input_ids[None], position_ids=row_values(plan, positions)[:, None].to(device),
            pixel_values=torch.cat([batch.images[s][0] for s, _ in order]).to(device),
            image_grid_thw=torch.tensor([batch.images[s][1] for s, _ in order], device=device),
            tree_call=TreeCall(self.plan),
        )
        self.images = ([g for _, g in batch.images], [batch.images[s][1] for s, _ in order])
        gen = torch.Generator().manual_seed(1)
        weights = torch.empty(len(seqs)).uniform_(-1, 1, generator=gen)
        self.token_weights = torch.repeat_interleave(weights, torch.tensor([len(s) for s in seqs])).to(device)

    def base_logprobs(self):
        disable_tree_attention(self.model)  # the stock model, as verl runs it
        logits = self.model(**self.base_inputs, attention_mask=None, use_cache=False).logits[0]
        return token_logprobs(logits, self.flat_plan)[0]

    def tree_logprobs(self):
        enable_tree_attention(self.model)
        with tree_attention_scope(self.model):
            logits = self.model(**self.tree_inputs, attention_mask=None, use_cache=False).logits[0]
        return token_logprobs(logits, self.plan)[0]

    def max_grad_rel_diff(self) -> float:
        """The largest ||g_tree - g_stock|| / ||g_stock|| over the parameters with a gradient."""
        self.base_step()
        base = {n: p.grad.detach().float().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.tree_step()
        worst = 0.0
        for name, p in self.model.named_parameters():
            if name in base:
                ref = base.pop(name)
                worst = max(worst, float((p.grad.float() - ref).norm() / ref.norm().clamp_min(1e-30)))
        if base:
            raise RuntimeError(f"the tree step left {sorted(base)[:3]} without a gradient")
        self.model.zero_grad(set_to_none=True)
        return worst


@dataclass(frozen=True)
class StepShape:
    """``measure``'s shape: the vision-language ideal of one batch."""

    decoder: DecoderShape
    vision: VisionShape
    stock_images: tuple[int, int, int]
    tree_images: tuple[int, int, int]
    window: None = None

    def ideal_speedup(self, stats: dict) -> float:
        return vlm_ideal_speedup(self.decoder, stats, self.vision, self.stock_images, self.tree_images)


HEADERS = ["workload", "N", "T", "N/T", "images stock", "images tree", "ideal", "base ms", "tree ms", "speedup",
           "meas/ideal", "base MiB", "tree MiB", "logp max diff", "grad max rel diff"]


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model, ids = build_model(args.tiny, args.layers, args.vision_blocks, device, dtype)
    decoder, vision = decoder_shape(model), vision_shape(model)
    workloads = TINY_WORKLOADS if args.tiny else WORKLOADS
    rows = []
    for i, name in enumerate(args.workloads or list(workloads)):
        print(f"[{i + 1}] {name}", flush=True)
        batch = make_batch(model, ids, workloads[name], args.seed + i, dtype)
        steps = Steps(model, batch, ids["IMAGE"], device)
        stock, tree = steps.images
        shape = StepShape(decoder, vision, image_work(model, stock), image_work(model, tree))
        m = measure(steps, shape, args.warmup, args.iters, queued=True)
        s = m.stats
        rows.append([name, s["N"], s["T"], s["N"] / s["T"], len(stock), len(tree), m.ideal, m.base_ms, m.tree_ms,
                     m.speedup, m.speedup / m.ideal, m.base_mib, m.tree_mib, steps.max_logprob_diff(),
                     steps.max_grad_rel_diff()])
        print("  " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
        del steps
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    disable_tree_attention(model)  # the title names the stock implementation
    t, v = model.config.text_config, model.config.vision_config
    backend = resolve_backend("auto", torch.empty(1, device=device, dtype=dtype))
    title = (
        f"HF {type(model).__name__} ({'tiny' if args.tiny else 'Qwen2.5-VL-3B'} shapes, random init, "
        f"{str(dtype).split('.')[-1]}: text hidden {t.hidden_size}, {t.num_attention_heads}/{t.num_key_value_heads} "
        f"heads, vocab {t.vocab_size}, {t.num_hidden_layers} layers; vision {v.hidden_size} wide, {v.depth} blocks "
        f"(full attention in {list(v.fullatt_block_indexes)}), window {v.window_size} px), fwd+bwd with token "
        f"log-probs; baseline = the unshared samples packed into one row with every sample's image (verl's "
        f"remove-padding layout; attention {t._attn_implementation} / vision {v._attn_implementation}); tree = "
        f"the prefix forest, vision tower once per distinct image (auto backend -> {backend}); ideal = FLOP "
        "ratio with the vision tower counted; MiB = peak allocated above the model"
    )
    return f"{title}\n\n{environment()}\n\n{markdown_table(HEADERS, rows)}\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="text decoder layers (default 9; --tiny 2)")
    p.add_argument("--vision-blocks", type=int, default=None, help="vision tower blocks (default 8; --tiny 2)")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS))
    add_run_arguments(p, "CPU, tiny dims, small batches")
    args = parse_model_benchmark_args(p, "benchmarks/vlm.py")
    if args.tiny:
        args.workloads = [w for w in args.workloads or TINY_WORKLOADS if w in TINY_WORKLOADS]
    args.layers = args.layers or (2 if args.tiny else 9)
    args.vision_blocks = args.vision_blocks or (2 if args.tiny else 8)
    write_report(run(args), args.out)


if __name__ == "__main__":
    main()
