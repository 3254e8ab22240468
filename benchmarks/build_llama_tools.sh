#!/usr/bin/env bash
# Build llama.cpp's own command-line tools from the exact llama.cpp that llama-cpp-python 0.3.36
# vendors, so side-by-side benchmarks compare the same kernels: llama-bench (the batch curve),
# llama-lookup / llama-speculative (llama.cpp's speculation), llama-perplexity, llama-server.
#
#   benchmarks/build_llama_tools.sh            # -> $EDGEINFER_LLAMA_TOOLS (default ~/.cache/edgeinfer-llama-tools)
#
# Idempotent: a finished build (bin/.complete) is kept. Takes 10-20 minutes on 2 busy cores.
set -euo pipefail

VERSION=0.3.36
TOOLS_DIR=${EDGEINFER_LLAMA_TOOLS:-$HOME/.cache/edgeinfer-llama-tools}
TARGETS=(llama-bench llama-lookup llama-speculative llama-perplexity llama-server llama-imatrix)
JOBS=${JOBS:-2}

if [[ -f "$TOOLS_DIR/bin/.complete" ]]; then
    echo "llama.cpp tools already built in $TOOLS_DIR/bin"
    exit 0
fi

mkdir -p "$TOOLS_DIR"
PYTHON=${PYTHON:-python3}
SDIST_DIR="$TOOLS_DIR/sdist"
if ! ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
    "$PYTHON" -m pip download --no-binary llama-cpp-python --no-deps --dest "$SDIST_DIR" "llama-cpp-python==$VERSION"
fi

SRC="$TOOLS_DIR/src"
if [[ ! -d "$SRC/llama_cpp_python-$VERSION" ]]; then
    rm -rf "$SRC.partial" && mkdir -p "$SRC.partial"
    tar -xzf "$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$SRC.partial"
    rm -rf "$SRC" && mv "$SRC.partial" "$SRC"
fi
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"

BUILD="$TOOLS_DIR/build"
# No AMX: these VMs list amx_tile/amx_int8 in /proc/cpuinfo, so -march=native compiles ggml's AMX
# matmul, but the first tile instruction dies with SIGILL (every quantized model; F16 ran). The
# llama-cpp-python library we compare with has no AMX code either.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"

mkdir -p "$TOOLS_DIR/bin"
for t in "${TARGETS[@]}"; do
    cp "$BUILD/bin/$t" "$TOOLS_DIR/bin/$t.tmp" && mv "$TOOLS_DIR/bin/$t.tmp" "$TOOLS_DIR/bin/$t"
done
# the tools link llama.cpp's shared libraries from the build tree (rpath), so keep it
touch "$TOOLS_DIR/bin/.complete"
echo "built: ${TARGETS[*]} in $TOOLS_DIR/bin"
