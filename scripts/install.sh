#!/usr/bin/env bash
# Installs the whole hvdcompress stack into the active Python interpreter, idempotently:
#   0. the plan (scripts/install_plan.py): keep the torch that is installed when its version is
#      supported (a CUDA torch is never swapped for a CPU one), NCCL for Horovod when the torch is a
#      CUDA build and a CUDA toolkit is found, TensorFlow unless HVDCOMPRESS_TENSORFLOW=0;
#   1. pinned Python dependencies (requirements/constraints.txt is the one place versions live; the
#      kept torch replaces its torch line);
#   2. Horovod 0.28.1 built from its sdist with Gloo (and NCCL per the plan), without MPI, with the
#      PyTorch and TensorFlow extensions -- the built wheel is cached in $HVDCOMPRESS_CACHE (default
#      ~/.cache/hvdcompress), so only the first install on a machine pays the ~15 minute compile;
#   3. this package, editable.
# torchrun/DDP users who need neither Horovod nor TensorFlow: pip install -e .[torch] (docs/gpu.md).
# Facts behind the Horovod recipe (checked on these machines): CMake must be 3.x (gloo's
# cmake_minimum_required is rejected by CMake 4), every C++ file must compile as C++17 (torch >= 2.1
# headers), and the build must see the installed torch/TF (no build isolation).
set -euo pipefail

PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${HVDCOMPRESS_CACHE:-$HOME/.cache/hvdcompress}
HOROVOD_VERSION=0.28.1
CONSTRAINTS="$HERE/requirements/constraints.txt"
PIP=("$PY" -m pip --disable-pip-version-check)
mkdir -p "$CACHE"

log() { printf '[install] %s\n' "$*"; }

# --- 0. the plan --------------------------------------------------------------------------------
PLANNED="$CACHE/constraints-planned.txt"
PLAN=$("$PY" "$HERE/scripts/install_plan.py" --constraints "$CONSTRAINTS" --constraints-out "$PLANNED") || {
  printf '%s\n' "$PLAN" | sed -n 's/^NOTE=/[install] /p'; exit 1; }
TORCH_ACTION=install; TORCH_PIN=; WITH_NCCL=0; WITH_TF=1; WHEEL_DIR=wheels; TORCH_CUDA=
while IFS='=' read -r key value; do
  case "$key" in
    NOTE) log "$value" ;;
    TORCH_ACTION|TORCH_PIN|TORCH_CUDA|WITH_NCCL|WITH_TF|WHEEL_DIR) printf -v "$key" '%s' "$value" ;;
  esac
done <<< "$PLAN"
CONSTRAINTS="$PLANNED"
TF_CPU_VERSION=$(sed -n 's/^tensorflow-cpu==//p' "$CONSTRAINTS")
TF_KERAS_VERSION=$(sed -n 's/^tf-keras==//p' "$CONSTRAINTS")

# --- 1. Python dependencies -------------------------------------------------------------------
if "$PY" - "$CONSTRAINTS" "$WITH_TF" <<'PYCHECK' 2>/dev/null; then
import sys, importlib.metadata as md
want = {}
for line in open(sys.argv[1]):
    line = line.split('#')[0].strip()
    if '==' in line:
        name, ver = line.split('==')
        want[name.strip()] = ver.strip()
with_tf = sys.argv[2] == "1"
for name, ver in want.items():
    if name in ("tensorflow-cpu", "tf-keras") and not with_tf:
        continue
    if md.version(name).split('+')[0] != ver.split('+')[0]:
        sys.exit(1)
for name in ("numpy", "scikit-learn", "tqdm", "matplotlib", "pytest", "cloudpickle", "psutil",
             "PyYAML", "packaging", "cffi", "wheel"):
    md.version(name)
PYCHECK
  log "pinned dependencies already installed"
else
  log "installing pinned dependencies"
  if [ "$TORCH_ACTION" = install ]; then
    # torch first and alone: 2.13.0's CPU wheel is on disk (pip's find-links); nothing later may replace it.
    "${PIP[@]}" install -c "$CONSTRAINTS" "torch==$TORCH_PIN"
  fi
  "${PIP[@]}" install -c "$CONSTRAINTS" -r "$HERE/requirements/base.txt"
  if [ "$WITH_TF" = 1 ]; then
    # tf-keras declares the full `tensorflow` as its dependency: installed without dependencies after
    # tensorflow-cpu, so one TensorFlow is installed, not two.
    "${PIP[@]}" install -c "$CONSTRAINTS" -r "$HERE/requirements/tensorflow.txt"
    "${PIP[@]}" install -c "$CONSTRAINTS" --no-deps "tf-keras==$TF_KERAS_VERSION"
  fi
fi
if [ "$WITH_TF" = 1 ] && "$PY" -c "import importlib.metadata as md; md.version('tensorflow')" 2>/dev/null; then
  # Not repaired here: both packages write the same files, and the Horovod already built compiled its
  # TensorFlow ops against whichever was written last, so a swap needs a Horovod rebuild as well.
  log "note: the full 'tensorflow' package is installed beside tensorflow-cpu (an earlier tf-keras pulled it in;"
  log "  two TensorFlow builds in one folder). To keep one: $PY -m pip uninstall -y tensorflow horovod &&"
  log "  $PY -m pip install --force-reinstall --no-deps tensorflow-cpu==$TF_CPU_VERSION &&"
  log "  rm -r $CACHE/$WHEEL_DIR && make install  (rebuilds Horovod against it, ~15 minutes)"
fi

# --- 2. Horovod ---------------------------------------------------------------------------------
horovod_ok() {
  "$PY" - "$WITH_TF" "$WITH_NCCL" <<'PYCHECK' >/dev/null 2>&1
import os, sys
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod, horovod.torch
assert horovod.__version__ == "0.28.1"
assert horovod.torch.gloo_built()
if sys.argv[1] == "1":
    import horovod.tensorflow
    assert horovod.tensorflow.gloo_built()
if sys.argv[2] == "1":
    assert horovod.torch.nccl_built()
PYCHECK
}

FRAMEWORKS=torch; BUILT=gloo
if [ "$WITH_TF" = 1 ]; then FRAMEWORKS="torch, tensorflow"; fi
if [ "$WITH_NCCL" = 1 ]; then BUILT="gloo, nccl"; fi

build_wheel() {  # builds the Horovod wheel of this plan into $CACHE/$WHEEL_DIR; sets WHEEL
  log "building horovod $HOROVOD_VERSION from source (about 15 minutes on 2 cores; cached afterwards)"
  command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake; }
  cmake_major=$(cmake --version | head -n1 | sed -E 's/[^0-9]*([0-9]+).*/\1/')
  if [ "$cmake_major" != "3" ]; then
    log "cmake on PATH is not 3.x; allowing gloo's old cmake_minimum_required"
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
  fi
  SHIM="$CACHE/cxx17"
  mkdir -p "$SHIM"
  cat > "$SHIM/g++" <<'SH'
#!/usr/bin/env bash
# Horovod 0.28.1 asks for C++11/14; torch >= 2.1 and TF 2.18 headers need C++17.
args=()
for a in "$@"; do
  case "$a" in -std=c++11|-std=c++14|-std=gnu++11|-std=gnu++14) a=-std=c++17 ;; esac
  args+=("$a")
done
exec /usr/bin/g++ "${args[@]}"
SH
  chmod +x "$SHIM/g++"
  SRC=$(mktemp -d)
  trap 'rm -rf "$SRC"' EXIT
  "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$SRC"
  mkdir -p "$CACHE/$WHEEL_DIR"
  BUILD_ENV=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1
             HOROVOD_CPU_OPERATIONS=gloo)
  if [ "$WITH_TF" = 1 ]; then BUILD_ENV+=(HOROVOD_WITH_TENSORFLOW=1); else BUILD_ENV+=(HOROVOD_WITHOUT_TENSORFLOW=1); fi
  if [ "$WITH_NCCL" = 1 ]; then
    NVCC=$("$PY" -c "import sys; sys.path.insert(0, '$HERE/scripts'); import install_plan; print(install_plan.find_nvcc())")
    BUILD_ENV+=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_CUDA_HOME=$(dirname "$(dirname "$NVCC")")" HOROVOD_NCCL_LINK=SHARED)
    # NCCL from the nvidia-nccl wheel that came with the CUDA torch, where there is one
    NCCL_HOME=$("$PY" -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null || true)
    if [ -n "$NCCL_HOME" ]; then BUILD_ENV+=("HOROVOD_NCCL_HOME=$NCCL_HOME"); fi
    log "building with ${BUILD_ENV[*]}"
  fi
  env CXX="$SHIM/g++" CC=/usr/bin/gcc "${BUILD_ENV[@]}" MAKEFLAGS="-j$(nproc)" TF_USE_LEGACY_KERAS=1 \
    "${PIP[@]}" wheel --no-build-isolation --no-deps -v "$SRC"/horovod-$HOROVOD_VERSION.tar.gz \
      -w "$CACHE/$WHEEL_DIR" > "$CACHE/horovod-build.log" 2>&1 || {
        log "horovod build failed; last lines of $CACHE/horovod-build.log:"; tail -n 40 "$CACHE/horovod-build.log"; exit 1; }
  WHEEL=$(ls "$CACHE"/$WHEEL_DIR/horovod-$HOROVOD_VERSION-*.whl | head -n1)
}

if horovod_ok; then
  log "horovod $HOROVOD_VERSION ($BUILT; $FRAMEWORKS) already installed"
else
  WHEEL=$(ls "$CACHE"/$WHEEL_DIR/horovod-$HOROVOD_VERSION-*.whl 2>/dev/null | head -n1 || true)
  CACHED=1
  if [ -z "$WHEEL" ]; then CACHED=0; build_wheel; fi
  log "installing $WHEEL"
  "${PIP[@]}" install -c "$CONSTRAINTS" --force-reinstall --no-deps "$WHEEL"
  if ! horovod_ok && [ "$CACHED" = 1 ]; then
    # a wheel cached by an earlier install, compiled against another torch or TensorFlow build
    log "the cached $WHEEL does not import with this torch/TensorFlow: building it again"
    rm -f "$WHEEL"
    build_wheel
    log "installing $WHEEL"
    "${PIP[@]}" install -c "$CONSTRAINTS" --force-reinstall --no-deps "$WHEEL"
  fi
  horovod_ok || { log "horovod installed but does not import with $BUILT ($FRAMEWORKS)"; exit 1; }
fi

# --- 3. this package ---------------------------------------------------------------------------
# (checked from / so that the current directory does not make an uninstalled checkout importable)
# (the console command `hvdcompress` must be registered too: it came with a later setup.py)
# (found without importing: tf_ops would import TensorFlow, seconds for nothing)
if (cd / && "$PY" -c "import importlib.util as u, sys; sys.exit(0 if all((u.find_spec(m) or sys.exit(1)).origin.startswith('$HERE/') for m in ('hvdcompress', 'torch_ops', 'tf_ops')) else 1)") 2>/dev/null \
    && command -v hvdcompress >/dev/null; then
  log "hvdcompress already installed (editable, from $HERE)"
else
  "${PIP[@]}" install -c "$CONSTRAINTS" --no-deps --no-build-isolation -e "$HERE"
fi
# --- 4. the optional compiled kernels (hvdcompress/native/kernels.cpp; ~1 s) ----------------------
"$PY" -c "import sys; from hvdcompress import native; sys.exit(native.main())" | sed 's/^/[install] /'
# (horovod_ok above checked the Gloo, PyTorch and TensorFlow builds; `horovodrun --check-build`
# tells the same in about 20 s)
# --- 5. triton for the GPU kernels' interpreter tests (tests/test_triton_kernels.py) -------------
# A CUDA torch brings its own triton. On a CPU machine it goes into a folder of its own, off the
# interpreter's path: loaded in a process after Horovod's TensorFlow ops (torch.optim loads it
# through torch._dynamo) it crashes that process; only the kernels' test processes put it on theirs.
TRITON_VERSION=3.9.0
if "$PY" -c "import triton" >/dev/null 2>&1; then
  log "triton $("$PY" -c 'import triton; print(triton.__version__)') on the path (the GPU kernels use it)"
elif [ -f "$CACHE/triton-$TRITON_VERSION/triton/__init__.py" ]; then
  log "triton $TRITON_VERSION for the kernels' interpreter tests already in $CACHE/triton-$TRITON_VERSION"
else
  log "installing triton $TRITON_VERSION into $CACHE/triton-$TRITON_VERSION (for the kernels' interpreter tests)"
  "${PIP[@]}" install -q --no-deps --target "$CACHE/triton-$TRITON_VERSION" "triton==$TRITON_VERSION"
fi

TORCH_BUILD=CPU
if [ -n "$TORCH_CUDA" ]; then TORCH_BUILD="CUDA $TORCH_CUDA"; fi
log "done: torch $TORCH_PIN ($TORCH_BUILD); horovod $HOROVOD_VERSION with $BUILT for $FRAMEWORKS; hvdcompress from $HERE"
