#!/usr/bin/env bash
# verl 0.8.0 Megatron GRPO on GSM8K with Qwen2.5-0.5B-Instruct, prefix sharing on.
# Data and weights: see examples/README.md. Edit the variables below (or export them).
#   ENABLE_PREFIX_SHARING=0 bash examples/run_prefix_sharing.sh   # the same run, stock verl path
#   PRINT_OVERRIDES=1 bash examples/run_prefix_sharing.sh        # print the hydra overrides only
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-0.5B-Instruct}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/gsm8k/test.parquet}
NGPUS=${NGPUS:-8}
TP=${TP:-1}
ROLLOUT_N=${ROLLOUT_N:-8}
PROJECT=${PROJECT:-ps_mcore_gsm8k}
EXPERIMENT=${EXPERIMENT:-qwen2.5-0.5b-grpo-megatron-ps${ENABLE_PREFIX_SHARING:-1}}

# 1 (default): patched paths share prefixes; 0: every patched path is verl's own code.
export ENABLE_PREFIX_SHARING=${ENABLE_PREFIX_SHARING:-1}
# Load the patches in the driver and in every Ray worker through verl's plugin hook (the
# shipped config also sets actor_rollout_ref.model.external_lib=prefix_sharing).
export VERL_USE_EXTERNAL_MODULES=prefix_sharing
PS_CONFIG_DIR=$(python3 -c "import ps_mcore.integrations.verl080 as v; print(v.CONFIG_DIR)")

OVERRIDES=(
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
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$TP"
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.prefix_grouper.mode=prompt_only
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n="$ROLLOUT_N"
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size="$TP"
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

if [[ "${PRINT_OVERRIDES:-0}" == "1" ]]; then
    echo "CONFIG_DIR=$PS_CONFIG_DIR"
    echo "CONFIG_NAME=prefix_sharing_megatron"
    printf '%s\n' "${OVERRIDES[@]}"
    exit 0
fi

exec python3 -m verl.trainer.main_ppo \
    --config-path="$PS_CONFIG_DIR" \
    --config-name=prefix_sharing_megatron \
    "${OVERRIDES[@]}" "$@"
