#!/usr/bin/env bash
# verl 0.8.0 FSDP2 GRPO on GSM8K with Qwen2.5-0.5B-Instruct, prefix sharing on
# (prefix_grouper.mode=arbitrary_prefix). Megatron engine: examples/run_prefix_sharing.sh.
# Data and weights: see examples/README.md. The shared variables (MODEL_PATH, TRAIN_FILE,
# NGPUS, ...) are in examples/gsm8k_grpo_common.sh.
#   ENABLE_PREFIX_SHARING=0 bash examples/run_prefix_sharing_fsdp.sh   # stock verl path
#   PRINT_OVERRIDES=1 bash examples/run_prefix_sharing_fsdp.sh        # print the overrides only
set -euo pipefail

ENGINE=fsdp
# verl's defaults for fused kernels and Ulysses SP; both also run on the tree (turn them on
# here as in any verl run).
ENGINE_OVERRIDES=(
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.ref.strategy=fsdp2
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.use_fused_kernels=False
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=1
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
)
source "$(dirname "${BASH_SOURCE[0]}")/gsm8k_grpo_common.sh"
run_gsm8k_grpo "$@"
