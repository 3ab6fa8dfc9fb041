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
# How a verl user opts in to dropout masks shared on shared rows (named in fallback warnings).
SHARED_DROPOUT_OPT_IN = "actor_rollout_ref.actor.prefix_grouper.shared_dropout=true"


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
