#!/usr/bin/env bash
# A fresh checkout -> the development venv (.venv) and a kernel library in the checkout (fa4_jax/_lib),
# without `pip install -e .` (which builds the whole menu, ~11-14 min): the GPU workflow of BUILD.md.
# Nothing git-ignored survives from one session on the build host to the next, so this is step one.
#
#   bash tools/dev_setup.sh                                   # .venv + the sm90 library (~6 min on 2 cores)
#   FA4_JAX_VARIANTS='kvcache:kv_fp8=true' bash tools/dev_setup.sh   # a narrow menu instead
#   SKIP_BUILD=1 bash tools/dev_setup.sh                      # the venv alone
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# Every package the build and the tests need, read from pyproject.toml so that the list cannot drift:
# the build-system requirements, the runtime dependencies and the test and flax extras.
mapfile -t reqs < <(.venv/bin/python - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
reqs = p["build-system"]["requires"] + p["project"]["dependencies"]
for extra in ("test", "flax"):
    reqs += p["project"]["optional-dependencies"][extra]
print("\n".join(dict.fromkeys(r for r in reqs if not r.startswith("scikit-build-core")) or ()))
PY
)
.venv/bin/pip install -q "${reqs[@]}" scikit-build-core cmake ninja
if [ -z "${SKIP_BUILD:-}" ]; then
    FA4_JAX_VARIANTS="${FA4_JAX_VARIANTS:-arch=sm90}" .venv/bin/python tools/build_inplace.py --jobs "${JOBS:-2}" \
        --build-dir "${BUILD_DIR:-build/dev}"
fi
