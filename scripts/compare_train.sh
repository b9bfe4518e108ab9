#!/usr/bin/env bash
# Training benchmark, side by side: spmd_runtime (scripts/bench_train.py under
# "$MPIEXEC -n $NPROC"), PyTorch baselines (scripts/torch_baselines.py) and JAX/XLA
# GSPMD baselines (scripts/jax_baselines.py) on the same model and config. Prints
# each run's JSON line, a table and the ratios.
#
#   scripts/compare_train.sh [--ours-only | --torch-only | --jax-only | --no-jax] [CONFIG FLAGS...]
#
# CONFIG FLAGS go to every side unchanged (bench_train.py, torch_baselines.py and
# jax_baselines.py take the same --layers --d --heads --ffn --vocab --seq --batch --steps), e.g.
#   scripts/compare_train.sh --steps 10
#   scripts/compare_train.sh --layers 4 --d 512 --heads 8 --ffn 2048 --steps 5
#
# PyTorch and JAX are NOT dependencies of this project and this script is not part
# of scripts/test.sh: asking for the comparison creates separate venvs, a CPU-only
# torch at $TORCH_VENV and a CPU jax at $JAX_VENV, the first time, and never
# touches the project's .venv.
#
# Knobs (environment):
#   ROUNDS=1              rounds of every run, interleaved (ours, torch, jax, ours, ...); the table shows
#                         every round and the minimum per run, the ratios use the minima
#   NPROC=2               MPI ranks for ours; threads of the "eager" run; torchrun ranks
#   OURS_PRESETS="megatron dp"  bench_train.py --preset of each of our runs, in order
#                         (megatron = tensor parallel, like the DTensor run; dp = data parallel)
#   OURS_ARGS=""          extra flags for bench_train.py only (e.g. "--embedding onehot")
#   TORCH_VENV=/tmp/torchvenv   venv for PyTorch (created if it cannot import torch)
#   TORCH_VERSION=2.13.0  torch release to install there (CPU build)
#   TORCH_PIP_ARGS=""     replace the install arguments entirely (e.g. a wheel path)
#   TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu  used only when no local
#                         "+cpu" wheel is in pip's find-links, so pip never pulls
#                         the CUDA build of torch
#   TORCH_RUNS="eager eager1 dtensor sdpa"   which PyTorch runs, in order, from:
#       eager         1 process, NPROC threads, manual attention
#       eager1        1 process, 1 thread, manual attention
#       dtensor       torchrun NPROC ranks x 1 thread, tensor parallel (TORCH_TP_PLAN)
#       sdpa          as eager, F.scaled_dot_product_attention
#       dtensor_sdpa  as dtensor, F.scaled_dot_product_attention
#       dtensor_vocab as dtensor with --tp-plan vocab (embedding/output vocab-split too)
#   TORCH_TP_PLAN=plain   --tp-plan of the dtensor runs (plain | shared-input | vocab)
#   JAX_VENV=/tmp/jaxvenv venv for JAX (created with "pip install jax numpy" if it cannot import jax)
#   JAX_PIP_ARGS=""       replace the install arguments entirely
#   JAX_RUNS="dp tp"      which JAX runs (scripts/jax_baselines.py --mode), in order, from:
#       dp            NPROC host devices, data parallel (compared with our dp preset)
#       tp            NPROC host devices, Megatron tensor parallel (compared with our megatron preset)
#       single        1 device
#   plus those of scripts/setup_env.sh for our side (SPMD_VENV, MPIEXEC, ...).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

NPROC="${NPROC:-2}"
TORCH_VENV="${TORCH_VENV:-/tmp/torchvenv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
TORCH_RUNS="${TORCH_RUNS:-eager eager1 dtensor sdpa}"
TORCH_TP_PLAN="${TORCH_TP_PLAN:-plain}"
JAX_VENV="${JAX_VENV:-/tmp/jaxvenv}"
JAX_RUNS="${JAX_RUNS:-dp tp}"
ROUNDS="${ROUNDS:-1}"

do_ours=1 do_torch=1 do_jax=1
case "${1:-}" in
    --ours-only) do_torch=0; do_jax=0; shift ;;
    --torch-only) do_ours=0; do_jax=0; shift ;;
    --jax-only) do_ours=0; do_torch=0; shift ;;
    --no-jax) do_jax=0; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
CONFIG=("$@")

RESULTS="$(mktemp -d "${TMPDIR:-/tmp}/compare_train.XXXXXX")"
trap 'rm -rf "$RESULTS"' EXIT
FAILURES=()
log() { printf '[compare_train] %s\n' "$*" >&2; }

# The last line of a run's stdout that looks like a JSON object.
json_line() { grep '^{' "$1" 2>/dev/null | tail -n 1 || true; }

# record NAME CMD...: runs CMD, keeps its stdout in $RESULTS/NAME.out and its
# JSON line in $RESULTS/NAME.json; stderr goes to $RESULTS/NAME.err (tail shown on failure).
record() {
    local name="$1" rc=0 shown
    shift
    shown="${RECORD_CMD:-$*}"
    log "run $name: $shown"
    "$@" >"$RESULTS/$name.out" 2>"$RESULTS/$name.err" || rc=$?
    json_line "$RESULTS/$name.out" >"$RESULTS/$name.json"
    if [[ $rc -ne 0 || ! -s "$RESULTS/$name.json" ]]; then
        FAILURES+=("$name (exit $rc)")
        log "$name failed (exit $rc); last lines of its stderr:"
        tail -n 15 "$RESULTS/$name.err" >&2 || true
    fi
    printf '%s\n' "$shown" >"$RESULTS/$name.cmd"
    return 0
}

# ---------------------------------------------------------------- our side
ours_ready=0
if [[ $do_ours -eq 1 ]]; then
    if [[ ! -f scripts/setup_env.sh ]]; then
        log "scripts/setup_env.sh not found: skipping spmd_runtime's side"
    elif [[ ! -f scripts/bench_train.py ]]; then
        log "scripts/bench_train.py not found (not written yet?): skipping spmd_runtime's side"
    else
        ours_ready=1
        read -r -a OURS_EXTRA <<<"${OURS_ARGS:-}"
    fi
fi
ours() {  # ours PRESET
    # A subshell: setup_env.sh activates .venv and exports OMP_NUM_THREADS=1 and
    # friends, none of which must leak into the PyTorch or JAX runs.
    (
        # shellcheck source=scripts/setup_env.sh
        source scripts/setup_env.sh
        read -r -a mpi <<<"$MPIEXEC"
        read -r -a oversub <<<"${SPMD_OVERSUBSCRIBE:-}"
        exec "${mpi[@]}" ${oversub[@]+"${oversub[@]}"} -n "$NPROC" python scripts/bench_train.py \
            --preset "$1" ${CONFIG[@]+"${CONFIG[@]}"} ${OURS_EXTRA[@]+"${OURS_EXTRA[@]}"}
    )
}
run_ours() {  # run_ours ROUND_SUFFIX
    local preset shown
    for preset in ${OURS_PRESETS:-megatron dp}; do
        shown="source scripts/setup_env.sh && \$MPIEXEC -n $NPROC python scripts/bench_train.py"
        shown+=" --preset $preset${CONFIG[*]:+ ${CONFIG[*]}}${OURS_ARGS:+ $OURS_ARGS}"
        RECORD_CMD="$shown" record "ours_$preset$1" ours "$preset"
    done
}

# ---------------------------------------------------------------- PyTorch side
local_cpu_wheel() {  # is a torch-$TORCH_VERSION+cpu wheel in one of pip's find-links folders?
    local d dirs
    dirs="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
    for d in $dirs; do
        d="${d#file://}"
        compgen -G "$d/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null && return 0
    done
    return 1
}

ensure_torch_venv() {
    if "$TORCH_VENV/bin/python" -c 'import torch, numpy' >/dev/null 2>&1; then
        return 0
    fi
    log "creating the PyTorch venv $TORCH_VENV (separate from the project's .venv)"
    python3 -m venv "$TORCH_VENV" >&2 || return 1
    local pip=("$TORCH_VENV/bin/python" -m pip install)
    if [[ -n "${TORCH_PIP_ARGS:-}" ]]; then
        read -r -a extra <<<"$TORCH_PIP_ARGS"
        "${pip[@]}" "${extra[@]}" >&2 || return 1
    elif local_cpu_wheel; then
        # pip ranks 2.13.0+cpu above a plain 2.13.0 from an index, so the local CPU build wins.
        "${pip[@]}" "torch==$TORCH_VERSION" numpy >&2 || return 1
    else
        "${pip[@]}" numpy >&2 || return 1
        "${pip[@]}" --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION" >&2 || return 1
    fi
    "$TORCH_VENV/bin/python" -c 'import torch; print("[compare_train] installed torch", torch.__version__,
        "(CUDA build!)" if torch.version.cuda else "(CPU build)")' >&2
}

# torchrun's own parser takes "--d" after the script name for an ambiguous prefix
# of its --duplicate-* options: spell it --dim (torch_baselines.py's alias).
TORCHRUN_CONFIG=()
for a in ${CONFIG[@]+"${CONFIG[@]}"}; do
    case "$a" in
        --d) TORCHRUN_CONFIG+=(--dim) ;;
        --d=*) TORCHRUN_CONFIG+=("--dim=${a#--d=}") ;;
        *) TORCHRUN_CONFIG+=("$a") ;;
    esac
done

torch_ready=0
if [[ $do_torch -eq 1 ]]; then
    if ensure_torch_venv; then
        torch_ready=1
    else
        FAILURES+=("PyTorch venv setup ($TORCH_VENV)")
        log "could not set up $TORCH_VENV: skipping the PyTorch runs"
    fi
fi
run_torch() {  # run_torch ROUND_SUFFIX
    local PY="$TORCH_VENV/bin/python" TB=scripts/torch_baselines.py run r="$1"
    local TR=("$TORCH_VENV/bin/torchrun" --standalone --nproc_per_node "$NPROC")
    for run in $TORCH_RUNS; do
        case "$run" in
            eager) record "torch_eager$r" "$PY" "$TB" --mode eager --threads "$NPROC" ${CONFIG[@]+"${CONFIG[@]}"} ;;
            eager1) record "torch_eager1$r" "$PY" "$TB" --mode eager --threads 1 ${CONFIG[@]+"${CONFIG[@]}"} ;;
            sdpa) record "torch_sdpa$r" "$PY" "$TB" --mode eager --threads "$NPROC" --attn sdpa \
                ${CONFIG[@]+"${CONFIG[@]}"} ;;
            dtensor) record "torch_dtensor$r" "${TR[@]}" "$TB" --mode dtensor --threads 1 --tp-plan "$TORCH_TP_PLAN" \
                ${TORCHRUN_CONFIG[@]+"${TORCHRUN_CONFIG[@]}"} ;;
            dtensor_sdpa) record "torch_dtensor_sdpa$r" "${TR[@]}" "$TB" --mode dtensor --threads 1 --attn sdpa \
                --tp-plan "$TORCH_TP_PLAN" ${TORCHRUN_CONFIG[@]+"${TORCHRUN_CONFIG[@]}"} ;;
            dtensor_vocab) record "torch_dtensor_vocab$r" "${TR[@]}" "$TB" --mode dtensor --threads 1 --tp-plan vocab \
                ${TORCHRUN_CONFIG[@]+"${TORCHRUN_CONFIG[@]}"} ;;
            *) log "unknown TORCH_RUNS entry '$run' (skipped)"; FAILURES+=("unknown run $run") ;;
        esac
    done
}

# ---------------------------------------------------------------- JAX side
ensure_jax_venv() {
    if "$JAX_VENV/bin/python" -c 'import jax, numpy' >/dev/null 2>&1; then
        return 0
    fi
    log "creating the JAX venv $JAX_VENV (separate from the project's .venv)"
    python3 -m venv "$JAX_VENV" >&2 || return 1
    local args=(jax numpy)
    [[ -n "${JAX_PIP_ARGS:-}" ]] && read -r -a args <<<"$JAX_PIP_ARGS"
    "$JAX_VENV/bin/python" -m pip install "${args[@]}" >&2 || return 1
    "$JAX_VENV/bin/python" -c 'import jax; print("[compare_train] installed jax", jax.__version__, jax.devices())' >&2
}

jax_ready=0
if [[ $do_jax -eq 1 ]]; then
    if ensure_jax_venv; then
        jax_ready=1
    else
        FAILURES+=("JAX venv setup ($JAX_VENV)")
        log "could not set up $JAX_VENV: skipping the JAX runs"
    fi
fi
run_jax() {  # run_jax ROUND_SUFFIX
    local run
    for run in $JAX_RUNS; do
        case "$run" in
            dp | tp | single) record "jax_$run$1" "$JAX_VENV/bin/python" scripts/jax_baselines.py --mode "$run" \
                --devices "$NPROC" ${CONFIG[@]+"${CONFIG[@]}"} ;;
            *) log "unknown JAX_RUNS entry '$run' (skipped)"; FAILURES+=("unknown run $run") ;;
        esac
    done
}

# ---------------------------------------------------------------- the rounds, interleaved
for ((round = 1; round <= ROUNDS; round++)); do
    suffix=""
    [[ $ROUNDS -gt 1 ]] && suffix=".r$round"
    [[ $ours_ready -eq 1 ]] && run_ours "$suffix"
    [[ $torch_ready -eq 1 ]] && run_torch "$suffix"
    [[ $jax_ready -eq 1 ]] && run_jax "$suffix"
done

# ---------------------------------------------------------------- report
echo
echo "== JSON lines"
for f in "$RESULTS"/*.json; do
    [[ -e "$f" ]] || continue
    name="$(basename "$f" .json)"
    printf '# %s\n' "$(cat "$RESULTS/$name.cmd")"
    printf '%s: %s\n' "$name" "$(cat "$f")"
done
echo
python3 - "$RESULTS" "$NPROC" <<'PY'
import glob, json, os, re, sys

results, nproc = sys.argv[1], sys.argv[2]
TORCH = ["torch_eager", "torch_eager1", "torch_sdpa", "torch_dtensor", "torch_dtensor_sdpa", "torch_dtensor_vocab"]
JAX = ["jax_dp", "jax_tp", "jax_single"]
LABEL = {"torch_eager": f"torch eager {nproc} threads", "torch_eager1": "torch eager 1 thread",
         "torch_sdpa": f"torch eager+SDPA {nproc} threads", "torch_dtensor": f"torch DTensor TP {nproc}x1",
         "torch_dtensor_sdpa": f"torch DTensor TP+SDPA {nproc}x1",
         "torch_dtensor_vocab": f"torch DTensor TP+vocab {nproc}x1",
         "jax_dp": f"JAX/XLA GSPMD dp {nproc} dev", "jax_tp": f"JAX/XLA GSPMD tp {nproc} dev",
         "jax_single": "JAX/XLA 1 device"}


def label(n):
    return LABEL.get(n) or (f"spmd_runtime {n[5:]} -n {nproc}" if n.startswith("ours_") else n)


def number(v):
    if isinstance(v, list):  # per-rank figures: the largest
        v = max((x for x in v if isinstance(x, (int, float))), default=None)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def pick(d, exact, *need):
    """d[k] for the first k in exact, else for the first key holding every word in need."""
    for k in exact:
        if number(d.get(k)) is not None:
            return number(d[k])
    for k, v in d.items():
        if all(w in k.lower() for w in need) and number(v) is not None:
            return number(v)
    return None


rounds = {}  # run name -> [(round, JSON dict)]
for f in glob.glob(os.path.join(results, "*.json")):
    name, _, rnd = os.path.basename(f)[:-5].partition(".r")
    text = open(f).read().strip()
    try:
        d = json.loads(text) if text else {"error": "no JSON line (see the log above)"}
    except ValueError as e:
        d = {"error": f"unparsable JSON line: {e}"}
    rounds.setdefault(name, []).append((int(rnd or 1), d))

ours_names = sorted(n for n in rounds if n.startswith("ours_"))
names = ours_names + [n for n in TORCH + JAX if n in rounds]
names += sorted(n for n in rounds if n not in names)
if not names:
    print("nothing ran")
    sys.exit(0)


def fmt(v, scale=1.0, digits=4):
    return "-" if v is None else f"{v * scale:.{digits}g}"


print(f"{'run':34} {'round':>5} {'step_s':>9} {'tokens/s':>9} {'wire_MB/step':>12} {'peak_RSS_MB':>11} {'load1':>6}")
step = {}  # run -> minimum over rounds of its median step
for n in names:
    for rnd, d in sorted(rounds[n], key=lambda x: x[0]):
        s = pick(d, ["median_step_s", "median_step_seconds", "step_s_median"], "median")
        if s is not None:
            step[n] = min(step.get(n, s), s)
        tps = pick(d, ["tokens_per_s", "tokens_per_second"], "tok")
        wire = pick(d, ["wire_bytes_per_step", "wire_bytes"], "wire")
        rss = pick(d, ["peak_rss_bytes", "max_rss_bytes_per_rank", "max_rss_bytes"], "rss")
        load = d.get("loadavg_start") or d.get("loadavg")
        load1 = load[0] if isinstance(load, (list, tuple)) and load else None
        err = f"  ERROR: {d['error']}" if d.get("error") else ""
        print(f"{label(n):34} {rnd:>5} {fmt(s):>9} {fmt(tps, digits=5):>9} {fmt(wire, 1e-6):>12} "
              f"{fmt(rss, 1 / 2**20, 5):>11} {fmt(load1, digits=3):>6}{err}")
print()
print(f"{'run':34} {'min step_s over ' + str(max(len(v) for v in rounds.values())) + ' round(s)':>26}")
for n in names:
    print(f"{label(n):34} {fmt(step.get(n)):>26}")

# Like for like: our tensor-parallel presets against DTensor TP and JAX tp, data parallel against JAX dp and
# eager on all cores; then the best of ours against the best of each.
parts = []
for n in ours_names:
    refs = ["torch_dtensor", "jax_tp"] if "megatron" in n else ["torch_eager", "jax_dp"] if "dp" in n else \
        ["torch_eager"]
    parts += [f"{label(n)} / {label(r)} = {step[n] / step[r]:.2f}x" for r in refs if step.get(n) and step.get(r)]
best_ours = min((step[n], n) for n in ours_names if step.get(n)) if any(step.get(n) for n in ours_names) else None
for prefix, what in (("torch_", "torch"), ("jax_", "JAX")):
    theirs = [(step[n], n) for n in names if n.startswith(prefix) and step.get(n)]
    if best_ours and theirs:
        bt = min(theirs)
        parts.append(f"best ours ({label(best_ours[1])}) / best {what} ({label(bt[1])}) = {best_ours[0] / bt[0]:.2f}x")
if parts:
    print("ratios of the minimum median step times (>1 = spmd_runtime slower):")
    for p in parts:
        print("  " + p)
else:
    print("ratio: n/a (" + ("no spmd_runtime figure" if not best_ours else "no baseline figure") + ")")

# Paired by round: within a round the runs go back to back, so the machine's drift between rounds (10-30 %
# here) cancels in each round's ratio; the median over rounds is the like-for-like figure beside the minima.
per_round = {n: {rnd: pick(d, ["median_step_s", "median_step_seconds", "step_s_median"], "median")
                 for rnd, d in rounds[n]} for n in names}
for ref, ours in (("torch_eager", ours_names), ("torch_dtensor", [n for n in ours_names if "megatron" in n])):
    common = sorted(r for r in per_round.get(ref, {}) if per_round[ref][r] and
                    any(per_round[n].get(r) for n in ours))
    if len(common) > 1:
        ratios = [min(per_round[n][r] for n in ours if per_round[n].get(r)) / per_round[ref][r] for r in common]
        median = sorted(ratios)[len(ratios) // 2] if len(ratios) % 2 else \
            sum(sorted(ratios)[len(ratios) // 2 - 1:len(ratios) // 2 + 1]) / 2
        print(f"paired by round: best ours / {label(ref)} = " + " ".join(f"{x:.3f}" for x in ratios) +
              f"; median {median:.3f}x")
PY

if [[ ${#FAILURES[@]} -gt 0 ]]; then
    log "failed: ${FAILURES[*]}"
    exit 1
fi
