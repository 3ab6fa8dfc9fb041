"""``PrefixGrouperConfig``: the planner's options in one validated, frozen value.

The planner's own vocabulary (:data:`ps_mcore.planner.MODES` and the minimum run length /
group size it prunes by), shared by ``ps-mcore analyze``, the verl integration (its
``actor_rollout_ref.actor.prefix_grouper`` sub-config, hence the key names in the error
messages) and any other caller. Imports nothing outside the core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ps_mcore.planner import MODES

__all__ = ["MODES", "PrefixGrouperConfig"]


@dataclass(frozen=True)
class PrefixGrouperConfig(Mapping):
    """``actor_rollout_ref.actor.prefix_grouper``.

    Attributes:
        mode: ``prompt_only`` (share whole identical prompts within a ``uid`` group, what
            PrefixGrouper did) or ``arbitrary_prefix`` (share any common prefix: step-wise
            agent samples, trees, duplicates).
        min_prefix_len: shared runs shorter than this are recomputed instead of shared.
        min_group_size: a run is shared only if at least this many samples pass through it.
        min_saved_fraction: a micro-batch whose plan saves less than this fraction of its
            tokens (1 - T/N) runs verl's stock forward instead (default 0.05: below ~5% the
            gather and plan overhead eats the gain).
        shared_dropout: run a training model's dropouts (Megatron ``hidden_dropout``, HF
            residual / classifier dropouts, ``lora_dropout``) on the packed rows, one mask
            per shared row common to the samples holding it (each sample's own mask
            distribution is unchanged). False (default): micro-batches of such a model run
            verl's stock forward, with one warning naming the dropouts and their keys.
    """

    mode: str = "prompt_only"
    min_prefix_len: int = 8
    min_group_size: int = 2
    min_saved_fraction: float = 0.05
    shared_dropout: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"actor_rollout_ref.actor.prefix_grouper.mode={self.mode!r}: expected one of {MODES}"
            )
        for name in ("min_prefix_len", "min_group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"actor_rollout_ref.actor.prefix_grouper.{name}={value!r}: must be a positive integer"
                )
        if not isinstance(self.shared_dropout, bool):
            raise ValueError(
                f"actor_rollout_ref.actor.prefix_grouper.shared_dropout={self.shared_dropout!r}: "
                "must be true or false"
            )
        frac = self.min_saved_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac < 1.0:
            raise ValueError(
                f"actor_rollout_ref.actor.prefix_grouper.min_saved_fraction={frac!r}: must be in [0, 1)"
            )

    # Mapping interface so verl code that treats sub-configs as dicts keeps working.
    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    @classmethod
    def _keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_any(cls, value: Any) -> "PrefixGrouperConfig":
        """From None (defaults), a mapping / DictConfig, or an instance."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            try:
                from omegaconf import DictConfig, OmegaConf

                if isinstance(value, DictConfig):
                    value = OmegaConf.to_container(value, resolve=True)
            except ImportError:  # pragma: no cover - omegaconf ships with verl
                pass
        if not isinstance(value, Mapping):
            raise ValueError(
                "actor_rollout_ref.actor.prefix_grouper must be a mapping "
                f"{{mode, min_prefix_len, min_group_size}}, got {type(value).__name__}"
            )
        data = {k: v for k, v in dict(value).items() if k != "_target_"}
        unknown = sorted(set(data) - set(cls._keys()))
        if unknown:
            raise ValueError(
                f"actor_rollout_ref.actor.prefix_grouper: unknown key(s) {unknown}; "
                f"expected {list(cls._keys())}"
            )
        return cls(**data)
