"""Dropout on shared rows: which dropouts of a model are active, and why a tree run refuses them.

A prefix tree computes every shared row once for all the samples that hold it, so a dropout
mask drawn on a shared row is common to those samples, where the unshared run draws one mask
per sample. Each sample's own mask distribution is the same either way (every element kept
with probability ``1 - p``, kept elements scaled by ``1 / (1 - p)``); what changes is that
samples sharing a row share its mask. That is a different training run, so it only happens
when the user opts in (``shared_dropout=True``); otherwise a tree run with active dropout is
refused with one message naming every dropout and the config key that turns it off.

Found in a model's current mode (``module.training``):

* dropout modules (``torch.nn.Dropout`` and its siblings) with ``p > 0``, e.g. Hugging Face's
  residual / embedding / classifier dropouts and PEFT's ``lora_dropout``;
* float attributes named ``*dropout*`` or ``*pdrop*`` above 0, the rates of functional
  dropouts (``F.dropout(x, p=self.dropout, training=self.training)``; Megatron's
  ``hidden_dropout`` in every layer's bias-dropout-add).

Pure torch: the Megatron and Hugging Face sides say which config key sets each site.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

SHARED_MASKS_NOTE = (
    "each sample's own mask distribution is unchanged; masks on shared rows are common to the "
    "samples that share them"
)
_RATE_NAME = re.compile(r"dropout|pdrop", re.IGNORECASE)
_MAX_LISTED = 6

# (site name, module holding the dropout or its rate, p) -> the config key that sets it
KeyFor = Callable[[str, torch.nn.Module, float], "str | None"]
# (site name, module holding it) -> True for attention-probability dropout
IsAttention = Callable[[str, torch.nn.Module], bool]


@dataclass(frozen=True)
class DropoutSite:
    """One active dropout.

    Attributes:
        name: the module's path (``model.layers.0.resid_attn_dropout``), or the path of the
            module holding a functional dropout's rate plus the attribute
            (``decoder.layers.0.hidden_dropout``).
        p: the drop probability.
        key: the config key that sets it, when known.
        attention: dropout of the attention probabilities, which the tree kernels do not
            implement (refused even with shared masks).
    """

    name: str
    p: float
    key: str | None
    attention: bool = False


def _is_rate(name: str, value) -> bool:
    return (
        _RATE_NAME.search(name) is not None
        and isinstance(value, float)
        and 0.0 < value <= 1.0
    )


def active_dropouts(
    model: torch.nn.Module, key_for: KeyFor | None = None, is_attention: IsAttention | None = None
) -> list[DropoutSite]:
    """Every dropout that would run on ``model`` in its current mode (see the module docstring)."""
    return [
        DropoutSite(name, p, key_for(name, holder, p) if key_for else None,
                    bool(is_attention and is_attention(name, holder)))
        for name, holder, p in _active_rates(model)
    ]


@dataclass
class _Scans:
    """The scans of one model: its modules when scanned (weak references, in order) and, per
    tuple of their train / eval flags, (site name, weak holder, p) of every active dropout."""

    modules: list[weakref.ref]
    by_flags: dict


_FOUND: "weakref.WeakKeyDictionary[torch.nn.Module, _Scans]" = weakref.WeakKeyDictionary()


def _active_rates(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, float]]:
    """(site name, module holding it, p) of every active dropout of ``model``, found once per
    model and mode. The scan reads every attribute of every module (milliseconds on a 28-layer
    model) and the verl glue asks before every micro-batch; rates are set when a model is
    built, and what changes after, ``train()`` / ``eval()`` and modules added, removed or
    replaced, is checked on every call: the modules must be the very objects scanned (weak
    references, so an address reused by a new module is not taken for the old one), and each
    tuple of flags has its own scan. Nothing here keeps ``model`` alive."""
    modules = list(model.modules())
    scans = _FOUND.get(model)
    if scans is None or len(scans.modules) != len(modules) or any(
        ref() is not module for ref, module in zip(scans.modules, modules)
    ):
        scans = _FOUND[model] = _Scans([weakref.ref(m) for m in modules], {})
    flags = tuple(m.training for m in modules)
    found = scans.by_flags.get(flags)
    if found is None:
        found = scans.by_flags[flags] = [(name, weakref.ref(holder), p) for name, holder, p in _scan_rates(model)]
    return [(name, holder(), p) for name, holder, p in found]


def _scan_rates(model: torch.nn.Module):
    modules = dict(model.named_modules())
    for path, module in modules.items():
        p = getattr(module, "p", 0.0)
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.training and p > 0:
            yield path, modules[path.rpartition(".")[0]], float(p)
        if not module.training:
            continue
        for attr, value in vars(module).items():
            if not attr.startswith("_") and _is_rate(attr, value):
                yield (f"{path}.{attr}" if path else attr), module, value


def config_dropout_keys(*configs) -> dict[str, float]:
    """``{key: rate}`` of the dropout-like keys (``*dropout*`` / ``*pdrop*``) of config objects."""
    keys: dict[str, float] = {}
    for config in configs:
        for name, value in vars(config).items():
            if _is_rate(name, value):
                keys.setdefault(name, value)
    return keys


_GENERIC_WORDS = {"dropout", "pdrop", "drop", "prob", "p", "rate"}


def _words(name: str) -> set[str]:
    return set(name.lower().split("_")) - _GENERIC_WORDS


def key_by_value(keys: dict[str, float], name: str, p: float) -> str | None:
    """The config key setting the site ``name`` (a dotted path) with rate ``p``: its last
    component when that is such a key; else, of the keys holding ``p``, those sharing a word
    with it (``resid_attn_dropout`` -> ``resid_pdrop``), or all of them (``"a or b"``); None
    when no key holds ``p``."""
    leaf = name.rpartition(".")[2]
    if keys.get(leaf) == p:
        return leaf
    matches = [k for k, v in keys.items() if v == p]
    related = [k for k in matches if _words(k) & _words(leaf)]
    return " or ".join(related or matches) or None


def _pattern(name: str) -> str:
    """``layers.3.mlp.dropout`` -> ``layers.*.mlp.dropout``: one line for every layer."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _listing(sites: list[DropoutSite]) -> tuple[str, list[str]]:
    """``"name (p=.., config key ..); ..."`` (one line per layer pattern) and the keys."""
    listed: dict[tuple[str, float, str | None], None] = {}
    for site in sites:
        listed.setdefault((_pattern(site.name), site.p, site.key), None)
    lines = [
        f"{name} (p={p:g}" + (f", config key {key})" if key else ", no config key: set its p to 0)")
        for name, p, key in listed
    ]
    if len(lines) > _MAX_LISTED:
        lines = lines[:_MAX_LISTED] + [f"and {len(lines) - _MAX_LISTED} more"]
    return "; ".join(lines), sorted({key for _, _, key in listed if key})


def _turn_off(keys: list[str], eval_hint: str) -> str:
    return (f"set {', '.join(keys)} to 0" if keys else "set them to 0") + f" (or {eval_hint})"


def shared_dropout_refusal(
    sites: list[DropoutSite], opt_in: str, shared_dropout: bool = False, eval_hint: str = "call .eval()"
) -> str | None:
    """The one message refusing ``sites`` on a prefix tree (None when nothing is refused).

    Args:
        sites: :func:`active_dropouts` of the model.
        opt_in: how the caller opts in to shared masks (e.g. ``"forward_tree(...,
            shared_dropout=True)"``).
        shared_dropout: the caller opted in: only attention dropout is refused.
        eval_hint: the alternative that switches dropout off.
    """
    shared = [s for s in sites if not s.attention and not shared_dropout]
    attention = [s for s in sites if s.attention]
    parts = []
    if shared:
        listed, keys = _listing(shared)
        parts.append(
            f"dropout is active on rows the prefix tree shares: {listed}. A shared row is "
            "computed once, so its dropout mask would be common to every sample holding it, "
            f"where the unshared run draws one per sample. To run it, {_turn_off(keys, eval_hint)}, "
            f"or opt in to shared masks with {opt_in}: {SHARED_MASKS_NOTE}."
        )
    if attention:
        listed, keys = _listing(attention)
        parts.append(
            f"attention dropout is not supported by prefix-tree attention (the tree kernels have "
            f"none, shared masks or not): {listed}; {_turn_off(keys, eval_hint)}."
        )
    return " ".join(parts) or None
