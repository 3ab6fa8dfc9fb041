"""verl 0.8.0's actor, stock vs verl's own PrefixGrouper vs ps-mcore, through verl's real
worker API on one GPU (NCCL world of 1).

What runs is verl's ``ActorRolloutRefWorker`` (roles ``actor`` and ``ref``) with its real
engine (``megatron``: mbridge builds the TE-spec GPTModel as verl builds it by default;
``fsdp2``: a Hugging Face model under FSDP2), driven by the three calls the PPO trainer makes:
``compute_log_prob`` (old log-probs), ``compute_ref_log_prob`` and ``update_actor`` (one
optimizer step on the mini-batch). Batches are verl ``DataProto`` in the rollout's layout
(left-padded prompts, right-padded responses, attention / response masks, position ids,
GRPO advantages, ``uid`` per group), turned into worker batches by the trainer's own
``left_right_2_no_padding``. There is no rollout engine on the GPU machine (no vLLM/SGLang):
the rollout is simulated by seeded batch generators (token ids are random; only lengths and
sharing structure are modelled). Models are random-initialised from hand-written HF configs
written to a temp dir (no hub access).

Configurations, each in the same run on the same weights and batches:

* ``stock``: ``use_prefix_grouper: false``, dynamic batching with ``ppo_max_token_len_per_gpu``.
* ``pg`` (FSDP only): verl's own PrefixGrouper (``verl.trainer.ppo.prefix_grouper_utils``),
  which no 0.8.0 engine calls; driven as the legacy ``dp_actor`` did: ``use_remove_padding``
  off, fixed micro-batches of whole groups (``--pg-groups`` groups each; it cannot use dynamic
  batching), ``forward_micro_batch_with_prefix_grouper`` per micro-batch, attention wrapped by
  ``apply_prefix_grouper_patch``; its ``[B, R]`` log-probs are put into the engine's jagged
  layout so verl's ``ppo_loss`` runs unchanged.
* ``ps``: ``use_prefix_grouper: true`` with ``prefix_grouper.mode=arbitrary_prefix``, the
  patchsets installed by ``ps_mcore.setup.install()``; the token budget counts deduplicated
  tokens.
* ``ps-pieces`` (not run unless named in ``--configs``): ``ps`` with
  ``prefix_grouper.cross_microbatch: false``, so sharing units larger than the budget always
  run as pieces that repeat their shared prefix, never as a cross-micro-batch schedule: the
  two side by side show which the planner should have chosen.

Per engine one table: per (model, batch, config, phase) wall time (median of ``--iters``
after ``--warmup`` calls; each call is one mini-batch), the micro-batches the engine ran per call
(its ``forward_step`` calls: a deduplicated budget holds more samples, so ps-mcore's are fewer),
tokens/s (raw tokens N), peak memory,
speedup vs stock, the FLOP-weighted ideal speedup of the mini-batch (``ps_mcore.flops`` on the
plan of the whole mini-batch), measured/ideal, the same with the call's floor counted (the
``floor`` batch, one sample of about 80 tokens, times what a call costs whatever its tokens: the
optimizer step, verl's batch handling; that part cannot shrink, the rest shrinks by the
ideal), and on the old-log-prob rows max |log-prob -
stock| (bf16, every response token) next to each configuration's own max error against an
fp32 Hugging Face forward of the same weights (``--ref-samples`` sequences). MoE models run on
the Megatron engine only and load no HF weights (Megatron's seeded init, identical for both
configurations; no fp32 reference).

The CUDA allocator runs with expandable segments, as a training job's actor phases do (verl
turns them on at the end of every weight sync to the rollout). Harness settings that differ
from verl's defaults, the same for every configuration:
``attn_implementation=varlen_fa2`` (FSDP; the machine has no flash-attn, see
``verl_flash_fallback.py``), TE ``attention_backend=fused`` (Megatron, cuDNN's fused
attention; verl's ``flash`` needs flash-attn inside TE, and ``auto`` falls back to TE's
unfused O(S^2)-memory attention where TE finds neither, a baseline nobody trains with: with
``fused`` the stock configuration stops with TE's own message instead; ``--tiny`` keeps
``auto`` on the CPU), and ``USE_HUB_KERNELS=0``
(transformers >= 5.2x swaps layers for kernels fetched from the Hugging Face hub when the
``kernels`` package is installed; offline that fails at ``model.train()``, and online it would
change the model under both sides). FSDP2 checkpoints every layer (verl's default
``enable_gradient_checkpointing``); the Megatron engine keeps every layer's activations unless
``--recompute`` turns on Megatron's full recompute, as verl's long-context Megatron recipes do.

    python benchmarks/verl_actor.py --quick --engines fsdp          # GPU
    python benchmarks/verl_actor.py --quick --engines megatron
    python benchmarks/verl_actor.py --curves 30 --plot curves.png   # training curves
    python benchmarks/verl_actor.py --quick --engines megatron --batches pg-8k --profile update   # where it goes
    python benchmarks/verl_actor.py --quick --scale 4 --engines megatron --batches agent --profile-idle update   # what the GPU waits for
    python benchmarks/verl_actor.py --quick --scale 4 --batches gsm8k agent pg-4k   # several budgets per mini-batch
    python benchmarks/verl_actor.py --quick --scale 4 --engines megatron --fused-kernels --recompute   # full activation recompute
    python benchmarks/verl_actor.py --quick --configs stock ps --both-orders --batches no-sharing floor   # no order bias
    python benchmarks/verl_actor.py --tiny                          # CPU exactness check (CI)
    python benchmarks/verl_actor.py --tiny --engines megatron --models tiny-moe
    python benchmarks/verl_actor.py --tiny --curves 2 --plot curves.png

``--curves N``: N update steps from the same initial weights on fixed batches (each step:
old log-probs, then ``update_actor``), stock twice and ps-mcore once per engine; per step the
loss, grad norm, entropy and the mean log-prob of a held-out batch; reports the largest
per-step deviation of ps-mcore from stock next to stock's own run-to-run deviation.

``--tiny``: CPU, fp32, gloo world of 1, a few samples, both engines, the model ``tiny`` (Qwen2)
or ``tiny-moe`` (the Qwen3-30B-A3B builder at tiny sizes: 4 experts, top-2; Megatron engine,
Megatron's seeded init); exits 0 only when ps-mcore's (and PrefixGrouper's) log-probs,
entropy, ref log-probs, loss, grad norm and every gradient equal stock's. With ``--curves N``
the training-curve run above on that CPU setup (lr 1e-3), exiting 0 only when every step of
ps-mcore's curves is within fp32 tolerance of stock's and its updates computed fewer tokens.
Its CPU shims are test-only (``tests/verl_cpu_worker_shims.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import math
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass, field, replace

import numpy as np
import torch

os.environ.setdefault("USE_HUB_KERNELS", "0")  # module docstring: same model, no hub access

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gsm8k_like  # noqa: E402
from common import gpu_idle_by_function, profile_steps  # noqa: E402
import verl_flash_fallback  # noqa: E402

from ps_mcore.flops import DecoderShape  # noqa: E402
from ps_mcore.integrations.verl_common.trainer import TOKENS_IN, TOKENS_PACKED  # noqa: E402
from ps_mcore.planner import plan_prefix_tree  # noqa: E402
from ps_mcore.table import format_table  # noqa: E402

# ----------------------------------------------------------------------------- models

QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, rope_theta=1e6,
             max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", attention_dropout=0.0)


def qwen3_moe(**sizes) -> dict:
    """Qwen3-30B-A3B's HF config (128 experts, top-8, 768 per expert, 2048 hidden, 32/4 heads
    of 128, every layer MoE, no load-balancing loss as in RL), ``sizes`` replacing its sizes."""
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True, rope_theta=1e6,
                max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                attention_dropout=0.0, output_router_logits=False, router_aux_loss_coef=0.0) | sizes


TINY_SIZES = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12, max_position_embeddings=1024)
MODELS = {
    "qwen2.5-0.5b": dict(QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-3b": dict(QWEN2, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3-30b-a3b-4l": qwen3_moe(num_hidden_layers=4),  # Qwen3-30B-A3B's layer, 4 of its 48
    # 2 layers: 1.9B parameters (4 layers: 3.1B), whose update with its optimizer states fits an 80 GB card
    "qwen3-30b-a3b-2l": qwen3_moe(num_hidden_layers=2),
    # --tiny (CPU): the same builders at tiny sizes
    "tiny": dict(QWEN2, **TINY_SIZES, tie_word_embeddings=False),
    "tiny-moe": qwen3_moe(**TINY_SIZES, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
}
TINY_MODELS = ("tiny", "tiny-moe")
GPU_MODELS = tuple(m for m in MODELS if m not in TINY_MODELS + ("qwen3-30b-a3b-2l",))  # the default set


def is_moe(model: str) -> bool:
    return "num_experts" in MODELS[model]


def model_engines(model: str, engines: list[str]) -> list[str]:
    """``engines`` that run ``model``: MoE models on the Megatron engine only (no HF weights)."""
    return [e for e in engines if not (is_moe(model) and e == "fsdp")]


def decoder_shape(model: str) -> DecoderShape:
    c = MODELS[model]
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim", c["hidden_size"] // heads)
    ffn = c["num_experts_per_tok"] * c["moe_intermediate_size"] if is_moe(model) else c["intermediate_size"]
    return DecoderShape(layers=c["num_hidden_layers"], hidden=c["hidden_size"], heads=heads,
                        kv_heads=c["num_key_value_heads"], head_dim=head_dim, ffn=ffn, vocab=c["vocab_size"])


def write_model_dir(model: str, device: str, weights: bool) -> str:
    """An HF model directory (config, a word-level tokenizer, random weights when ``weights``)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tempfile.mkdtemp(prefix=f"verl_actor_{model}_")
    spec = dict(MODELS[model])
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    config.save_pretrained(path)
    if weights:
        torch.manual_seed(0)
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(config)
        hf.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(path)
        del hf
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1",
                                         unk_token="t0").save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """One mini-batch in the rollout's layout: samples are (prompt, response, uid)."""

    name: str
    samples: list[tuple[list[int], list[int], str]]
    group_size: int  # samples per uid group for PrefixGrouper's fixed micro-batches
    advantages: np.ndarray = field(default=None)

    @property
    def sequences(self) -> list[np.ndarray]:
        return [np.asarray(p + r, dtype=np.int64) for p, r, _ in self.samples]

    @property
    def num_tokens(self) -> int:
        return sum(len(p) + len(r) for p, r, _ in self.samples)


def _ids(rng, n, vocab):
    return rng.integers(2, vocab, n).tolist()  # 0 is padding, 1 eos: never inside a sample


def _lognormal(rng, median, cap, floor=8):
    return int(min(cap, max(floor, rng.lognormal(math.log(median), 0.6))))


def gsm8k_batch(rng, vocab, groups, scale=1.0):
    """GRPO on GSM8K: prompts ~60-250 tokens (a shared chat header), n responses (5..8, drawn
    once per batch: GRPO's n is fixed in a run) of
    lognormal length (median 300, capped at 1024), often opening alike within a group."""
    header, tail = _ids(rng, int(gsm8k_like.HEADER * scale) or 1, vocab), _ids(rng, int(gsm8k_like.TAIL * scale) or 1, vocab)
    samples, n = [], int(rng.integers(5, 9))
    for g in range(groups):
        question = _ids(rng, max(1, int(rng.integers(60, 251) * scale) - len(header) - len(tail)), vocab)
        openings = [[x % (vocab - 2) + 2 for x in o] for o in gsm8k_like.group_openings(rng, 0.5)]
        for _ in range(n):
            length = _lognormal(rng, 300 * scale, int(1024 * scale), floor=2)
            head = []
            if rng.random() < 0.6:
                head = openings[int(rng.choice(len(openings), p=gsm8k_like.OPENING_WEIGHTS))][:length]
            samples.append((header + question + tail, head + _ids(rng, length - len(head), vocab), f"q{g}"))
    return samples, n


def long_context_batch(rng, vocab, groups, context, scale=1.0):
    """PrefixGrouper's own shape: n=4 responses (lognormal, median 512, cap 1024) per prompt
    of ``context`` tokens."""
    samples = []
    for g in range(groups):
        prompt = _ids(rng, int(context * scale), vocab)
        for _ in range(4):
            samples.append((prompt, _ids(rng, _lognormal(rng, 512 * scale, int(1024 * scale), 2), vocab), f"p{g}"))
    return samples, 4


def agent_batch(rng, vocab, trajectories, steps=8, scale=1.0):
    """A multi-turn agent, one sample per step: sample k = the context before action k
    (system prompt 1024, then per earlier step an observation ~128 and an action ~256) and
    action k as the response. Every sample is its own uid (a different prompt each step:
    PrefixGrouper cannot share across turns; ps-mcore shares each step's context with the
    next)."""
    samples = []
    for t in range(trajectories):
        context = _ids(rng, int(1024 * scale), vocab)
        for s in range(steps):
            context = context + _ids(rng, _lognormal(rng, 128 * scale, int(512 * scale), 2), vocab)
            action = _ids(rng, _lognormal(rng, 256 * scale, int(1024 * scale), 2), vocab)
            samples.append((list(context), action, f"a{t}s{s}"))
            context = context + action
    return samples, 1


def no_sharing_batch(rng, vocab, count, scale=1.0):
    """Unrelated prompts (~256) with one response each (~768): nothing to share."""
    return [(_ids(rng, int(rng.integers(192, 321) * scale), vocab),
             _ids(rng, _lognormal(rng, 768 * scale, int(1024 * scale), 2), vocab), f"n{i}")
            for i in range(count)], 1


BATCHES = ("gsm8k", "pg-4k", "pg-8k", "agent", "no-sharing", "floor")


def make_batch(name: str, vocab: int, size: int, seed: int, scale: float = 1.0) -> Batch:
    """``size``: groups (gsm8k, pg-*), trajectories (agent) or samples (no-sharing)."""
    rng = np.random.default_rng(seed)
    if name == "gsm8k":
        samples, g = gsm8k_batch(rng, vocab, size, scale)
    elif name in ("pg-4k", "pg-8k"):
        samples, g = long_context_batch(rng, vocab, size, 4096 if name == "pg-4k" else 8192, scale)
    elif name == "agent":
        samples, g = agent_batch(rng, vocab, size, scale=scale)
    elif name == "no-sharing":
        samples, g = no_sharing_batch(rng, vocab, size, scale)
    elif name == "floor":  # one sample of about 80 tokens: what a call costs whatever its tokens
        samples, g = no_sharing_batch(rng, vocab, 1, scale / 16)
    else:
        raise ValueError(f"unknown batch {name!r}; expected one of {BATCHES}")
    # GRPO advantages: a group-normalised scalar score per sample
    scores = rng.normal(size=len(samples))
    uids = [u for _, _, u in samples]
    adv = np.zeros(len(samples))
    for u in set(uids):
        idx = [i for i, x in enumerate(uids) if x == u]
        s = scores[idx]
        adv[idx] = (s - s.mean()) / (s.std() + 1e-6) if len(idx) > 1 else s
    return Batch(name, samples, g, adv)


def data_proto(batch: Batch, old_log_probs=None, ref_log_probs=None, temperature: float = 1.0):
    """The batch as the rollout + trainer hand it over (``DataProto``, padded layout)."""
    from verl import DataProto

    b = len(batch.samples)
    p_max = max(len(p) for p, _, _ in batch.samples)
    r_max = max(len(r) for _, r, _ in batch.samples)
    prompts = torch.zeros(b, p_max, dtype=torch.long)
    responses = torch.zeros(b, r_max, dtype=torch.long)
    attention = torch.zeros(b, p_max + r_max, dtype=torch.long)
    response_mask = torch.zeros(b, r_max, dtype=torch.long)
    for i, (p, r, _) in enumerate(batch.samples):
        prompts[i, p_max - len(p):] = torch.tensor(p)
        responses[i, : len(r)] = torch.tensor(r)
        attention[i, p_max - len(p): p_max + len(r)] = 1
        response_mask[i, : len(r)] = 1
    adv = torch.as_tensor(batch.advantages, dtype=torch.float32)[:, None] * response_mask
    zeros = torch.zeros(b, r_max)
    tensors = dict(
        prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
        attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        response_mask=response_mask, advantages=adv, returns=adv,
        old_log_probs=zeros if old_log_probs is None else old_log_probs,
        ref_log_prob=zeros if ref_log_probs is None else ref_log_probs,
    )
    uid = np.array([u for _, _, u in batch.samples], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}, meta_info={"temperature": temperature})


def ideal_speedup(batch: Batch, shape: DecoderShape, min_prefix_len: int = 8) -> tuple[int, int, float]:
    """(N, T, FLOP-weighted ideal) of ps-mcore's plan of the whole mini-batch."""
    stats = plan_prefix_tree(batch.sequences, mode="arbitrary_prefix", min_prefix_len=min_prefix_len).stats()
    return stats["N"], stats["T"], shape.ideal_speedup(stats)


# ----------------------------------------------------------------------------- verl config


CONFIGS = {"fsdp": ("stock", "pg", "ps", "ps-pieces"), "megatron": ("stock", "ps", "ps-pieces")}
# ps-mcore's configurations: the ``prefix_grouper`` options each sets
PS_CONFIGS = {"ps": {}, "ps-pieces": {"cross_microbatch": False}}


# ``--recompute`` on the Megatron engine: every layer's input kept, the layer rerun in backward
# (megatron.training's --recompute-granularity full --recompute-method uniform
# --recompute-num-layers 1), as verl's long-context Megatron recipes set it
MEGATRON_FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


@dataclass
class RunSettings:
    device: str
    max_token_len: int
    lr: float = 1e-6
    pg_groups: int = 1
    tiny: bool = False
    fused_kernels: bool = False
    recompute: bool = False


def compose_config(engine: str, model_dir: str, config: str, settings: RunSettings):
    """verl's trainer config (``ppo_trainer`` / ``ppo_megatron_trainer``) for one
    configuration; returns its ``actor_rollout_ref`` section as the workers receive it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    import verl.trainer.config

    name = "ppo_megatron_trainer" if engine == "megatron" else "ppo_trainer"
    with initialize_config_dir(config_dir=os.path.dirname(verl.trainer.config.__file__), version_base=None):
        cfg = compose(name, overrides=["trainer.n_gpus_per_node=1", f"actor_rollout_ref.model.path={model_dir}"])
    OmegaConf.resolve(cfg)
    arr = cfg.actor_rollout_ref
    budget = settings.max_token_len
    with open_dict(arr):
        arr.rollout.n = 1
        arr.actor.ppo_mini_batch_size = 1
        arr.actor.use_dynamic_bsz = arr.rollout.log_prob_use_dynamic_bsz = config != "pg"
        arr.ref.log_prob_use_dynamic_bsz = config != "pg"
        arr.actor.ppo_max_token_len_per_gpu = arr.rollout.log_prob_max_token_len_per_gpu = budget
        arr.ref.log_prob_max_token_len_per_gpu = budget
        for section in (arr.actor, arr.rollout):  # PrefixGrouper: whole groups per micro-batch, set per call
            key = "ppo_micro_batch_size_per_gpu" if section is arr.actor else "log_prob_micro_batch_size_per_gpu"
            section[key] = 1
        arr.ref.log_prob_micro_batch_size_per_gpu = 1
        arr.actor.optim.lr = settings.lr
        arr.actor.optim.total_training_steps = 10_000
        arr.actor.use_prefix_grouper = config != "stock"
        arr.model.use_fused_kernels = settings.fused_kernels
        if config in PS_CONFIGS:
            arr.actor.prefix_grouper = {"mode": "arbitrary_prefix", "min_prefix_len": 8, **PS_CONFIGS[config]}
        if engine == "fsdp":
            arr.actor.strategy = arr.ref.strategy = "fsdp2"
            arr.model.override_config = {"attn_implementation": verl_flash_fallback.ATTN_NAME}
            arr.model.use_remove_padding = config != "pg"
            if settings.tiny:
                for section in (arr.actor.fsdp_config, arr.ref.fsdp_config):
                    section.mixed_precision = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
                    section.model_dtype = "fp32"
                    section.use_torch_compile = False
                arr.model.enable_gradient_checkpointing = settings.recompute
        else:
            for section in (arr.actor.megatron, arr.ref.megatron):
                # module docstring: never a stock baseline on TE's unfused attention
                section.override_transformer_config.attention_backend = "auto" if settings.tiny else "fused"
                if settings.recompute:
                    section.override_transformer_config.update(MEGATRON_FULL_RECOMPUTE)
            if settings.tiny:
                from verl_cpu_worker_shims import MEGATRON_CPU_TRANSFORMER_CONFIG, TINY_MEGATRON_OVERRIDES

                for section in (arr.actor, arr.ref):
                    for dotted, value in TINY_MEGATRON_OVERRIDES.items():
                        OmegaConf.update(section, dotted, value, force_add=True)
                    section.megatron.override_transformer_config.update(MEGATRON_CPU_TRANSFORMER_CONFIG)
    return arr


# ----------------------------------------------------------------------------- workers


@contextlib.contextmanager
def patchsets(config: str):
    """ps-mcore's patchsets installed for its configurations (uninstalled otherwise and afterwards)."""
    from ps_mcore import setup
    from ps_mcore.integrations.verl_common.config import reset_actor_setting

    setup.uninstall()
    reset_actor_setting()
    if config in PS_CONFIGS:
        setup.install()
    try:
        yield
    finally:
        setup.uninstall()
        reset_actor_setting()


def pg_forward_step(engine, micro_batch, loss_function, forward_only):
    """The FSDP engine's ``forward_step`` as the legacy ``dp_actor`` ran PrefixGrouper: verl's
    ``forward_micro_batch_with_prefix_grouper`` on the micro-batch's padded prompts /
    responses, its ``[B, R]`` outputs put into the engine's jagged layout (row t: token t+1)."""
    from verl.trainer.ppo.prefix_grouper_utils import forward_micro_batch_with_prefix_grouper
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name

    micro_batch = micro_batch.to(get_device_id())
    temperature = micro_batch["temperature"]
    if isinstance(temperature, torch.Tensor):
        temperature = float(temperature.reshape(-1)[0])
    entropy_flag = tu.get_non_tensor_data(micro_batch, key="calculate_entropy", default=False)
    autocast = getattr(engine, "_autocast_dtype", torch.bfloat16)
    mb = {"prompts": micro_batch["prompts"], "responses": micro_batch["responses"],
          "response_mask": micro_batch["response_mask"], "uid": list(micro_batch["uid"]), "pad_token_id": 0}
    entropy, log_probs = forward_micro_batch_with_prefix_grouper(
        mb, engine.module, temperature, entropy_flag, get_device_name(), autocast)
    ids = micro_batch["input_ids"]
    offsets = ids.offsets()
    resp = micro_batch["response_mask"].bool()
    resp_lens = resp.sum(1)
    # response token j of sample i is predicted by row offsets[i+1] - resp_len + j - 1
    starts = offsets[1:] - resp_lens - 1
    rows = (starts[:, None] + torch.arange(resp.size(1), device=resp.device)[None])[resp]

    def jagged(values):
        full = values.new_zeros(int(offsets[-1])).index_put((rows,), values[resp].to(values.dtype))
        return torch.nested.nested_tensor_from_jagged(full, offsets=offsets)

    model_output = {"log_probs": jagged(log_probs.float())}
    if entropy is not None:
        model_output["entropy"] = jagged(entropy.float())
    if loss_function is not None:
        loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                      dp_group=engine.get_data_parallel_group())
    else:
        loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
    # the tokens PrefixGrouper computes: each run of same-uid samples' prompt once + responses
    uids = list(micro_batch["uid"])
    prompt_lens = micro_batch["prompts"].ne(0).sum(1).tolist()
    firsts = [i for i in range(len(uids)) if i == 0 or uids[i] != uids[i - 1]]
    metrics = dict(metrics)
    metrics[TOKENS_IN] = int(offsets[-1])
    metrics[TOKENS_PACKED] = sum(prompt_lens[i] for i in firsts) + int(resp_lens.sum())
    return loss, {"model_output": model_output, "loss": loss.detach().item(), "metrics": metrics}


@contextlib.contextmanager
def prefix_grouper_driving(config: str):
    """For ``pg``: the FSDP engine's ``forward_step`` is :func:`pg_forward_step` and the
    attention is wrapped by verl's PrefixGrouper patch (restored afterwards)."""
    if config != "pg":
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from verl.models.transformers import monkey_patch
    from verl.workers.engine.fsdp import transformer_impl as impl

    saved = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    saved_flag = monkey_patch._PREFIX_GROUPER_PATCHED
    stock_step = vars(impl.FSDPEngineWithLMHead)["forward_step"]
    verl_flash_fallback.wrap_for_prefix_grouper()
    impl.FSDPEngineWithLMHead.forward_step = pg_forward_step
    try:
        yield
    finally:
        impl.FSDPEngineWithLMHead.forward_step = stock_step
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(saved)
        monkey_patch._PREFIX_GROUPER_PATCHED = saved_flag



class Workers:
    """The actor (and ref) ``ActorRolloutRefWorker`` of one configuration, and the calls the
    PPO trainer makes (``ray_trainer._compute_old_log_prob`` / ``_compute_ref_log_prob`` /
    ``_update_actor``, minus Ray)."""

    def __init__(self, engine: str, model_dir: str, config: str, settings: RunSettings, ref: bool):
        from verl.workers.engine_workers import ActorRolloutRefWorker

        self.engine, self.config, self.settings = engine, config, settings
        self.cfg = compose_config(engine, model_dir, config, settings)
        self.actor = ActorRolloutRefWorker(self.cfg, role="actor")
        self.actor.init_model()
        self.ref = None
        if ref:
            self.ref = ActorRolloutRefWorker(compose_config(engine, model_dir, config, settings), role="ref")
            self.ref.init_model()
        self.grads: list[torch.Tensor] | None = None

    def _worker_batch(self, batch: Batch, proto, **meta):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        td = left_right_2_no_padding(proto.to_tensordict())
        if self.config == "pg":  # the legacy actor's fixed micro-batches of whole groups
            meta.update(use_dynamic_bsz=False, micro_batch_size_per_gpu=batch.group_size * self.settings.pg_groups)
        tu.assign_non_tensor(td, **meta)
        return td

    def old_log_prob(self, batch: Batch):
        """``[B, R]`` old log-probs and entropy (the trainer's no_padding_2_padding)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = self._worker_batch(batch, data_proto(batch), calculate_entropy=True,
                                calculate_sum_pi_squared=False, compute_loss=False, temperature=1.0)
        out = self.actor.compute_log_prob(td)
        return (no_padding_2_padding(tu.get(out, "log_probs"), td).float(),
                no_padding_2_padding(tu.get(out, "entropy"), td).float())

    def ref_log_prob(self, batch: Batch):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = self._worker_batch(batch, data_proto(batch), calculate_entropy=False, compute_loss=False,
                                temperature=1.0)
        out = self.ref.compute_ref_log_prob(td)
        return no_padding_2_padding(tu.get(out, "log_probs"), td).float()

    def update(self, batch: Batch, old_log_probs) -> dict:
        """One ``update_actor`` (the whole batch is one mini-batch: one optimizer step)."""
        from verl.utils import tensordict_utils as tu

        arr = self.cfg
        proto = data_proto(batch, old_log_probs=old_log_probs)
        proto.meta_info["multi_turn"] = False
        calculate_entropy = bool(arr.actor.calculate_entropy or arr.actor.entropy_coeff != 0.0)  # the trainer's rule
        td = self._worker_batch(
            batch, proto, calculate_entropy=calculate_entropy, distillation_use_topk=False,
            global_batch_size=len(batch.samples), mini_batch_size=len(batch.samples), epochs=1, seed=1,
            dataloader_kwargs={"shuffle": False}, compute_loss=True)
        out = self.actor.update_actor(td)
        return tu.get(out, "metrics")

    def engine_for(self, phase: str):
        """The engine a phase runs on: the ref worker's for ``ref``, the actor's otherwise."""
        return (self.ref.ref if phase == "ref" else self.actor.actor).engine

    def capture_grads(self) -> None:
        """Keep every gradient of the next optimizer step in ``self.grads`` (before the step)."""
        engine = self.actor.actor.engine
        step = engine.optimizer_step

        def optimizer_step():
            self.grads = [g.detach().float().clone() for g in _gradients(self.engine, engine)]
            return step()

        engine.optimizer_step = optimizer_step

    def close(self) -> None:
        for worker in (self.actor, self.ref):
            for role in (getattr(worker, "actor", None), getattr(worker, "ref", None)):
                _drop_grad_hooks(getattr(role, "engine", None))
        del self.actor, self.ref
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextlib.contextmanager
def counted_calls(obj, name: str):
    """Count the calls of method ``name`` of ``obj`` while the block runs (an instance attribute
    wraps it, removed afterwards); yields the list that gets one entry per call."""
    calls, method, own = [], getattr(obj, name), name in vars(obj)

    def counting(*args, **kwargs):
        calls.append(None)
        return method(*args, **kwargs)

    setattr(obj, name, counting)
    try:
        yield calls
    finally:
        if own:
            setattr(obj, name, method)
        else:
            delattr(obj, name)


def _drop_grad_hooks(engine) -> None:
    """Let a Megatron engine's model be freed. megatron-core's DDP hooks each parameter's
    gradient accumulator with a closure holding the DDP module, and the module reaches those
    accumulators again through autograd's C++ nodes (``grad_accs``; an MoE token dispatcher
    keeps its last routing probabilities with their graph): a cycle Python's collector cannot
    see. A worker process builds one engine and never frees it; this benchmark builds one per
    configuration, and the leaked models of earlier ones would crowd the GPU of later ones.
    Emptying the closures' cells cuts the cycle (the hooks never run again)."""
    modules = getattr(engine, "module", None)
    for module in modules if isinstance(modules, list) else []:  # Megatron's model chunks
        for holder in gc.get_referrers(module):
            if isinstance(holder, types.CellType):
                holder.cell_contents = None


def _gradients(engine_name: str, engine) -> list[torch.Tensor]:
    if engine_name == "megatron":
        return [p.main_grad for m in engine.module for p in m.parameters()]
    out = []
    for p in engine.module.parameters():
        g = p.grad
        out.append(g.full_tensor() if hasattr(g, "full_tensor") else g)
    return out


# ----------------------------------------------------------------------------- environment


def init_world(device: str) -> None:
    """A world of one (gloo on the CPU; NCCL + gloo on the GPU) and the environment verl's
    ``Worker`` reads."""
    import torch.distributed as dist

    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    if device == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            dist.init_process_group(backend, rank=0, world_size=1)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    verl_flash_fallback.install()


def run_settings(args, lr: float | None = None) -> RunSettings:
    """The workers' settings: ``--tiny`` on the CPU with a 256-token budget (several
    micro-batches per tiny batch)."""
    lr = args.lr if lr is None else lr
    common = dict(lr=lr, pg_groups=args.pg_groups, fused_kernels=args.fused_kernels, recompute=args.recompute)
    if args.tiny:
        return RunSettings(device="cpu", max_token_len=256, tiny=True, **common)
    return RunSettings(device="cuda", max_token_len=args.max_token_len, **common)


def start(tiny: bool) -> str:
    """The run's device (``cuda``; ``cpu`` with ``--tiny``, which installs the test-only CPU
    shims of tests/verl_cpu_worker_shims.py) and its world of one."""
    if not tiny:
        init_world("cuda")
        # verl's ActorRolloutRefWorker.update_weights ends every weight sync (before the first
        # step and after each update) with set_expandable_segments(True), so a training job's
        # actor phases run on an allocator with expandable segments. No rollout runs here: set
        # the same, or a call near the card's memory fails on fragmentation instead.
        from verl.utils.device import set_expandable_segments

        set_expandable_segments(True)
        return "cuda"
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from verl_cpu_worker_shims import install_cpu_worker_shims

    torch.manual_seed(0)
    init_world("cpu")
    install_cpu_worker_shims()
    return "cpu"


@contextlib.contextmanager
def megatron_seeded_init(active: bool):
    """MoE models load no HF checkpoint: Megatron's seeded init (identical for every
    configuration) stands in."""
    from mbridge.core.bridge import Bridge

    stock = Bridge.load_weights
    if active:
        Bridge.load_weights = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        Bridge.load_weights = stock


# ----------------------------------------------------------------------------- measuring


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _alloc_retries(device) -> int:
    """The CUDA caching allocator's retries so far: each time a request found no free memory,
    it released its cached blocks (waiting for the GPU) and tried again."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device == "cuda" else 0


@dataclass
class Timing:
    seconds: float  # median of the timed calls
    peak: float  # GiB above what was allocated before the timed calls
    retries: int  # allocator retries during the timed calls
    result: object  # the last call's


def timed(fn, warmup: int, iters: int, device: str) -> Timing:
    """``fn`` run ``warmup`` times untimed, then ``iters`` timed calls."""
    result = None
    for _ in range(warmup):
        result = fn()
    _sync(device)
    if device == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    retries = _alloc_retries(device)
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else float("nan")
    return Timing(float(np.median(times)), peak, _alloc_retries(device) - retries, result)


def response_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b).abs()[mask.bool()].max()) if mask.any() else 0.0


def fp32_reference(model_dir: str, batch: Batch, samples: int, device: str) -> torch.Tensor:
    """``[S, R]`` fp32 log-probs of the first ``samples`` responses (HF, per sequence, sdpa,
    TF32 off), the reference every configuration's bf16 error is measured against."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa").to(device).eval()
    r_max = max(len(r) for _, r, _ in batch.samples)
    out = torch.zeros(min(samples, len(batch.samples)), r_max)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        for i, (p, r, _) in enumerate(batch.samples[: out.size(0)]):
            ids = torch.tensor([p + r], device=device)
            logits = model(input_ids=ids).logits[0, len(p) - 1: -1].float()
            out[i, : len(r)] = torch.log_softmax(logits, -1).gather(1, ids[0, len(p):, None])[:, 0].cpu()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    del model
    gc.collect()
    return out


def response_mask(batch: Batch) -> torch.Tensor:
    r_max = max(len(r) for _, r, _ in batch.samples)
    mask = torch.zeros(len(batch.samples), r_max, dtype=torch.bool)
    for i, (_, r, _) in enumerate(batch.samples):
        mask[i, : len(r)] = True
    return mask


# ----------------------------------------------------------------------------- the benchmark


PHASES = ("old", "ref", "update")
PHASE_NAMES = {"old": "compute_log_prob", "ref": "compute_ref_log_prob", "update": "update_actor"}
HEADERS = ["model", "batch", "config", "phase", "N", "T", "micro-batches", "s", "tok/s", "peak GiB", "speedup",
           "ideal", "meas/ideal", "floor s", "meas/ideal, floor counted", "max|dlogp| vs stock", "max|dlogp| vs fp32"]


@dataclass
class Cell:
    model: str
    batch: str
    config: str
    phase: str
    n: int
    t: int
    seconds: float
    peak: float
    ideal: float
    vs_stock: float = float("nan")
    vs_fp32: float = float("nan")
    micro_batches: float = float("nan")  # forward_step calls per timed call
    alloc_retries: int = 0  # the CUDA allocator's retries in the timed calls (every run of the cell)


def run_engine_model(engine: str, model: str, model_dir: str, batches: list[Batch], args, settings,
                     refs: dict, profiles: list[str]) -> list[Cell]:
    """Every configuration of ``engine`` on ``model``, in ``--configs``' order (so a timing
    that depends on what ran before in the process shows up by running them the other way
    round; ``--both-orders`` runs them in that order and then reversed, each cell the mean of
    its two runs): the phases of every batch."""
    shape = decoder_shape(model)
    plans = {b.name: ideal_speedup(b, shape) for b in batches}
    cells, old_lp = [], {}
    order = [c for c in args.configs if c in CONFIGS[engine]]
    for config in order + order[::-1] if args.both_orders else order:
        try:  # cells fills as it goes: a configuration that fails keeps what it measured
            run_config(engine, model, model_dir, config, batches, plans, args, settings, refs, old_lp, cells,
                       profiles)
        except Exception:  # one failing configuration must not lose the others' figures
            print(f"[{engine}/{model}/{config}] FAILED:\n{traceback.format_exc()}", flush=True)
        free_memory()
    cells = mean_of_runs(cells)
    masks = {b.name: response_mask(b) for b in batches}
    for cell in cells:  # once every configuration ran: stock need not run first
        stock, mine = old_lp.get(("stock", cell.batch)), old_lp.get((cell.config, cell.batch))
        if cell.phase == "old" and cell.config != "stock" and stock is not None and mine is not None:
            cell.vs_stock = response_diff(mine, stock, masks[cell.batch])
    return cells


def mean_of_runs(cells: list[Cell]) -> list[Cell]:
    """One cell per (model, batch, configuration, phase): the mean time of the runs that did not
    run out of memory (NaN if all did), the largest peak and error; first-run order."""
    runs: dict[tuple, list[Cell]] = {}
    for c in cells:
        runs.setdefault((c.model, c.batch, c.config, c.phase), []).append(c)
    merged = []
    for same in runs.values():
        times = [c.seconds for c in same if not math.isnan(c.seconds)]
        merged.append(replace(same[0], seconds=float(np.mean(times)) if times else math.nan,
                              peak=_largest(c.peak for c in same), vs_fp32=_largest(c.vs_fp32 for c in same),
                              alloc_retries=sum(c.alloc_retries for c in same)))
    return merged


def _largest(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return max(values) if values else math.nan


def free_memory() -> None:
    """What a finished or failed call left behind, given back to the GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_config(engine, model, model_dir, config, batches, plans, args, settings, refs, old_lp,
               cells: list[Cell], profiles: list[str]) -> None:
    """One configuration's workers through every phase of every batch, appending to ``cells``
    (and, for the phases in ``--profile``, where one call's time goes to ``profiles``)."""
    print(f"[{engine}/{model}/{config}] building workers", flush=True)
    t0 = time.perf_counter()
    with patchsets(config), prefix_grouper_driving(config):
        workers = Workers(engine, model_dir, config, settings, ref="ref" in args.phases)
        print(f"[{engine}/{model}/{config}] built in {time.perf_counter() - t0:.0f} s", flush=True)
        try:  # a failing configuration frees its model too, or the next one starts on a full GPU
            run_phases(workers, model, config, batches, plans, args, settings.device, refs, old_lp, cells,
                       profiles, f"{engine} {model}")
        finally:
            workers.close()


def run_phases(workers, model, config, batches, plans, args, device, refs, old_lp, cells: list[Cell],
               profiles: list[str], label: str) -> None:
    """Every phase of every batch on one configuration's ``workers``; each old log-prob call's
    ``[B, R]`` log-probs go to ``old_lp[config, batch]``. A cell that runs out of
    GPU memory is kept as such (its ``seconds`` NaN) and the next one runs: one batch too
    large for the card must not lose the others' figures."""
    old = {}
    for phase in [p for p in PHASES if p in args.phases]:  # all old log-probs before any update
        for batch in batches:
            n, t, ideal = plans[batch.name]
            if phase == "old":
                fn = lambda b=batch: workers.old_log_prob(b)  # noqa: E731
            elif phase == "ref":
                fn = lambda b=batch: workers.ref_log_prob(b)  # noqa: E731
            else:
                lp = old.get(batch.name, (None,))[0]
                fn = lambda b=batch, lp=lp: workers.update(b, lp)  # noqa: E731
            try:
                with counted_calls(workers.engine_for(phase), "forward_step") as steps:
                    timing = timed(fn, args.warmup, args.iters, device)
            except torch.OutOfMemoryError as e:
                oom = ". ".join(str(e).split(". ")[:2])  # used outside the handler, once its frames are freed
            else:
                oom = None
            if oom:
                print(f"  {batch.name:>10} {config:>5} {PHASE_NAMES[phase]:>20}: {oom}", flush=True)
                free_memory()
                cells.append(Cell(model, batch.name, config, phase, n, t, math.nan, math.nan, ideal))
                continue
            seconds, peak, result = timing.seconds, timing.peak, timing.result
            cell = Cell(model, batch.name, config, phase, n, t, seconds, peak, ideal,
                        micro_batches=len(steps) / (args.warmup + args.iters), alloc_retries=timing.retries)
            if phase == "old":
                old[batch.name] = result
                old_lp[config, batch.name] = result[0]
                mask = response_mask(batch)
                ref = refs.get(batch.name)
                if ref is not None:
                    s = ref.size(0)
                    cell.vs_fp32 = response_diff(result[0][:s, : ref.size(1)], ref, mask[:s, : ref.size(1)])
            cells.append(cell)
            print(f"  {batch.name:>10} {config:>5} {PHASE_NAMES[phase]:>20}: {seconds:.3f} s "
                  f"({n / seconds:,.0f} tok/s, peak {peak:.1f} GiB"
                  + (f", {timing.retries} allocator retries" if timing.retries else "") + ")", flush=True)
            if phase in args.profile:
                profiles.append(profile_steps({config: fn}, f"profile: {label} {batch.name} "
                                              f"{PHASE_NAMES[phase]}, {config}", iters=1))
                print(profiles[-1], flush=True)
            if phase in args.profile_idle:
                profiles.append(gpu_idle_by_function(fn, IDLE_MODULES, f"GPU idle by host function: {label} "
                                                     f"{batch.name} {PHASE_NAMES[phase]}, {config}"))
                print(profiles[-1], flush=True)


# --profile-idle: the host code whose functions get profiler ranges (verl's workers and engines,
# the layers, the optimizer, tensordict; ps-mcore and its wiring)
IDLE_MODULES = ("verl.workers", "verl.utils.tensordict_utils", "verl.utils.seqlen_balancing", "verl.models.mcore",
                "verl.trainer.ppo.core_algos", "verl.utils.torch_functional", "ps_mcore", "prefix_sharing",
                "megatron.core.models", "megatron.core.transformer", "megatron.core.pipeline_parallel",
                "megatron.core.optimizer", "tensordict.base", "tensordict._td", "transformers.models")


def floor_counted_ideal(stock_s: float, floor_s: float, ideal: float) -> float:
    """The ideal speedup when a call's floor (stock's time on the one-sample ``floor`` batch:
    the optimizer step, verl's batch handling, launches) does not shrink with the tokens and
    the rest of stock's time shrinks by the FLOP ideal."""
    floor_s = min(floor_s, stock_s)
    return stock_s / (floor_s + (stock_s - floor_s) / ideal)


def table(cells: list[Cell]) -> str:
    stock = {(c.model, c.batch, c.phase): c.seconds for c in cells if c.config == "stock" and not math.isnan(c.seconds)}
    rows = []
    for c in cells:
        base = stock.get((c.model, c.batch, c.phase))
        floor = stock.get((c.model, "floor", c.phase))
        speedup = base / c.seconds if base else float("nan")
        shared = c.config != "stock" and base  # stock is the baseline: no measured/ideal of its own
        counted = speedup / floor_counted_ideal(base, floor, c.ideal) if shared and floor else float("nan")
        seconds = "out of memory" if math.isnan(c.seconds) else c.seconds
        rows.append([c.model, c.batch, c.config, PHASE_NAMES[c.phase], c.n, c.t, c.micro_batches, seconds,
                     c.n / c.seconds, c.peak, speedup, c.ideal, speedup / c.ideal if shared else float("nan"),
                     float("nan") if floor is None else floor, counted,
                     c.vs_stock, c.vs_fp32])
    return format_table(HEADERS, rows)


def retries_note(cells: list[Cell]) -> str:
    """A line under the table naming the cells whose timed calls ran out of free GPU memory: the
    allocator then released its cache and retried, so such a time includes that wait and moves
    with what ran before it in the process; empty when none did."""
    hit = [f"{c.model} {c.batch} {c.config} {PHASE_NAMES[c.phase]} ({c.alloc_retries})" for c in cells
           if c.alloc_retries]
    if not hit:
        return ""
    return ("\n\nAllocator retries in the timed calls (the card's memory ran out, the CUDA allocator released "
            "its cache and retried; these times include that and are not comparable): " + ", ".join(hit))


QUICK = dict(models=["qwen2.5-1.5b"], batches=list(BATCHES), warmup=1, iters=2,
             sizes=dict(gsm8k=8, **{"pg-4k": 2, "pg-8k": 2}, agent=2, **{"no-sharing": 8}, floor=1))
DEFAULT_REPEATS = dict(warmup=1, iters=3)
FULL_SIZES = dict(gsm8k=16, **{"pg-4k": 4, "pg-8k": 4}, agent=4, **{"no-sharing": 16}, floor=1)


def batch_sizes(args) -> dict[str, int]:
    """Groups / trajectories / samples per batch: ``--quick``'s or the full sizes, times
    ``--scale`` (the floor batch stays one sample)."""
    sizes = QUICK["sizes"] if args.quick else FULL_SIZES
    return {name: 1 if name == "floor" else max(1, round(n * args.scale)) for name, n in sizes.items()}


def benchmark(args) -> int:
    settings = run_settings(args)
    start(tiny=False)
    sizes = batch_sizes(args)
    report = [f"verl 0.8.0 actor worker, one GPU ({torch.cuda.get_device_name()}), torch {torch.__version__}, "
              f"date {time.strftime('%Y-%m-%d')}, command `python {' '.join(sys.argv)}`; token budget "
              f"{args.max_token_len}, warm-up {args.warmup}, timed {args.iters} mini-batches per cell; "
              "CUDA allocator with expandable segments (as verl's training step)"]
    by_engine: dict[str, list[Cell]] = {e: [] for e in args.engines}
    profiles: list[str] = []
    for model in args.models:
        engines = model_engines(model, args.engines)
        if not engines:
            continue
        vocab = MODELS[model]["vocab_size"]
        batches = [make_batch(name, vocab, sizes[name], args.seed + i) for i, name in enumerate(args.batches)]
        print(f"[{model}] writing the model directory", flush=True)
        model_dir = write_model_dir(model, "cuda", weights=not is_moe(model))
        refs = {}
        if args.ref_samples and not is_moe(model) and "old" in args.phases:
            refs = {b.name: fp32_reference(model_dir, b, args.ref_samples, "cuda") for b in batches}
        with megatron_seeded_init(is_moe(model)):
            for engine in engines:
                by_engine[engine] += run_engine_model(engine, model, model_dir, batches, args, settings, refs,
                                                      profiles)
                # what is measured so far survives a later failure
                write_report(report, by_engine, args.out, profiles)
    print(write_report(report, by_engine, args.out, profiles))
    return 0


def write_report(header: list[str], by_engine: dict[str, list[Cell]], path: str | None,
                 profiles: list[str] = ()) -> str:
    """The header, one table per engine and the ``--profile`` tables, written to ``path`` (if
    given) and returned."""
    text = "\n".join(header + [f"\n### {e}\n\n" + table(cells) + retries_note(cells)
                                for e, cells in by_engine.items() if cells]
                     + [f"\n{p}" for p in profiles])
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return text


# ----------------------------------------------------------------------------- curves

CURVE_METRICS = ("loss", "grad_norm", "entropy", "held_out_logp")
CURVE_RUNS = (("stock", "stock"), ("stock-2", "stock"), ("ps", "ps"))  # (label, configuration)


def curve_batches(vocab: int, seed: int, tiny: bool) -> tuple[list[Batch], Batch]:
    """Four fixed GSM8K-shaped training batches (step k trains on batch k mod 4) and a held-out
    one; ``tiny``: 2 groups each at 1/16 of the lengths."""
    groups, scale = (2, 1 / 16) if tiny else (4, 1.0)
    train = [make_batch("gsm8k", vocab, groups, seed + i, scale) for i in range(4)]
    return train, make_batch("gsm8k", vocab, max(1, groups // 2), seed + 100, scale)


def curve_run(engine: str, config: str, model_dir: str, settings: RunSettings, steps: int,
              train: list[Batch], held_out: Batch) -> dict[str, list[float]]:
    """``steps`` trainer steps (old log-probs, then ``update_actor``) of fresh workers; per
    step the :data:`CURVE_METRICS`, and the tokens the update computed (``tokens``) of
    ``num_tokens``."""
    with patchsets(config):
        workers = Workers(engine, model_dir, config, settings, ref=False)
        hist = {k: [] for k in CURVE_METRICS + ("tokens", "num_tokens")}
        for step in range(steps):
            batch = train[step % len(train)]
            lp, ent = workers.old_log_prob(batch)
            metrics = workers.update(batch, lp)
            hist["loss"].append(float(np.sum(metrics["loss"])))
            hist["grad_norm"].append(float(np.mean(metrics["grad_norm"])))
            hist["entropy"].append(float(ent[response_mask(batch)].mean()))
            held, _ = workers.old_log_prob(held_out)
            hist["held_out_logp"].append(float(held[response_mask(held_out)].mean()))
            hist["tokens"].append(packed_tokens(metrics, batch))
            hist["num_tokens"].append(batch.num_tokens)
        workers.close()
    return hist


def curve_rows(runs: dict, engines: list[str], tiny: bool) -> tuple[list[list], bool]:
    """Per (engine, metric): the largest per-step :func:`deviation` of ps-mcore from stock next
    to stock's own run-to-run one, the first / last values, and the tokens ps-mcore's updates
    computed of N. ``tiny``: the verdict against the fp32 tolerances, the sharing path shown to
    have run."""
    rows, ok = [], True
    for engine in engines:
        stock, again, ps = (runs[(engine, label)] for label, _ in CURVE_RUNS)
        tokens, num_tokens = sum(ps["tokens"]), sum(ps["num_tokens"])
        for key in CURVE_METRICS:
            ps_dev = float(deviation(key, ps[key], stock[key]).max())
            row = [engine, key, "rel" if key in RELATIVE else "abs", ps_dev,
                   float(deviation(key, again[key], stock[key]).max()), stock[key][0], stock[key][-1], ps[key][-1],
                   f"{tokens}/{num_tokens}"]
            if tiny:
                good = ps_dev <= tolerance(key) and tokens < num_tokens
                ok &= good
                row.append("ok" if good else "FAIL")
            rows.append(row)
    return rows, ok


def curves(args) -> int:
    """``--curves N``: stock twice and ps-mcore once per engine, N steps each from the same
    weights; with ``--tiny`` exits 0 only when every per-step deviation is within the fp32
    tolerances."""
    device = start(args.tiny)
    settings = run_settings(args)
    model = args.models[0]
    engines = model_engines(model, args.engines)
    train, held_out = curve_batches(MODELS[model]["vocab_size"], args.seed, args.tiny)
    model_dir = write_model_dir(model, device, weights=not is_moe(model))
    runs: dict[tuple[str, str], dict[str, list[float]]] = {}
    with megatron_seeded_init(is_moe(model)):
        for engine in engines:
            for label, config in CURVE_RUNS:
                print(f"[curves {engine}/{label}] {args.curves} steps", flush=True)
                runs[(engine, label)] = curve_run(engine, config, model_dir, settings, args.curves, train, held_out)
    rows, ok = curve_rows(runs, engines, args.tiny)
    headers = ["engine", "metric", "deviation", "max|ps - stock|", "max|stock2 - stock|", "stock first", "stock last",
               "ps last", "ps tokens T/N"] + (["fp32"] if args.tiny else [])
    text = (f"training curves, {model} on {device}, {args.curves} steps, lr {args.lr}, command "
            f"`python {' '.join(sys.argv)}`; per step, deviation abs (rel: relative to stock's largest value)\n\n"
            + format_table(headers, rows))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.plot:
        plot_curves(runs, engines, args.plot)
    if not args.tiny:
        return 0
    print(f"OK: every step within {TINY_ATOL} abs / {TINY_RTOL} rel" if ok
          else "FAILED: ps-mcore's curves differ from stock's")
    return 0 if ok else 1


def plot_curves(runs, engines, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("loss", "grad_norm", "entropy", "held_out_logp")
    fig, axes = plt.subplots(len(engines), len(keys), figsize=(4 * len(keys), 3 * len(engines)), squeeze=False)
    for r, engine in enumerate(engines):
        for c, key in enumerate(keys):
            ax = axes[r][c]
            for label, style in (("stock", "-"), ("stock-2", ":"), ("ps", "--")):
                ax.plot(runs[(engine, label)][key], style, label=label)
            ax.set_title(f"{engine}: {key}")
            ax.set_xlabel("step")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------- tiny (CPU, CI)

# fp32 on a CPU. Outputs: shared rows are computed once instead of per sample, which only
# reorders fp32 sums (measured noise here ~1e-6 on log-probs of magnitude ~5); gradients of
# shared rows are summed in another order (<= 4e-6 of a tensor's largest entry, see
# tests/verl_batches.py). Tolerances: 1e-5 absolute on log-probs / entropy, 1e-5 relative on
# losses and grad norms, 1e-5 x max|g| per gradient tensor.
TINY_ATOL, TINY_RTOL = 1e-5, 1e-5
RELATIVE = ("loss", "grad_norm")  # compared relative to stock's values; log-probs and entropy absolute


def deviation(metric: str, value, stock) -> np.ndarray:
    """|value - stock| (scalars or per-step curves), for the :data:`RELATIVE` metrics relative
    to stock's largest |value| (a PPO loss curve crosses zero)."""
    value, stock = np.asarray(value, dtype=np.float64), np.asarray(stock, dtype=np.float64)
    diff = np.abs(value - stock)
    return diff / max(float(np.abs(stock).max()), 1e-12) if metric in RELATIVE else diff


def tolerance(metric: str) -> float:
    return TINY_RTOL if metric in RELATIVE else TINY_ATOL


def tiny_batches(vocab: int) -> list[Batch]:
    return [make_batch("gsm8k", vocab, 2, 1, scale=1 / 16), make_batch("agent", vocab, 1, 2, scale=1 / 32),
            make_batch("pg-4k", vocab, 1, 3, scale=1 / 128)]


def tiny_run(engine: str, config: str, model_dir: str, batches: list[Batch], settings: RunSettings) -> dict:
    with patchsets(config), prefix_grouper_driving(config):
        workers = Workers(engine, model_dir, config, settings, ref=True)
        if engine == "fsdp" and not fsdp2_casts_inputs(workers.actor.actor.engine.module):
            raise RuntimeError("the fsdp engine's model does not cast its forward inputs: the check would "
                               "miss the path verl's mixed-precision policy takes on a GPU")
        workers.capture_grads()
        out = {}
        for b in batches:
            lp, ent = workers.old_log_prob(b)
            ref = workers.ref_log_prob(b)
            with counted_calls(workers.engine_for("update"), "forward_step") as steps:
                metrics = workers.update(b, lp)
            out[b.name] = dict(log_probs=lp, entropy=ent, ref=ref, loss=float(np.sum(metrics["loss"])),
                               grad_norm=float(np.mean(metrics["grad_norm"])), grads=workers.grads,
                               tokens=packed_tokens(metrics, b), micro_batches=len(steps))
        workers.close()
    return out


def fsdp2_casts_inputs(module: torch.nn.Module) -> bool:
    """Whether FSDP2 casts ``module``'s forward kwargs (verl's fsdp2 engine builds
    ``MixedPrecisionPolicy(param_dtype=..., cast_forward_inputs=True)``; fp32 here): its hooks
    then walk every wrapped module's kwargs, the tree call included."""
    state = getattr(module, "_get_fsdp_state", None)
    policy = state()._mp_policy if state is not None else None
    return policy is not None and policy.cast_forward_inputs and policy.param_dtype is not None


def packed_tokens(metrics: dict, batch: Batch) -> int:
    """Tokens the update's forward computed (``prefix_sharing/tokens_packed``: ps-mcore's
    metric, and :func:`pg_forward_step`'s count for PrefixGrouper); N when absent."""
    return int(np.sum(metrics[TOKENS_PACKED])) if TOKENS_PACKED in metrics else batch.num_tokens


def tiny_compare(stock: dict, other: dict, batches: list[Batch], config: str) -> tuple[list[list], bool]:
    rows, ok = [], True
    for b in batches:
        s, o, mask = stock[b.name], other[b.name], response_mask(b)
        d = {k: response_diff(o[k], s[k], mask) for k in ("log_probs", "entropy", "ref")}
        loss, gnorm = (float(deviation(k, o[k], s[k])) for k in RELATIVE)
        grad = max(float((a - g).abs().max()) / max(float(g.abs().max()), 1e-12) for a, g in zip(o["grads"], s["grads"]))
        # the sharing path really ran (PrefixGrouper shares only groups of one prompt)
        shared = o["tokens"] < b.num_tokens or (config == "pg" and b.group_size == 1)
        good = (shared and max(d.values()) <= TINY_ATOL and loss <= TINY_RTOL and gnorm <= TINY_RTOL and grad <= TINY_RTOL
                and len(o["grads"]) == len(s["grads"]) and min(o["micro_batches"], s["micro_batches"]) >= 1)
        ok &= good
        rows.append([b.name, b.num_tokens, o["tokens"], f"{s['micro_batches']} / {o['micro_batches']}", d["log_probs"],
                     d["entropy"], d["ref"], loss, gnorm, grad, "ok" if good else "FAIL"])
    return rows, ok


def tiny(args) -> int:
    start(True)
    # lr 1e-12: Adam moves every weight by ~lr whatever its gradient, so a larger lr would turn
    # fp32 gradient noise into different weights for the next batch
    settings = run_settings(args, lr=1e-12)
    headers = ["model", "engine", "config", "batch", "N", "T", "update micro-batches, stock / config", "max|dlogp|",
               "max|dentropy|", "max|dref|", "loss rel", "grad-norm rel", "max grad rel", ""]
    rows, ok = [], True
    for model in args.models:
        model_dir = write_model_dir(model, "cpu", weights=not is_moe(model))
        batches = tiny_batches(MODELS[model]["vocab_size"])
        with megatron_seeded_init(is_moe(model)):
            for engine in model_engines(model, args.engines):
                stock = tiny_run(engine, "stock", model_dir, batches, settings)
                for config in CONFIGS[engine][1:]:
                    if config not in args.configs:
                        continue
                    r, good = tiny_compare(stock, tiny_run(engine, config, model_dir, batches, settings), batches, config)
                    rows += [[model, engine, config] + row for row in r]
                    ok &= good
    print(f"tiny exactness check (CPU, fp32, verl's real ActorRolloutRefWorker): vs stock, tolerance "
          f"{TINY_ATOL} abs / {TINY_RTOL} rel\n\n" + format_table(headers, rows))
    ok &= bool(rows)
    print("OK" if ok else "FAILED: a configuration differs from stock")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=["fsdp", "megatron"], choices=list(CONFIGS))
    p.add_argument("--configs", nargs="+", default=["stock", "pg", "ps"], choices=["stock", "pg", *PS_CONFIGS],
                   help="configurations to run, in this order (stock is the baseline of every ratio)")
    p.add_argument("--models", nargs="+", choices=list(MODELS),
                   help=f"default: {', '.join(GPU_MODELS)}; --quick: qwen2.5-1.5b; "
                        f"--curves: qwen2.5-0.5b; --tiny: tiny (--tiny runs {', '.join(TINY_MODELS)} only)")
    p.add_argument("--batches", nargs="+", default=list(BATCHES), choices=BATCHES)
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    p.add_argument("--profile", nargs="+", default=[], choices=PHASES, metavar="PHASE",
                   help="after timing these phases, one more call of each under the CUDA profiler: kernel "
                        "time by kind, the wall time no kernel covers, and the host syncs (GPU only)")
    p.add_argument("--profile-idle", nargs="+", default=[], choices=PHASES, metavar="PHASE",
                   help="after timing these phases, one more call of each with profiler ranges on the host "
                        "functions: the GPU's idle time while each runs (GPU only)")
    p.add_argument("--quick", action="store_true",
                   help="Qwen2.5-1.5B, every batch at half size, 1 warm-up + 2 timed mini-batches per cell "
                        "(--warmup / --iters, when given, still apply)")
    p.add_argument("--both-orders", action="store_true",
                   help="run the configurations in --configs' order, then reversed, and report each cell's mean: "
                        "what running first or second in the process costs cancels out (twice the time)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every batch's size (groups, trajectories, samples): a mini-batch several "
                        "token budgets large, past the fixed costs of one update call")
    p.add_argument("--warmup", type=int, default=None, help="untimed mini-batches per cell (default 1)")
    p.add_argument("--iters", type=int, default=None, help="timed mini-batches per cell (default 3; --quick: 2)")
    p.add_argument("--max-token-len", type=int, default=16384, help="ppo_max_token_len_per_gpu (and log-prob budgets)")
    p.add_argument("--fused-kernels", action="store_true",
                   help="verl's fused LM-head kernels in every configuration (actor_rollout_ref.model."
                        "use_fused_kernels): log-probs and entropy without the [tokens, vocab] logits, so "
                        "larger budgets fit")
    p.add_argument("--recompute", action="store_true",
                   help="full activation recompute in every configuration: Megatron's full recompute of every "
                        "layer (uniform, 1 layer per checkpoint). FSDP2 checkpoints every layer on the GPU either "
                        "way (verl's default enable_gradient_checkpointing); --tiny turns that off unless this "
                        "option is given")
    p.add_argument("--pg-groups", type=int, default=1, help="PrefixGrouper: groups per fixed micro-batch")
    p.add_argument("--ref-samples", type=int, default=8, help="sequences per batch in the fp32 reference (0: none)")
    p.add_argument("--lr", type=float, default=None, help="actor lr (default 1e-6; 1e-5 with --curves, 1e-3 with --tiny --curves)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curves", type=int, default=0, metavar="N", help="training-curve check with N update steps")
    p.add_argument("--plot", help="--curves: write the overlaid curves here (png)")
    p.add_argument("--out", help="also write the tables (markdown) here")
    p.add_argument("--tiny", action="store_true", help="CPU exactness check, tiny model (what CI runs); "
                   "with --curves the training-curve check on the CPU")
    args = p.parse_args(argv)
    if args.models is None:
        args.models = (["tiny"] if args.tiny else ["qwen2.5-0.5b"] if args.curves
                       else QUICK["models"] if args.quick else list(GPU_MODELS))
    wrong = [m for m in args.models if (m in TINY_MODELS) != args.tiny]
    if wrong:
        p.error(f"--models {' '.join(wrong)}: " + (f"--tiny runs {', '.join(TINY_MODELS)}" if args.tiny
                                                   else f"{', '.join(TINY_MODELS)} run with --tiny only"))
    if not args.scale > 0:
        p.error(f"--scale must be > 0, got {args.scale}")
    for name, given in (("--profile", args.profile), ("--profile-idle", args.profile_idle)):
        if given and (args.tiny or args.curves):
            p.error(f"{name} times the benchmark's phases on the GPU: not with --tiny or --curves")
    if args.tiny and args.fused_kernels and "fsdp" in args.engines:
        p.error("--tiny --fused-kernels runs the megatron engine only (--engines megatron): verl 0.8.0's FSDP2 "
                "gives an untied LM head, the tiny model's, an FSDP unit of its own, and its fused forward "
                "then reads that head's sharded weight")
    if args.curves and len(args.models) != 1:
        p.error("--curves runs one model: give one to --models")
    if not any(model_engines(m, args.engines) for m in args.models):
        p.error(f"--models {' '.join(args.models)}: MoE models run on the megatron engine only (--engines)")
    if args.lr is None:  # --tiny --curves: the tiny model's weights (std 0.02) move visibly in a few steps
        args.lr = (1e-3 if args.tiny else 1e-5) if args.curves else 1e-6
    defaults = QUICK if args.quick else DEFAULT_REPEATS
    args.warmup = defaults["warmup"] if args.warmup is None else args.warmup
    args.iters = defaults["iters"] if args.iters is None else args.iters
    return args


def benchmark_per_model(args, run=None) -> int:
    """Several models: each model's benchmark in a process of its own, one after another (a
    model's workers, optimizer states and cached GPU memory leave with its process, so the
    next model starts on an empty GPU), then their reports together. ``run(args)`` (default
    :func:`benchmark`) is what each process runs."""
    reports, failed = [], False
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        for i, model in enumerate(args.models):
            one = copy.copy(args)
            one.models, one.out = [model], os.path.join(tmp, f"{i}.md")
            process = spawn.Process(target=run or benchmark, args=(one,))
            process.start()
            process.join()
            failed |= process.exitcode != 0
            if os.path.exists(one.out):
                with open(one.out) as f:
                    reports.append(f.read())
            else:
                reports.append(f"{model}: no report (its process exited with code {process.exitcode})")
    text = "\n\n".join(reports)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return int(failed)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("verl_actor.py needs a CUDA GPU (or --tiny for the CPU exactness check)")
    if args.curves:
        return curves(args)
    if args.tiny:
        return tiny(args)
    return benchmark_per_model(args) if len(args.models) > 1 else benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
