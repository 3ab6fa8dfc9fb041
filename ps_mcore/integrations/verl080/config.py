"""The ``prefix_grouper`` sub-config and how verl's config dataclasses learn it.

User-facing keys (``actor_rollout_ref.actor``)::

    use_prefix_grouper: true
    prefix_grouper: {mode: prompt_only, min_prefix_len: 8, min_group_size: 2}

verl 0.8.0 knows the flag (a bool nobody reads) but not the sub-config: its actor config
dataclasses reject the ``prefix_grouper`` keyword. The patch wraps their ``__init__`` so
they accept it, validate it and hand the resolved :class:`PrefixSharingSetting` to the
engine config (``engine_config.ps_mcore_prefix_sharing``), which is what the engines read.
The critic configs learn both keys the same way. A config instantiated without
``use_prefix_grouper`` (the ref policy's in verl's yaml) follows the actor's setting.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from ps_mcore.config import PrefixGrouperConfig

ENGINE_ATTR = "ps_mcore_prefix_sharing"
CONFIG_ATTR = "prefix_grouper"


@dataclass(frozen=True)
class PrefixSharingSetting:
    """What one engine does: ``enabled`` None means "follow the actor" (ref policy)."""

    enabled: bool | None
    config: PrefixGrouperConfig


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
    """The enabled setting for an engine, or None when prefix sharing is off for it."""
    setting = getattr(engine_config, ENGINE_ATTR, None) if engine_config is not None else None
    if setting is not None and setting.enabled is None:
        setting = actor_setting()
    if setting is None or not setting.enabled:
        return None
    return setting


def _setting_from_kwargs(kwargs: dict, flag_known: bool) -> tuple[PrefixSharingSetting, bool]:
    """Pop our keys from a config's kwargs. Returns (setting, explicit flag given)."""
    raw = kwargs.pop(CONFIG_ATTR, None)
    config = PrefixGrouperConfig.from_any(raw)
    explicit = "use_prefix_grouper" in kwargs
    # actor configs have the flag as a field; critic configs learn it here
    flag = kwargs.get("use_prefix_grouper", False) if flag_known else kwargs.pop("use_prefix_grouper", False)
    if isinstance(flag, str) or not isinstance(flag, (bool, int)):
        raise ValueError(f"use_prefix_grouper must be true or false, got {flag!r}")
    return PrefixSharingSetting(enabled=bool(flag) if explicit else None, config=config), explicit


def _wrap_config_init(original, *, flag_known: bool, is_actor: bool):
    """``__init__`` accepting ``prefix_grouper`` (and ``use_prefix_grouper`` for critics)."""

    def __init__(self, *args, **kwargs):
        setting, explicit = _setting_from_kwargs(kwargs, flag_known)
        original(self, *args, **kwargs)
        if is_actor and explicit:
            _remember_actor(setting)
        elif not explicit and actor_setting() is not None:
            setting = actor_setting()  # ref / critic follow the actor configured here
        object.__setattr__(self, CONFIG_ATTR, setting.config)
        if not flag_known:
            object.__setattr__(self, "use_prefix_grouper", bool(setting.enabled))
        engine = getattr(self, "engine", None)
        if engine is not None and dataclasses.is_dataclass(engine):
            object.__setattr__(engine, ENGINE_ATTR, setting)

    functools.update_wrapper(__init__, original)
    return __init__


def actor_config_classes() -> list[type]:
    """verl 0.8.0's actor config dataclasses (each has its own generated ``__init__``)."""
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
