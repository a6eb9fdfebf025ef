# Sourced by install.sh and pack_env.sh: how packages get into a virtual environment here.
#
#   choose_installer VENV_PYTHON   # sets PIP (an install command for that environment) and CPU_FROM
#   install_torch VERSION          # torch's CPU build where there is no NVIDIA GPU, else PyPI's CUDA one
#                                  # (TORCH_BUILD=cpu or cuda chooses, for an environment built elsewhere)

CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

choose_installer() {
    local python="$1"
    # uv installs in about 60% of pip's time (78 s against 124 s for the test extras on 2 cores);
    # pip does it where uv cannot be had (set SPARKDL_INSTALLER=pip to choose pip).
    # Both compile bytecode: where PYTHONDONTWRITEBYTECODE is set, nothing would compile it later
    # (COMPILE_BYTECODE=0: not, for an environment that compiles as it imports).
    if [ "${SPARKDL_INSTALLER:-uv}" = uv ] && "$python" -m pip install --quiet --disable-pip-version-check uv 2>/dev/null; then
        PIP=("$python" -m uv pip install --quiet --python "$python")
        [ "${COMPILE_BYTECODE:-1}" = 1 ] && PIP+=(--compile-bytecode)
        # uv reads no pip.conf: pass on the wheel folders and the constraints that pip's names
        pip_config() { "$python" -m pip config get "global.$1" 2>/dev/null || true; }
        local folder file
        for folder in ${PIP_FIND_LINKS:-$(pip_config find-links)}; do PIP+=(--find-links "$folder"); done
        for file in ${PIP_CONSTRAINT:-$(pip_config constraint)}; do PIP+=(--constraint "$file"); done
        # uv looks at an extra index before the default one: PyTorch's CPU index, then PyPI
        CPU_FROM=(--extra-index-url "$CPU_INDEX")
    else
        PIP=("$python" -m pip install --quiet --disable-pip-version-check)
        [ "${COMPILE_BYTECODE:-1}" = 1 ] || PIP+=(--no-compile)
        CPU_FROM=(--index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple)
    fi
}

install_torch() {
    local version="$1" build="${TORCH_BUILD:-}"
    if [ -z "$build" ]; then
        if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then build=cuda; else build=cpu; fi
    fi
    if [ "$build" = cuda ]; then
        echo "installing torch==$version with CUDA from PyPI"
        "${PIP[@]}" "torch==$version"
    else
        echo "installing the CPU build of torch==$version"
        # A local wheel or mirror may already offer the +cpu build; else PyTorch's CPU index.
        "${PIP[@]}" "torch==$version+cpu" 2>/dev/null || "${PIP[@]}" "torch==$version" "${CPU_FROM[@]}"
    fi
}
