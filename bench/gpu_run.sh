#!/usr/bin/env bash
# The staged GPU check for a bare CUDA machine: PyTorch, transformers and pytest in the
# image's python3, no network. From the repository root:
#
#     bash bench/gpu_run.sh              # every stage, one run (<= 10 minutes)
#     bash bench/gpu_run.sh --part=1     # env, torch-tests, hazards          (no FlashInfer)
#     bash bench/gpu_run.sh --part=2     # env, fi-install, flashinfer, gpu-check
#     bash bench/gpu_run.sh --dry-run    # walk every stage's setup; print the plan and budget
#                                        # (--no-collect: without collecting the tests)
#
# Stages, each under its own timeout, each ending in one summary line:
#   env         GPU, driver, torch/CUDA, nvcc and ninja (FlashInfer's JIT needs both), wheels
#   torch-tests PyTorch-only GPU tests: CUDA graphs vs eager (SDPA), CUDA vs CPU, the MTP
#               device chain under sync-debug "error"
#   hazards     capture while another thread polls events; 32 pipelined steps over
#               alternating shapes vs eager
#   fi-install  FlashInfer + apache-tvm-ffi from the wheels in .gpu/wheels (pip --no-index
#               --no-deps); a wheel may come split into parts NAME.whl.part-* (split -b),
#               joined here in name order and checked as a zip before installing
#   flashinfer  FlashInfer at head_dim 64: ragged (eager and graphs), paged causal, paged
#               custom-mask tree (FA2 wrappers), pipelined steps, plan-twice-run-once
#   gpu-check   python -m bench gpu_check: FlashInfer/graphs vs SDPA (cos >= 0.999, bf16),
#               latency table (batch 1 at 128/512/4096 tokens, graphs on vs off), decoder
#
# Two parts exist because a wheel of FlashInfer (~100 MB) may not travel with the first run:
# part 1 needs none, part 2 installs it (wheels placed in .gpu/wheels meanwhile; parts of a
# split wheel may arrive over both runs). FlashInfer's JIT cache lives in .gpu/jit, so a
# second run on the same machine compiles nothing again. Results: one folder, $GPU_RESULTS,
# else $OUT/gpu-run when $OUT is set, else .gpu/results/<time>: a log per stage and
# summary.txt. Exit status: 0 when no stage failed or timed out (skipped stages say why).
set -u -o pipefail

dry=0
collect=1 # dry run: collect each pytest stage's selection
part=all
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry=1 ;;
        --no-collect) collect=0 ;;
        --part=1 | --part=2 | --part=all) part="${arg#--part=}" ;;
        -h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_run: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 2
py="${PYTHON:-python3}"
# A checkout set up by `make install` on a machine whose python3 has no PyTorch (a CPU box
# walking the dry run): use the project's environment. The GPU image's python3 has PyTorch,
# so there nothing changes; PYTHON always wins.
# (Cheap tests first: without a .venv, as on the GPU machine, torch is never imported here.)
if [ -z "${PYTHON:-}" ] && [ -x "$root/.venv/bin/python" ] && ! python3 -c 'import torch' > /dev/null 2>&1; then
    py="$root/.venv/bin/python"
fi
wheels="${GPU_WHEELS:-$root/.gpu/wheels}"
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$root/.gpu/jit}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
total_budget="${GPU_RUN_BUDGET:-600}" # seconds for the whole run

# name | seconds | what it proves
stages_all="env torch-tests hazards fi-install flashinfer gpu-check"
stages_1="env torch-tests hazards"
stages_2="env fi-install flashinfer gpu-check"
declare -A budget=([env]=30 [torch-tests]=110 [hazards]=60 [fi-install]=40 [flashinfer]=200 [gpu-check]=150)
declare -A proves=(
    [env]="the machine: GPU, torch+CUDA, JIT toolchain, wheels present"
    [torch-tests]="CUDA graphs replay = eager, CUDA = CPU, device chain never syncs"
    [hazards]="thread_local capture under event polling; pipelined steps = eager"
    [fi-install]="FlashInfer imports from local wheels (no network)"
    [flashinfer]="FlashInfer (head_dim 64) = SDPA: ragged, paged causal, tree masks, graphs"
    [gpu-check]="FlashInfer/graphs = SDPA (cos >= 0.999), latency table, decoder"
)
case "$part" in
    1) stages="$stages_1" ;;
    2) stages="$stages_2"; budget[flashinfer]=330 ;; # room for FlashInfer's first JIT builds
    *) stages="$stages_all" ;;
esac

pytest_cmd=("$py" -m pytest -q -rs -p no:cacheprovider)
fi_tests=(
    "tests/test_rose_gpu.py::test_cuda_graph_replay_matches_eager[flashinfer]"
    tests/test_paged_attention.py::test_flashinfer_paged_kernel_matches_sdpa_on_cuda
    "tests/test_gpu_hazards.py::test_cuda_32_pipelined_steps_over_alternating_shapes_match_eager[flashinfer]"
    tests/test_gpu_hazards.py::test_cuda_wrapper_planned_twice_while_the_stream_is_busy
    tests/test_rose_qwen3.py::test_cuda_flashinfer_agrees_with_sdpa
)

# The command of each stage (an array named cmd_<stage>; "-" for a shell function).
cmd_env=(-)
cmd_torch_tests=("${pytest_cmd[@]}" tests/test_rose_gpu.py -k "not flashinfer")
cmd_hazards=("${pytest_cmd[@]}" -s tests/test_gpu_hazards.py -k "cuda and not flashinfer and not planned_twice")
cmd_fi_install=(-)
cmd_flashinfer=("${pytest_cmd[@]}" -s "${fi_tests[@]}")
cmd_gpu_check=("$py" -m bench gpu_check --iters=20)

# Wheels: every *.whl in $wheels, after joining NAME.whl.part-* into NAME.whl (into $1).
join_wheels() {
    local into="$1" first whl
    mkdir -p "$into"
    for first in "$wheels"/*.whl.part-*; do
        [ -e "$first" ] || break
        whl="$(basename "${first%.part-*}")"
        [ -e "$into/$whl" ] && continue
        echo "join $(ls "$wheels/$whl".part-* | wc -l) parts -> $whl"
        cat "$wheels/$whl".part-* >"$into/$whl.tmp" || return 1
        "$py" -c 'import sys, zipfile; bad = zipfile.ZipFile(sys.argv[1]).testzip(); sys.exit(bad and f"corrupt member {bad}")' \
            "$into/$whl.tmp" || { echo "parts of $whl do not make a whole wheel (one missing?)"; return 1; }
        mv "$into/$whl.tmp" "$into/$whl"
    done
}

list_wheels() { ls "$1"/*.whl "$wheels"/*.whl 2>/dev/null | sort -u; }

stage_env() {
    "$py" - <<'EOF'
import importlib, os, platform, shutil, sys
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"sm{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
print("nvcc", shutil.which("nvcc") or os.environ.get("CUDA_HOME") or "absent (FlashInfer JIT needs it)")
print("ninja", shutil.which("ninja") or "absent (FlashInfer JIT needs it)")
print("FLASHINFER_WORKSPACE_BASE", os.environ.get("FLASHINFER_WORKSPACE_BASE"))
for name in ("transformers", "pytest", "numpy", "flashinfer", "tvm_ffi"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(name, "does not import:", type(exc).__name__, str(exc)[:120])
sys.exit(0 if torch.cuda.is_available() else 3)
EOF
    local rc=$?
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>/dev/null
    echo "wheels in $wheels:"; ls -l "$wheels" 2>/dev/null || echo "  (none)"
    [ $rc -eq 3 ] && echo "no CUDA device: every later stage would skip"
    return $rc
}

stage_fi_install() {
    if "$py" -c "import flashinfer" 2>/dev/null; then
        echo "flashinfer already imports: $("$py" -c 'import flashinfer; print(flashinfer.__version__)')"
        return 0
    fi
    join_wheels "$wheels" || return 1
    local found
    found="$(list_wheels "$wheels")"
    if [ -z "$found" ]; then
        echo "SKIP no wheels in $wheels (place flashinfer_python-*.whl and apache_tvm_ffi-*.whl there)"
        return 0
    fi
    echo "$found"
    # shellcheck disable=SC2086
    "$py" -m pip install --no-index --no-deps --disable-pip-version-check $found || return 1
    "$py" -c "import flashinfer; print('flashinfer', flashinfer.__version__, 'imports')"
}

# A finished stage's status: "ok", with pytest's counts; "skipped (why)" when it skipped
# itself or every test it selected skipped (a GPU check never passes by skipping).
stage_status() {
    local log="$1" counts
    if grep -q '^SKIP ' "$log"; then
        echo "skipped ($(grep -m1 '^SKIP ' "$log" | cut -c6-))"
        return
    fi
    counts="$(grep -E '^=* ?[0-9]+ (passed|skipped|deselected)' "$log" | tail -1 | sed -E 's/=+//g; s/ in [0-9.]+s.*//; s/^ +//')"
    if [ -n "$counts" ] && ! grep -q ' passed' <<<"$counts"; then
        echo "skipped (every test skipped: $(grep -m1 '^SKIPPED' "$log" | sed 's/^SKIPPED \[[0-9]*\] //'))"
    else
        echo "ok${counts:+ ($counts)}"
    fi
}

# One stage: run it under its timeout (capped by what is left of the whole budget), log it,
# print and record one summary line.
started=$SECONDS
failed=0
run_stage() {
    local name="$1" var="cmd_${1//-/_}" t="${budget[$1]}" left status begin rc log
    left=$((total_budget - (SECONDS - started)))
    ((t > left)) && t=$left
    log="$results/$(printf '%02d' "$index")-$name.log"
    if ((t < 5)); then
        status="skipped (no time left of the ${total_budget}s budget)"
    elif [ "$name" = flashinfer ] && ! "$py" -c "import flashinfer" >/dev/null 2>&1; then
        status="skipped (FlashInfer does not import: run fi-install with its wheels first)"
    else
        begin=$SECONDS
        local -n cmd="$var"
        if [ "${cmd[0]}" = - ]; then
            export -f "stage_${name//-/_}" join_wheels list_wheels
            export py wheels
            timeout --kill-after=10 "$t" bash -c "stage_${name//-/_}" >"$log" 2>&1
        else
            timeout --kill-after=10 "$t" "${cmd[@]}" >"$log" 2>&1
        fi
        rc=$?
        case $rc in
            0) status="$(stage_status "$log")" ;;
            124 | 137) status="TIMEOUT after ${t}s"; failed=1 ;;
            *) status="FAIL (exit $rc)"; failed=1 ;;
        esac
        status="$status in $((SECONDS - begin))s"
        tail -n 25 "$log" | sed "s/^/  [$name] /"
    fi
    printf 'stage %-11s %s (budget %ss): %s\n' "$name" "$status" "$t" "${proves[$name]}" |
        tee -a "$results/summary.txt"
}

results_dir() { # $1: the run's time stamp
    local dir="${GPU_RESULTS:-${OUT:+$OUT/gpu-run}}"
    echo "${dir:-$root/.gpu/results/$1}"
}

plan_total=0
for s in $stages; do plan_total=$((plan_total + budget[$s])); done

if ((dry)); then
    echo "gpu_run dry run: part $part, python $py, budget ${plan_total}s of ${total_budget}s"
    ((plan_total > total_budget)) && { echo "stage budgets exceed the run's ${total_budget}s"; exit 1; }
    echo "results -> $(results_dir '<time>')"
    echo "wheels <- $wheels; FlashInfer JIT cache -> $FLASHINFER_WORKSPACE_BASE"
    command -v "$py" >/dev/null || { echo "python $py not found"; exit 1; }
    index=0
    for s in $stages; do
        index=$((index + 1))
        var="cmd_${s//-/_}[@]"
        cmd=("${!var}")
        if [ "${cmd[0]}" = - ]; then shown="(shell function stage_${s//-/_})"; else shown="$(printf '%q ' "${cmd[@]}")"; fi
        printf 'plan %d %-11s %4ss  %s\n     proves: %s\n' "$index" "$s" "${budget[$s]}" "$shown" "${proves[$s]}"
        if [ "${cmd[2]:-}" = bench ]; then
            "$py" -c "import bench.${cmd[3]}" || { echo "gpu_run dry run: bench ${cmd[3]} does not import"; exit 1; }
            echo "     imports: bench.${cmd[3]}"
        fi
        if ((collect)) && [ "${cmd[2]:-}" = pytest ]; then  # the selection collects (names, -k)
            got="$("${cmd[@]}" --collect-only 2>&1 | grep -E '^[0-9]+ tests? collected|^[0-9]+/[0-9]+ tests? collected|no tests|ERROR' | tail -1)"
            echo "     collects: ${got:-nothing}"
            case "$got" in [0-9]*collected*) ;; *) echo "gpu_run dry run: stage $s selects no tests"; exit 1 ;; esac
        fi
        if [ "$s" = fi-install ]; then
            tmp="$(mktemp -d)"
            join_wheels "$tmp" | sed 's/^/     /' || { rm -rf "$tmp"; exit 1; }
            found="$(list_wheels "$tmp" | xargs -r -n1 basename | paste -sd ' ')"
            echo "     would install: ${found:-nothing (no wheels; the stage would skip)}"
            rm -rf "$tmp"
        fi
    done
    echo "gpu_run dry run: ok"
    exit 0
fi

results="$(results_dir "$(date +%Y%m%d-%H%M%S)")"
mkdir -p "$results" "$FLASHINFER_WORKSPACE_BASE" "$wheels"
echo "gpu_run: part $part, stages: $stages; budget ${plan_total}s of ${total_budget}s; results in $results" |
    tee "$results/summary.txt"
index=0
for s in $stages; do
    index=$((index + 1))
    run_stage "$s"
    if [ "$s" = env ] && grep -q "no CUDA device" "$results/01-env.log" 2>/dev/null; then
        echo "gpu_run: no CUDA device; stopping" | tee -a "$results/summary.txt"
        exit 1
    fi
done
echo "gpu_run: $((SECONDS - started))s, $([ $failed = 0 ] && echo 'no stage failed' || echo 'FAILED')" |
    tee -a "$results/summary.txt"
exit $failed
