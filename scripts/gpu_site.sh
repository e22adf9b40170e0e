# Sourced by scripts/gpu_check.sh and scripts/gpu_bench.sh: `gpu_site PYTHON BUNDLE` installs
# what `make gpu-bundle` put in BUNDLE (its wheels, and NIXL's UCX subset) into a private
# --target directory, named in SITE (empty when there is no BUNDLE): the host's torch, numpy
# and transformers are never replaced. GPU_CHECK_SITE names the directory instead of a fresh one.
gpu_site() {
    local py=$1 bundle=$2
    SITE=""
    [ -d "$bundle" ] || return 0
    SITE=${GPU_CHECK_SITE:-$(mktemp -d /tmp/pdserve-gpu-site.XXXXXX)}
    echo "== 0. installing $bundle into $SITE (private; the host's packages stay as they are)"
    "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$bundle"/wheels/*.whl &&
        tar xzf "$bundle/nixl_cu13_ucx.tar.gz" -C "$SITE"
}
