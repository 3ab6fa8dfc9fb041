"""FSDP2 with a data-dependent number of model calls per rank: parameters gathered once,
gradients reduced once.

FSDP2 all-gathers a module's parameters in every forward (and again in backward) and
reduce-scatters its gradients in every backward: collectives every data-parallel rank must
issue in the same order. A cross-micro-batch schedule makes as many model calls (and release
backwards) as its plan has, which differs between ranks. :func:`gathered_once` takes FSDP2's
collectives out of the calls: on entry every rank gathers every FSDP module's parameters (in
module order) and keeps them, backwards accumulate gradients locally, and on exit one
reduction pass (a one-token forward whose loss is 0, backward with gradient sync on) reduces
the accumulated gradients once, as gradient accumulation without sync does; then the
parameters are resharded and every setting is what it was.

Memory: while inside, each rank holds the full parameters (and, in training, full gradients
in the reduce dtype), as FSDP without resharding or ``no_sync`` does.

Nothing inside may turn gradient sync back on (``set_requires_gradient_sync(True)``): the
next backward would reduce-scatter on the ranks that make one, and the ranks would wait on
each other's different collectives. A caller that toggles sync per micro-batch (gradient
accumulation without sync on all but the last) asks :func:`is_gathered` first and leaves it
alone: inside, every backward already accumulates without sync.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch

# The modules inside gathered_once now (weak: a module dropped inside is no longer listed).
_GATHERED: weakref.WeakSet = weakref.WeakSet()


def fsdp2_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 (``fully_shard``) modules in ``module``, in module order (root first)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def fsdp1_wrapped(module: torch.nn.Module) -> bool:
    """``module`` holds a FSDP1 ``FullyShardedDataParallel`` wrapper."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def is_gathered(module: torch.nn.Module) -> bool:
    """``module`` is inside :func:`gathered_once` now: its gradient sync must stay off until
    the context leaves (see the module docstring)."""
    return module in _GATHERED


def _groups(module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


# Per-group settings gathered_once changes (what FSDP2's public setters write), saved to be put
# back exactly: the root's "keep parameters after forward" default has no public setter.
_SYNC = ("reshard_after_backward", "reduce_grads", "all_reduce_grads")
_OTHER = ("post_forward_mesh_info", "reduce_scatter_unused_params")


class _Saved:
    def __init__(self, module):
        self.module = module
        self.state = module._get_fsdp_state()
        self.auto = getattr(self.state, "_auto_reshard_after_forward", None)
        self.groups = [(g, {a: getattr(g, a) for a in _SYNC + _OTHER if hasattr(g, a)}) for g in _groups(module)]

    def restore(self, names=_SYNC + _OTHER) -> None:
        for group, values in self.groups:
            for name in names:
                if name in values:
                    setattr(group, name, values[name])
        if self.auto is not None and "post_forward_mesh_info" in names:
            self.state._auto_reshard_after_forward = self.auto


@contextlib.contextmanager
def gathered_once(
    module: torch.nn.Module, training: bool, reduction_pass: Callable[[], torch.Tensor]
) -> Iterator[None]:
    """Inside: ``module``'s FSDP2 modules keep their gathered parameters and accumulate
    gradients without collectives (see the module docstring). Every rank must enter and leave
    together (each issues the same collectives on entry and exit, whatever it runs inside).

    Args:
        module: the model (FSDP2-wrapped; without FSDP2 modules this does nothing).
        training: reduce the accumulated gradients on exit.
        reduction_pass: runs a forward of ``module`` that reaches every parameter (e.g. one
            token) and returns a scalar depending on its output; on exit its ``0 *`` value is
            backpropagated with the modules' own gradient sync settings (on, as verl runs
            them), so every FSDP2 module reduces its accumulated gradients once. Not run when leaving on an exception (no collective).
    """
    modules = fsdp2_modules(module)
    if modules and hasattr(modules[0]._get_fsdp_state(), "_lazy_init"):
        # The root's first forward would otherwise set its root-only defaults inside, and
        # leaving would put back the pre-initialisation values over them.
        modules[0]._get_fsdp_state()._lazy_init()
    saved = [_Saved(m) for m in modules]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        m.set_requires_gradient_sync(False, recurse=False)
    if modules:
        _GATHERED.add(module)
    try:
        for m in modules:
            m.unshard()
        yield
        if training and modules:
            for s in saved:
                s.restore(_SYNC)  # the module's own sync and reshard-after-backward settings
                if hasattr(s.module, "set_reduce_scatter_unused_params"):  # same set on every rank
                    s.module.set_reduce_scatter_unused_params(True, recurse=False)
            with torch.enable_grad():
                (reduction_pass() * 0).backward()
    finally:
        _GATHERED.discard(module)
        for s in saved:
            s.restore()
        for m in modules:
            m.reshard()
