"""Megatron's recurrent mixers built without the CUDA packages only their stock forward uses.

megatron-core's ``GatedDeltaNet`` refuses to build without flash-linear-attention and
``MambaMixer`` without mamba-ssm (whose Triton gated RMSNorm it also builds as its ``norm``),
although the tree modules run prefix-tree and packed batches on the pure-torch kernels of
:mod:`ps_mcore.recurrent`, which need neither. :func:`init_stock_without` runs the stock
constructor on a copy of it whose module globals say the package is there (and, for Mamba,
name a pure-torch norm): the same parameters, buffers and state-dict keys as the stock module,
with megatron itself untouched. What still needs the package (the stock forward: sbhd batches,
inference) raises :func:`stock_forward_error`.
"""

from __future__ import annotations

import types
from typing import Any


def init_stock_without(stock_cls: type, module: Any, args: tuple, kwargs: dict, overrides: dict) -> None:
    """``stock_cls.__init__(module, *args, **kwargs)`` with the names in ``overrides`` replaced
    in the globals that constructor reads (a copy of the function; nothing is patched).

    Raises RuntimeError when the constructor reads none of these names: a megatron-core whose
    constructor changed, which this module does not know how to build."""
    init = stock_cls.__init__
    unknown = sorted(name for name in overrides if name not in init.__globals__)
    if unknown:
        raise RuntimeError(
            f"{stock_cls.__module__}.{stock_cls.__name__}.__init__ of this megatron-core reads no "
            f"{unknown}: the tree module cannot be built without the package it checks for here"
        )
    copy = types.FunctionType(
        init.__code__, {**init.__globals__, **overrides}, init.__name__, init.__defaults__, init.__closure__
    )
    copy.__kwdefaults__ = init.__kwdefaults__
    copy(module, *args, **kwargs)


def stock_forward_error(layer: str, package: str, what: str, runs: str) -> ImportError:
    """The error for ``what`` (a kind of batch only the stock forward of ``layer`` runs) when
    ``package`` is not installed; ``runs``: the batches the layer's torch kernels do run."""
    return ImportError(
        f"{layer}: {what} run megatron's stock forward, which needs {package} (not installed). "
        f"Without it this module runs {runs} on its pure-torch kernels only; install {package} "
        "for the rest"
    )
