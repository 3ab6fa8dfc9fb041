"""Test-only: flash-linear-attention's Triton kernels with one config each.

fla autotunes every kernel over its configs on the first call of a process (per dtype): minutes
on a fresh GPU machine, most of a GPU test run. The result of a kernel does not depend on the
config (the same computation, tiled differently), so the GPU tests keep one config per
autotuner, the lightest (fewest pipeline stages, then warps) so it fits in shared memory.
Speed is the benchmarks' business; they autotune as users do. Never used by the library.
"""

from __future__ import annotations

import sys


def _lightest(config) -> tuple[int, int]:
    return (config.num_stages, config.num_warps)


def one_config_per_kernel(prefix: str = "fla.") -> list[tuple[object, list]]:
    """Trim every Triton autotuner reachable from the loaded modules named ``prefix*`` (through
    ``heuristics`` wrappers) to its lightest config. Returns ``(autotuner, its configs)`` pairs
    to undo it with :func:`restore_configs`."""
    from triton.runtime.autotuner import Autotuner

    seen: set[int] = set()
    trimmed = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for obj in list(vars(module).values()):
            while obj is not None and id(obj) not in seen:
                seen.add(id(obj))
                if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                    trimmed.append((obj, obj.configs))
                    obj.configs = [min(obj.configs, key=_lightest)]
                obj = getattr(obj, "fn", None)
    return trimmed


def restore_configs(trimmed: list[tuple[object, list]]) -> None:
    for autotuner, configs in trimmed:
        autotuner.configs = configs
