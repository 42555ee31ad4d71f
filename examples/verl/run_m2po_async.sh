#!/usr/bin/env bash
# M2PO on verl's asynchronous trainers: rollouts come from policies up to a few model versions old, and M2PO's
# second-moment trust region keeps the update stable on them.
#
# UNTESTED END TO END: this needs GPUs, vLLM (or SGLang), a model and data. What has been checked without a GPU:
# both modes' full command lines compose through verl's own Hydra entry points (DRY_RUN=1 below, run by
# tests/integration/test_verl_plugin.py for the default mode), and the loss verl calls is recipe.m2po's.
#
#   pip install "stalerl[verl]" vllm            # with the torch build you already have (see docs/algorithms/m2po.md)
#   MODEL=Qwen/Qwen2.5-Math-1.5B TRAIN_FILES=~/data/math/train.parquet VAL_FILES=~/data/math/test.parquet \
#       bash examples/verl/run_m2po_async.sh
#   DRY_RUN=1 bash examples/verl/run_m2po_async.sh     # print the composed config and exit (no GPU needed)
#
# MODE=separate_async (default): verl's v1 trainer with a standalone rollout pool (trainer.v1.trainer_mode).
#   Staleness is bounded by trainer.v1.sampler.max_off_policy_threshold, counted in model versions (MAX_STALENESS);
#   weights are pushed to the rollout pool every parameter_sync_step mini-batches (= TRAIN_BS / MINI_BS).
#   Watch training/off_policy/trajectory_staleness* and actor/m2po/* in the logs.
# MODE=fully_async: verl.experimental.fully_async_policy. Staleness is a sample-count ratio
#   (async_training.staleness_threshold, STALENESS_RATIO): up to (1 + ratio) x one sync's worth of samples may be
#   generated with old weights. Uses verl's stock fully_async config, so the M2PO keys are added with '+'.
#
# Both keep M2PO's behaviour log-probs exact: rollout.calculate_log_probs=true and
# algorithm.rollout_correction.bypass_mode=true, so old_log_prob is the log-prob of the policy that sampled each token
# (with partial rollout, per token). Keep top_p=1 / top_k=-1 so that the sampler's distribution is the policy's.
set -euo pipefail

MODE=${MODE:-separate_async}                 # separate_async | fully_async
MODEL=${MODEL:-Qwen/Qwen2.5-Math-1.5B}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/math/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/math/test.parquet}
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-vllm}

TRAIN_GPUS=${TRAIN_GPUS:-4}                  # trainer GPUs (FSDP data parallel)
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}              # standalone rollout GPUs
NNODES=${NNODES:-1}

TAU=${TAU:-0.04}                             # m2_threshold
SCOPE=${SCOPE:-dp_group}                     # local | dp_group (see the scope table in docs/algorithms/m2po.md)
N=${N:-8}                                    # responses per prompt (GRPO group)
TRAIN_BS=${TRAIN_BS:-64}                     # prompts per step (separate_async)
MINI_BS=${MINI_BS:-16}                       # prompts per optimizer step
# one micro-batch per mini-batch per GPU makes SCOPE=dp_group the exact whole-mini-batch Algorithm 1:
MICRO_BS=${MICRO_BS:-$(( MINI_BS * N / (TRAIN_GPUS * NNODES) ))}
MAX_PROMPT=${MAX_PROMPT:-1024}
MAX_RESPONSE=${MAX_RESPONSE:-4096}
MAX_STALENESS=${MAX_STALENESS:-4}            # separate_async: model versions
STALENESS_RATIO=${STALENESS_RATIO:-0.5}      # fully_async: sample-count ratio (verl's docs: keep below 1)
SYNC_STEPS=${SYNC_STEPS:-4}                  # fully_async: trigger_parameter_sync_step
TOTAL_STEPS=${TOTAL_STEPS:-200}
PROJECT=${PROJECT:-stalerl-m2po}
NAME=${NAME:-m2po-${MODE}-tau${TAU}}
LOGGER=${LOGGER:-"['console']"}

common=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$TRAIN_FILES"
    data.val_files="$VAL_FILES"
    data.max_prompt_length="$MAX_PROMPT"
    data.max_response_length="$MAX_RESPONSE"
    actor_rollout_ref.model.path="$MODEL"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BS"
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$MICRO_BS"
    actor_rollout_ref.actor.use_dynamic_bsz=False
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=1
    actor_rollout_ref.rollout.name="$ROLLOUT_ENGINE"
    actor_rollout_ref.rollout.n="$N"
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$MICRO_BS"
    actor_rollout_ref.rollout.checkpoint_engine.backend=nccl
    algorithm.rollout_correction.bypass_mode=True
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node="$TRAIN_GPUS"
    trainer.project_name="$PROJECT"
    trainer.experiment_name="$NAME"
    trainer.logger="$LOGGER"
    trainer.val_before_train=False
    trainer.test_freq=10
    trainer.save_freq=-1
)

extra=()
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    extra+=(--cfg job)
fi

case "$MODE" in
separate_async)
    python3 -m verl.trainer.main_ppo \
        --config-path "$(stalerl-verl-config-path)" --config-name m2po_trainer \
        "${common[@]}" \
        actor_rollout_ref.actor.policy_loss.m2_threshold="$TAU" \
        actor_rollout_ref.actor.policy_loss.m2_scope="$SCOPE" \
        data.train_batch_size="$TRAIN_BS" \
        actor_rollout_ref.hybrid_engine=False \
        actor_rollout_ref.rollout.nnodes="$NNODES" \
        actor_rollout_ref.rollout.n_gpus_per_node="$ROLLOUT_GPUS" \
        trainer.v1.trainer_mode=separate_async \
        trainer.v1.separate_async.parameter_sync_step=$(( TRAIN_BS / MINI_BS )) \
        trainer.v1.sampler.max_off_policy_threshold="$MAX_STALENESS" \
        trainer.v1.sampler.max_off_policy_strategy=drop \
        trainer.total_training_steps="$TOTAL_STEPS" \
        "${extra[@]}" "$@"
    ;;
fully_async)
    python3 -m verl.experimental.fully_async_policy.fully_async_main \
        "${common[@]}" \
        actor_rollout_ref.actor.policy_loss._target_=recipe.verl.config.M2POPolicyLossConfig \
        actor_rollout_ref.actor.policy_loss.loss_mode=m2po \
        +actor_rollout_ref.actor.policy_loss.m2_threshold="$TAU" \
        +actor_rollout_ref.actor.policy_loss.m2_scope="$SCOPE" \
        data.train_batch_size=0 \
        data.gen_batch_size=1 \
        actor_rollout_ref.hybrid_engine=False \
        rollout.nnodes="$NNODES" \
        rollout.n_gpus_per_node="$ROLLOUT_GPUS" \
        rollout.n="$N" \
        rollout.total_rollout_steps=$(( TOTAL_STEPS * SYNC_STEPS * MINI_BS )) \
        async_training.staleness_threshold="$STALENESS_RATIO" \
        async_training.trigger_parameter_sync_step="$SYNC_STEPS" \
        async_training.require_batches=1 \
        async_training.partial_rollout=True \
        "${extra[@]}" "$@"
    ;;
*)
    echo "MODE must be separate_async or fully_async, got '$MODE'" >&2
    exit 2
    ;;
esac
