# Shared by examples/run_prefix_sharing.sh (Megatron) and run_prefix_sharing_fsdp.sh (FSDP):
# verl 0.8.0 GRPO on GSM8K with Qwen2.5-0.5B-Instruct, prefix sharing on (arbitrary_prefix).
# Source it after setting ENGINE (megatron | fsdp) and ENGINE_OVERRIDES (an array), then call
# run_gsm8k_grpo "$@".
#   ENABLE_PREFIX_SHARING=0 ...   the same run on verl's stock path
#   PRINT_OVERRIDES=1 ...         print the config directory, name and overrides only
#   PREFIX_GROUPER_MODE=prompt_only ...   PrefixGrouper's algorithm (whole prompts only)

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-0.5B-Instruct}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/gsm8k/test.parquet}
NGPUS=${NGPUS:-8}
ROLLOUT_N=${ROLLOUT_N:-8}
# arbitrary_prefix (the default): prompts plus identical response openings are shared
PREFIX_GROUPER_MODE=${PREFIX_GROUPER_MODE:-arbitrary_prefix}
PROJECT=${PROJECT:-ps_mcore_gsm8k}
EXPERIMENT=${EXPERIMENT:-qwen2.5-0.5b-grpo-${ENGINE}-ps${ENABLE_PREFIX_SHARING:-1}}

# 1 (default): patched paths share prefixes; 0: every patched path is verl's own code.
export ENABLE_PREFIX_SHARING=${ENABLE_PREFIX_SHARING:-1}
# Load the patches in the driver and in every Ray worker through verl's plugin hook (the
# shipped config also sets actor_rollout_ref.model.external_lib=prefix_sharing).
export VERL_USE_EXTERNAL_MODULES=prefix_sharing

COMMON_OVERRIDES=(
    algorithm.adv_estimator=grpo
    data.train_files="$TRAIN_FILE"
    data.val_files="$TEST_FILE"
    data.train_batch_size=64
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12288
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.prefix_grouper.mode="$PREFIX_GROUPER_MODE"
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n="$ROLLOUT_N"
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384
    trainer.critic_warmup=0
    trainer.logger='["console"]'
    trainer.project_name="$PROJECT"
    trainer.experiment_name="$EXPERIMENT"
    trainer.n_gpus_per_node="$NGPUS"
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=10
    trainer.total_epochs=1
)

run_gsm8k_grpo() {
    local config_dir config_name="prefix_sharing_${ENGINE}"
    config_dir=$(python3 -c "import ps_mcore.integrations.verl080 as v; print(v.CONFIG_DIR)")
    local overrides=("${COMMON_OVERRIDES[@]}" "${ENGINE_OVERRIDES[@]}")
    if [[ "${PRINT_OVERRIDES:-0}" == "1" ]]; then
        echo "CONFIG_DIR=$config_dir"
        echo "CONFIG_NAME=$config_name"
        printf '%s\n' "${overrides[@]}"
        return 0
    fi
    exec python3 -m verl.trainer.main_ppo --config-path="$config_dir" --config-name="$config_name" \
        "${overrides[@]}" "$@"
}
