#!/usr/bin/env bash
# The main job on 8 ranks: a Megatron-sharded Transformer block forward pass (scripts/demo_transformer.py),
# then training a Transformer LM with Megatron + weight-update sharding (scripts/demo_train.py, which gets
# the extra arguments: scripts/demo.sh --steps 100), then a short GShard mixture-of-experts LM run (experts
# on "data", one all-to-all each way per MoE block) whose checkpoint reloads under moe_megatron on 2x4, then GPT-2
# from the model zoo (scripts/demo_gpt2.py, 2 ranks: token files, fit with a cosine schedule, clipping, evaluation and
# a checkpoint, then greedy decoding with a KV cache).
# (SPMD_DEMO_RANKS overrides the rank count; see scripts/setup_env.sh for the
# environment knobs.) Relative paths in the arguments are taken from the
# directory you run it from.
set -euo pipefail
# shellcheck source=scripts/setup_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
read -r -a MPIEXEC_CMD <<<"$MPIEXEC"
read -r -a OVERSUB <<<"${SPMD_OVERSUBSCRIBE:-}"
run_ranks() {
    "${MPIEXEC_CMD[@]}" ${OVERSUB[@]+"${OVERSUB[@]}"} -n "${SPMD_DEMO_RANKS:-8}" python "$@"
}
echo "=== 1/4: Transformer block forward, Megatron on a 2x4 mesh"
run_ranks "$SPMD_ROOT/scripts/demo_transformer.py" --out "$SPMD_ROOT/out"
echo
echo "=== 2/4: training a Transformer LM, Megatron + weight-update sharding on a 2x4 mesh"
run_ranks "$SPMD_ROOT/scripts/demo_train.py" "$@"
echo
echo "=== 3/4: training a mixture-of-experts LM (GShard: 8 experts on data, top-2 gating) on a 4x2 mesh"
run_ranks "$SPMD_ROOT/scripts/demo_train.py" --mesh 4,2 --preset moe --experts 8 --capacity-factor 1.25 --steps 60 \
    --log-every 10 --check-steps 10 --reload-mesh 2,4 --reload-preset moe_megatron --out "$SPMD_ROOT/out/moe"
echo
echo "=== 4/4: GPT-2 from the model zoo (models/gpt2.py as a train.Model), megatron on a 1x2 mesh"
"${MPIEXEC_CMD[@]}" ${OVERSUB[@]+"${OVERSUB[@]}"} -n 2 python "$SPMD_ROOT/scripts/demo_gpt2.py" --out "$SPMD_ROOT/out/gpt2"
