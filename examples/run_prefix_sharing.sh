#!/usr/bin/env bash
# verl 0.8.0 Megatron GRPO on GSM8K with Qwen2.5-0.5B-Instruct, prefix sharing on
# (prefix_grouper.mode=arbitrary_prefix). FSDP engine: examples/run_prefix_sharing_fsdp.sh.
# Data and weights: see examples/README.md. Edit the variables (or export them); the shared
# ones (MODEL_PATH, TRAIN_FILE, NGPUS, ...) are in examples/gsm8k_grpo_common.sh.
#   ENABLE_PREFIX_SHARING=0 bash examples/run_prefix_sharing.sh   # the same run, stock verl path
#   PRINT_OVERRIDES=1 bash examples/run_prefix_sharing.sh        # print the hydra overrides only
set -euo pipefail

ENGINE=megatron
TP=${TP:-1}
ENGINE_OVERRIDES=(
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$TP"
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size="$TP"
)
source "$(dirname "${BASH_SOURCE[0]}")/gsm8k_grpo_common.sh"
run_gsm8k_grpo "$@"
