"""The ``prefix_grouper`` config on real verl (0.8.0, or 0.9.1 in the Python 3.12 stage): hydra composition of the shipped
configs and of the ``+`` form on verl's stock configs, driver-side ``validate_config`` and
worker-side ``omega_conf_to_dataclass``, defaults, bad values, ref/critic following."""

from __future__ import annotations

import pytest
from verl_helpers import BASE_OVERRIDES, compose, installed_patchsets, integration_config_dir, verl_config_dir  # noqa: F401

pytest.importorskip("verl")

CONFIG_DIR = integration_config_dir()  # the shipped configs of the installed verl release
from ps_mcore.integrations.verl_common.config import ENGINE_ATTR, PrefixGrouperConfig, reset_actor_setting  # noqa: E402


def _instantiate_worker_side(cfg):
    """What ActorRolloutRefWorker.init_model does with the ref and actor sections (verl
    0.8.0's key renames included; the ref is built first there)."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass

    ref_cfg = cfg.actor_rollout_ref.ref
    with open_dict(ref_cfg):
        ref_cfg.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref_cfg.ppo_micro_batch_size = ref_cfg.pop("log_prob_micro_batch_size", None)
        ref_cfg.ppo_micro_batch_size_per_gpu = ref_cfg.pop("log_prob_micro_batch_size_per_gpu", None)
        ref_cfg.use_dynamic_bsz = ref_cfg.pop("log_prob_use_dynamic_bsz", False)
        ref_cfg.ppo_max_token_len_per_gpu = ref_cfg.pop("log_prob_max_token_len_per_gpu", None)
    ref = omega_conf_to_dataclass(ref_cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    return actor, ref


def _validate_driver_side(cfg):
    from verl.utils.config import validate_config

    # use_critic=False: instantiating the critic loads its HF model (tested below without it)
    validate_config(cfg, use_reference_policy=True, use_critic=False)


def _critic(cfg):
    """The critic section instantiated as verl's driver does, minus its HF model."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass

    with open_dict(cfg.critic):
        del cfg.critic["model"]
    return omega_conf_to_dataclass(cfg.critic)


@pytest.fixture(autouse=True)
def _fresh_actor_setting():
    reset_actor_setting()
    yield
    reset_actor_setting()


@pytest.mark.parametrize("name", ["prefix_sharing_megatron", "prefix_sharing_fsdp"])
def test_shipped_config_composes_validates_and_instantiates(name, installed_patchsets):
    from ps_mcore.integrations.verl_common.trainer import follow_actor_setting

    cfg = compose(CONFIG_DIR, name, BASE_OVERRIDES + ["actor_rollout_ref.actor.prefix_grouper.min_prefix_len=16"])
    assert cfg.actor_rollout_ref.actor.strategy == ("megatron" if "megatron" in name else "fsdp")
    assert cfg.actor_rollout_ref.model.external_lib == "prefix_sharing"
    _validate_driver_side(cfg)
    follow_actor_setting(cfg)  # what the patched trainer init_workers does
    reset_actor_setting()  # a worker process: nothing instantiated yet
    actor, ref = _instantiate_worker_side(cfg)
    expected = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=16)  # the GSM8K demo's mode
    assert actor.use_prefix_grouper is True and actor.prefix_grouper == expected
    setting = getattr(actor.engine, ENGINE_ATTR)
    assert setting.enabled is True and setting.config == expected
    ref_setting = getattr(ref.engine, ENGINE_ATTR)
    assert ref_setting.enabled is True and ref_setting.config == expected
    critic = _critic(cfg)
    assert getattr(critic.engine, ENGINE_ATTR).enabled is True
    assert critic.prefix_grouper == expected


def _validated_plus_form(extra: str):
    """verl's stock megatron config with the actor's flag and mode set by ``+`` keys, plus
    ``extra``, composed and validated driver-side."""
    overrides = BASE_OVERRIDES + [
        "actor_rollout_ref.actor.use_prefix_grouper=true",
        "+actor_rollout_ref.actor.prefix_grouper.mode=arbitrary_prefix",
        extra,
    ]
    cfg = compose(verl_config_dir(), "ppo_megatron_trainer", overrides)
    _validate_driver_side(cfg)
    return cfg


def test_plus_form_on_stock_config(installed_patchsets):
    cfg = _validated_plus_form("+actor_rollout_ref.actor.prefix_grouper.min_group_size=3")
    actor, ref = _instantiate_worker_side(cfg)
    assert actor.prefix_grouper == PrefixGrouperConfig(mode="arbitrary_prefix", min_group_size=3)
    # the ref section has no flag of its own: it follows the actor of this process
    assert getattr(ref.engine, ENGINE_ATTR) == getattr(actor.engine, ENGINE_ATTR)


def test_flag_without_sub_config_means_prompt_only_defaults(installed_patchsets):
    cfg = compose(verl_config_dir(), "ppo_trainer", BASE_OVERRIDES + ["actor_rollout_ref.actor.use_prefix_grouper=true"])
    actor, _ = _instantiate_worker_side(cfg)
    setting = getattr(actor.engine, ENGINE_ATTR)
    assert setting.enabled is True
    assert setting.config == PrefixGrouperConfig() and setting.config.mode == "prompt_only"
    assert (setting.config.min_prefix_len, setting.config.min_group_size) == (8, 2)


def test_stock_config_without_flag_stays_off(installed_patchsets):
    from ps_mcore.integrations.verl_common.config import resolve_setting

    cfg = compose(verl_config_dir(), "ppo_megatron_trainer", BASE_OVERRIDES)
    actor, ref = _instantiate_worker_side(cfg)
    assert resolve_setting(actor.engine) is None and resolve_setting(ref.engine) is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.actor.prefix_grouper.mode=whole_batch", "mode='whole_batch'"),
        ("actor_rollout_ref.actor.prefix_grouper.min_prefix_len=0", "min_prefix_len=0"),
        ("actor_rollout_ref.actor.prefix_grouper.min_group_size=-2", "min_group_size=-2"),
        ("actor_rollout_ref.actor.prefix_grouper.min_saved_fraction=1.5", "min_saved_fraction=1.5"),
        ("actor_rollout_ref.actor.prefix_grouper.kv_row_cost=2", "kv_row_cost=2"),
        ("actor_rollout_ref.actor.prefix_grouper.cross_microbatch=maybe", "cross_microbatch='maybe'"),
        ("actor_rollout_ref.actor.prefix_grouper.shared_dropout=maybe", "shared_dropout='maybe'"),
        ("+actor_rollout_ref.actor.prefix_grouper.min_prefix=4", "'min_prefix'"),
    ],
)
def test_bad_values_fail_at_config_time(override, message, installed_patchsets):
    cfg = compose(CONFIG_DIR, "prefix_sharing_megatron", BASE_OVERRIDES + [override])
    with pytest.raises(Exception) as err:
        _validate_driver_side(cfg)
    assert message in str(err.value)


def test_plus_form_unknown_key_names_the_expected_keys(installed_patchsets):
    overrides = BASE_OVERRIDES + [
        "actor_rollout_ref.actor.use_prefix_grouper=true",
        "+actor_rollout_ref.actor.prefix_grouper.modes=prompt_only",
    ]
    cfg = compose(verl_config_dir(), "ppo_megatron_trainer", overrides)
    with pytest.raises(Exception, match=r"unknown key\(s\) \['modes'\]; expected \['mode'"):
        _validate_driver_side(cfg)


def test_plus_form_fails_in_verl_without_the_patch():
    """The problem the patch solves: stock verl rejects the sub-config keyword."""
    from ps_mcore import setup

    was = setup.installed()
    setup.uninstall()
    try:
        overrides = BASE_OVERRIDES + ["+actor_rollout_ref.actor.prefix_grouper.mode=prompt_only"]
        cfg = compose(verl_config_dir(), "ppo_trainer", overrides)
        with pytest.raises(Exception, match="unexpected keyword argument 'prefix_grouper'"):
            _instantiate_worker_side(cfg)
    finally:
        if was:
            setup.install(was)


def test_prefix_grouper_config_is_a_mapping():
    cfg = PrefixGrouperConfig.from_any({"mode": "arbitrary_prefix", "_target_": "x"})
    assert dict(cfg) == {
        "mode": "arbitrary_prefix", "min_prefix_len": 8, "min_group_size": 2, "min_saved_fraction": 0.05,
        "cross_microbatch": True, "kv_row_cost": None, "shared_dropout": False,
    }
    assert PrefixGrouperConfig.from_any(None) == PrefixGrouperConfig()
    with pytest.raises(ValueError, match="must be a mapping"):
        PrefixGrouperConfig.from_any(3)
    with pytest.raises(ValueError, match="positive integer"):
        PrefixGrouperConfig(min_prefix_len=True)


@pytest.mark.parametrize("driver_copies", [True, False], ids=["driver", "worker"])
def test_ref_keeps_its_own_sub_config_and_follows_the_actor_flag(driver_copies, installed_patchsets):
    """One rule on both sides: a key the ref sets is its own, an unset key is the actor's."""
    from ps_mcore.integrations.verl_common.config import resolve_setting
    from ps_mcore.integrations.verl_common.trainer import follow_actor_setting

    cfg = _validated_plus_form("+actor_rollout_ref.ref.prefix_grouper.min_prefix_len=32")
    if driver_copies:
        follow_actor_setting(cfg)
        assert cfg.actor_rollout_ref.ref.use_prefix_grouper is True
        reset_actor_setting()  # a worker process: nothing instantiated yet
    actor, ref = _instantiate_worker_side(cfg)
    assert resolve_setting(actor.engine).config == PrefixGrouperConfig(mode="arbitrary_prefix")
    ref_setting = resolve_setting(ref.engine)
    assert ref_setting.enabled is True
    assert ref_setting.config == PrefixGrouperConfig(min_prefix_len=32)
