"""The ``prefix_grouper`` sub-config (:class:`PrefixGrouperConfig`) and how verl's config
dataclasses learn it.

User-facing keys (``actor_rollout_ref.actor``)::

    use_prefix_grouper: true
    prefix_grouper: {mode: prompt_only, min_prefix_len: 8, min_group_size: 2}

verl knows the flag (0.8.0 and 0.9.1: a bool no engine reads; the trainers' DP balancing
does) but not the sub-config: its actor config
dataclasses reject the ``prefix_grouper`` keyword. The patch wraps their ``__init__`` so
they accept it, validate it and hand the resolved :class:`PrefixSharingSetting` to the
engine config (``engine_config.ps_mcore_prefix_sharing``), which is what the engines read.
The critic configs learn both keys the same way. A config instantiated without
``use_prefix_grouper`` (the ref policy's in verl's yaml) follows the actor's setting.

:class:`PrefixGrouperConfig` checks the keys here, so its errors name verl's YAML paths; the
planner checks its own arguments again (``plan_prefix_tree`` raises on a bad mode or
threshold whoever calls it). Imports no verl: ``ps-mcore analyze`` reads its defaults.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ps_mcore.planner import MODES

ENGINE_ATTR = "ps_mcore_prefix_sharing"
CONFIG_ATTR = "prefix_grouper"
# How a verl user opts in to dropout masks shared on shared rows (named in fallback warnings).
SHARED_DROPOUT_OPT_IN = "actor_rollout_ref.actor.prefix_grouper.shared_dropout=true"


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
        cross_microbatch: with a token budget (``use_dynamic_bsz``), sharing units larger
            than the budget are computed once across micro-batches, their prefixes' K/V kept
            (:mod:`ps_mcore.minibatch`), instead of split into pieces that each recompute the
            prefix they share (False: split them, as before).
        kv_row_cost: budget tokens a kept prefix K/V row costs in that schedule; None (the
            default) estimates it from the model's shape
            (:func:`ps_mcore.minibatch.kept_kv_row_cost`).
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
    cross_microbatch: bool = True
    kv_row_cost: float | None = None
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
        for name in ("cross_microbatch", "shared_dropout"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"actor_rollout_ref.actor.prefix_grouper.{name}={getattr(self, name)!r}: must be true or false"
                )
        cost = self.kv_row_cost
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 < cost <= 1):
            raise ValueError(
                f"actor_rollout_ref.actor.prefix_grouper.kv_row_cost={cost!r}: must be in (0, 1] "
                "(budget tokens per kept K/V row) or null (estimated from the model)"
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


@dataclass(frozen=True)
class PrefixSharingSetting:
    """What one role's config says. ``enabled`` / ``config`` None: the role left that key
    unset (the ref policy in verl's yaml), so it follows the actor."""

    enabled: bool | None
    config: PrefixGrouperConfig | None

    def following(self, actor: PrefixSharingSetting | None) -> PrefixSharingSetting:
        """The one rule for roles other than the actor (ref policy, critic): each key this
        role leaves unset takes the actor's value, so old-log-prob, ref and value passes run
        like the actor's (ratios and KL stay consistent). The driver, the worker-side config
        ``__init__`` and the engines all apply it through here."""
        if actor is None:
            return self
        return PrefixSharingSetting(
            enabled=actor.enabled if self.enabled is None else self.enabled,
            config=actor.config if self.config is None else self.config,
        )


# The actor's setting in this process, followed by configs without their own flag.
_ACTOR_SETTING: list[PrefixSharingSetting] = []


def actor_setting() -> PrefixSharingSetting | None:
    """The setting of the last actor config instantiated in this process (None if none)."""
    return _ACTOR_SETTING[-1] if _ACTOR_SETTING else None


def reset_actor_setting() -> None:
    """Forget the process-wide actor setting (tests)."""
    _ACTOR_SETTING.clear()


def _remember_actor(setting: PrefixSharingSetting) -> None:
    _ACTOR_SETTING[:] = [setting]


def resolve_setting(engine_config: Any) -> PrefixSharingSetting | None:
    """The enabled setting for an engine (its config filled in), or None when prefix sharing
    is off for it."""
    setting = getattr(engine_config, ENGINE_ATTR, None) if engine_config is not None else None
    if setting is None:
        return None
    setting = setting.following(actor_setting())
    if not setting.enabled:
        return None
    return PrefixSharingSetting(enabled=True, config=setting.config or PrefixGrouperConfig())


def setting_from_keys(keys: Any, flag_known: bool = True) -> PrefixSharingSetting:
    """A role's setting from its config keys (a dict of kwargs or an OmegaConf node). With
    ``flag_known=False`` (critic configs, whose dataclass lacks the flag) both keys are popped
    from ``keys``; otherwise only ``prefix_grouper`` is (the actor's dataclass has the flag)."""
    raw = keys.pop(CONFIG_ATTR, None) if CONFIG_ATTR in keys else None
    config = None if raw is None else PrefixGrouperConfig.from_any(raw)
    if "use_prefix_grouper" not in keys:
        return PrefixSharingSetting(enabled=None, config=config)
    flag = keys["use_prefix_grouper"] if flag_known else keys.pop("use_prefix_grouper")
    if isinstance(flag, str) or not isinstance(flag, (bool, int)):
        raise ValueError(f"use_prefix_grouper must be true or false, got {flag!r}")
    return PrefixSharingSetting(enabled=bool(flag), config=config)


def _wrap_config_init(original, *, flag_known: bool, is_actor: bool):
    """``__init__`` accepting ``prefix_grouper`` (and ``use_prefix_grouper`` for critics)."""

    def __init__(self, *args, **kwargs):
        setting = setting_from_keys(kwargs, flag_known)
        original(self, *args, **kwargs)
        if is_actor and setting.enabled is not None:  # the actor: its unset sub-config is the default
            setting = dataclasses.replace(setting, config=setting.config or PrefixGrouperConfig())
            _remember_actor(setting)
        else:
            setting = setting.following(actor_setting())  # ref / critic follow the actor configured here
        object.__setattr__(self, CONFIG_ATTR, setting.config or PrefixGrouperConfig())
        if not flag_known:
            object.__setattr__(self, "use_prefix_grouper", bool(setting.enabled))
        engine = getattr(self, "engine", None)
        if engine is not None and dataclasses.is_dataclass(engine):
            object.__setattr__(engine, ENGINE_ATTR, setting)

    functools.update_wrapper(__init__, original)
    return __init__


def actor_config_classes() -> list[type]:
    """verl's actor config dataclasses (each has its own generated ``__init__``)."""
    from verl.workers.config import actor

    return [
        cls
        for cls in vars(actor).values()
        if isinstance(cls, type) and issubclass(cls, actor.ActorConfig)
    ]


def critic_config_classes() -> list[type]:
    from verl.workers.config import critic

    return [
        cls
        for cls in vars(critic).values()
        if isinstance(cls, type) and issubclass(cls, critic.CriticConfig)
    ]


def install_config_patches(patcher) -> None:
    """Teach verl's actor and critic config dataclasses the ``prefix_grouper`` keys."""
    for cls in actor_config_classes():
        patcher.set(cls, "__init__", _wrap_config_init(cls.__init__, flag_known=True, is_actor=True))
    for cls in critic_config_classes():
        patcher.set(cls, "__init__", _wrap_config_init(cls.__init__, flag_known=False, is_actor=False))
