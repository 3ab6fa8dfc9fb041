"""Token-choice MoE routing without near-ties, for the GPU tests that hold a bf16 MoE model's
tree run to its stock run row by row against an fp32 reference (tests/test_gpu_moe_mla.py,
tests/test_gpu_bridge.py).

With generic router weights some tokens' k-th and (k+1)-th router logits nearly tie, and bf16
rounding upstream flips their top-k choice in one run and not in another: that token's
log-prob and every gradient row its share reaches move far, in the stock run as in the tree
run, so no per-row bound could hold. Scaling the router weights does not help (the logits and
their rounding errors scale together). :func:`route_by_token_` instead makes the top-k a
function of the token id with wide margins, and :func:`assert_same_routing` checks that
premise on the runs themselves: the fp32 reference's margins, and every bf16 run's top-k equal
to the reference's for every token.

The construction: the first ``E`` (number of experts) hidden dimensions carry a code per
vocabulary id, written by the word embedding and by nothing else (the rows of those dimensions
are zeroed in every matrix that writes into the residual stream: attention output projections,
expert down projections), so they reach every layer unchanged; the router gains of those
dimensions are 1 and each router reads only them, expert ``e`` from dimension ``e``. Token
``v``'s code gives the experts the levels ``linspace(1, -1, E)`` in a random order, so its
logits are ``gain * levels / rms(h)``: RMSNorm's ``1 / rms(h)`` depends on the context and
scales all logits of a token alike, so the gates vary with the context while the top-k set,
separated by ``2 / (E - 1)`` of the largest logit, does not (bf16 rounds by 2^-8 of it).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingNames:
    """Which parameters of a model play which part, by regular expression on their names."""

    embedding: str  # [V, H] word embedding
    routers: str  # [E, H] router (gate) weights
    writers: str  # [..., H, in] matrices writing into the residual stream (output dim -2)
    norms: str  # [H] RMSNorm gains of the routers' inputs


MEGATRON_NAMES = RoutingNames(
    embedding=r"^embedding\.word_embeddings\.weight$", routers=r"\.mlp\.router\.weight$",
    writers=r"\.(self_attention\.linear_proj|mlp\.experts\.(local_experts\.\d+\.)?linear_fc2)\.weight\d*$",
    norms=r"\.pre_mlp_layernorm\.weight$")
# Hugging Face models by family (tests/bridge_helpers.py): GPT-OSS's expert and router biases
# would need more than this
HF_ROUTING_NAMES = {"qwen3_moe": RoutingNames(
    embedding=r"^model\.embed_tokens\.weight$", routers=r"\.mlp\.gate\.weight$",
    writers=r"\.(self_attn\.o_proj\.weight|mlp\.experts\.down_proj)$", norms=r"\.post_attention_layernorm\.weight$")}


def _matching(model: torch.nn.Module, pattern: str) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if re.search(pattern, n)]


@torch.no_grad()
def route_by_token_(model: torch.nn.Module, names: RoutingNames, seed: int = 0, gain: float = 2.0) -> None:
    """Re-initialise ``model`` in place so that every router's top-k is a function of the token
    id with wide margins (module docstring). Every other weight keeps its values except the
    zeroed rows of the first ``E`` output dimensions of the residual writers."""
    (embedding,) = _matching(model, names.embedding)
    routers, writers, norms = (_matching(model, p) for p in (names.routers, names.writers, names.norms))
    assert routers and len(norms) == len(routers) and len(writers) >= 2 * len(routers), (
        "parameters not found", len(routers), len(norms), len(writers))
    experts = routers[0].shape[0]
    gen = torch.Generator().manual_seed(seed)
    levels = torch.linspace(1.0, -1.0, experts)
    codes = torch.stack([levels[torch.randperm(experts, generator=gen)] for _ in range(embedding.shape[0])])
    scale = float(embedding[:, experts:].float().std()) / float(levels.std())  # like the other dimensions
    embedding[:, :experts] = (scale * codes).to(embedding)
    for w in writers:
        w[..., :experts, :] = 0
    for g in norms:
        g[:experts] = 1
    for r in routers:
        r.zero_()
        r[:, :experts] = gain * torch.eye(experts)


@dataclass
class RouterCall:
    """One router forward: its input's logits in fp32 ``[T, E]`` and the top-k map ``[T, E]``."""

    logits: torch.Tensor
    routing_map: torch.Tensor


@contextlib.contextmanager
def record_routing(model: torch.nn.Module):
    """Every router forward of ``model`` (megatron's ``TopKRouter`` and subclasses) inside the
    block, in call order (one per MoE layer and forward); none in a model without routers."""
    from megatron.core.transformer.moe.router import TopKRouter

    calls: list[RouterCall] = []

    def hook(module, args, output):
        hidden = args[0].detach().reshape(-1, module.weight.shape[1])
        calls.append(RouterCall(hidden.float() @ module.weight.detach().float().T,
                                output[1].detach().reshape(hidden.shape[0], -1).bool()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TopKRouter)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def top_k_margins(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``[T]``: each token's k-th largest logit minus its (k+1)-th, over its largest |logit|."""
    top = logits.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) / logits.abs().amax(-1).clamp_min(1e-30)


def assert_same_routing(reference: list[RouterCall], runs: dict[str, tuple[list[RouterCall], torch.Tensor | None]],
                        k: int, min_margin: float = 0.1) -> None:
    """The premise of a per-row comparison of MoE runs: in the fp32 ``reference`` (unshared
    batch) every token's top-k is separated by at least ``min_margin`` of its largest logit, and
    each bf16 run's top-k (``runs``: name -> (its router calls, the row of each unshared token
    in them, e.g. a tree plan's ``unpack_index``, or None)) is the reference's for every token
    of every layer."""
    assert reference, "no router ran in the reference"
    for layer, ref in enumerate(reference):
        margin = top_k_margins(ref.logits, k)
        assert float(margin.min()) >= min_margin, (layer, float(margin.min()))
        assert bool((ref.routing_map.sum(-1) == k).all()), layer
    for name, (calls, rows) in runs.items():
        assert len(calls) == len(reference), (name, len(calls), len(reference))
        for layer, (call, ref) in enumerate(zip(calls, reference)):
            got = call.routing_map if rows is None else call.routing_map[rows.to(call.routing_map.device)]
            flips = int((got != ref.routing_map).any(-1).sum())
            assert flips == 0, f"{name}: layer {layer}: {flips} of {got.shape[0]} tokens routed unlike the fp32 reference"
