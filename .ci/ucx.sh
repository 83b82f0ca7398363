#!/usr/bin/env bash
# The UCX job (docs/ucx.md), in the CI virtualenv (.ci/run activates it). About 6 minutes.
#  1. Installs what pdlink's ucx extra installs (the libucx-cu12 wheel: libucp and its transports).
#  2. ucx_abi_check: transport/ucx/ucp_min.h compiled against the wheel's own UCX headers (every
#     constant and field offset pdlink declares must equal UCX's).
#  3. csrc/tests/ucx_test against the wheel's libucp, with UCX_TLS=tcp, sm,tcp, sm and unset, and
#     PDLINK_REQUIRE_UCX=1 (a library that does not load is a failure, not a skip); then
#     csrc/tests/path_test's conformance cases on the ucx path, with UCX_TLS=tcp, sm,tcp and unset
#     (sm alone names no network transport: an engine refuses it), `--require ucx` (a library that
#     does not load is a failure there too); about a second each.
#  4. pdlink version finds the wheel; then every test that names ucx, the shared suite's cpu-ucx,
#     cpu-ucx-sm and cpu-ucx-hosts cells among them, the drop-ins on cpu-ucx only (about 5 minutes).
# The sanitizer runs leave UCX out: libucp is not instrumented, and its memory hooks (UCX_MEM_EVENTS)
# interpose on the allocator the sanitizers replace.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=common.sh
. .ci/common.sh

step "ucx: installing the libucx wheel (pdlink[ucx])"
python -m pip install --quiet "libucx-cu12>=1.15"
ucx_root=$(python -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("libucx").origin))')
echo "libucx at $ucx_root"

build="$CI_OUT/ucx"
step "ucx: building ucx_abi_check, ucx_test and path_test"
(  # the build tools' virtualenv only for the build: the tests below run in the CI one
  tools_venv
  configure "$build" -DPDLINK_BUILD_TESTS=ON -DPDLINK_UCX_INCLUDE_DIR="$ucx_root/include"
  ninja -C "$build" ucx_abi_check ucx_test path_test >"$CI_OUT/ucx-build.log" 2>&1 || { cat "$CI_OUT/ucx-build.log"; exit 1; }
)
"$build/ucx_abi_check"

for tls in tcp sm,tcp sm ""; do
  step "ucx: ucx_test with UCX_TLS=${tls:-(unset)}"
  if [ -n "$tls" ]; then
    UCX_TLS=$tls PDLINK_REQUIRE_UCX=1 PDLINK_REQUIRE_NETNS=1 PDLINK_UCX_LIB_DIR="$ucx_root/lib" timeout 300 "$build/ucx_test"
  else
    env -u UCX_TLS PDLINK_REQUIRE_UCX=1 PDLINK_REQUIRE_NETNS=1 PDLINK_UCX_LIB_DIR="$ucx_root/lib" timeout 300 "$build/ucx_test"
  fi
done
for tls in tcp sm,tcp ""; do
  step "ucx: path_test's conformance cases on the ucx path with UCX_TLS=${tls:-(unset)}"
  if [ -n "$tls" ]; then
    UCX_TLS=$tls PDLINK_UCX_LIB_DIR="$ucx_root/lib" timeout 120 "$build/path_test" --transport ucx --require ucx
  else
    env -u UCX_TLS PDLINK_UCX_LIB_DIR="$ucx_root/lib" timeout 120 "$build/path_test" --transport ucx --require ucx
  fi
done

step "ucx: pdlink finds the wheel"
# captured first: under pipefail, `pdlink version | grep -q` fails when grep exits before pdlink's
# later lines are written (a broken pipe)
versions=$(pdlink version)
grep -q "^ucx: UCX .* loaded from $ucx_root/lib/" <<<"$versions" || { echo "$versions"; exit 1; }

# The shared suite's ucx cells (backend_env.py: cpu-ucx over UCX_TLS=tcp, cpu-ucx-sm over sm,tcp,
# cpu-ucx-hosts between emulated hosts) and the other tests that name ucx; PDLINK_REQUIRE_UCX=1 turns
# a skip for want of UCX into a failure. The drop-in layers (tests/compat, test_compat_flows.py) run
# on cpu-ucx only: they call the engine methods the native suite calls on all three cells (the rule
# the ASan suite follows for their cpu-cma cells), and were a fifth of this job's time.
step "ucx: the shared suite on the ucx path"
env -u UCX_TLS PDLINK_REQUIRE_UCX=1 pytest -q -k "ucx and not (compat and (ucx-sm or ucx-hosts))"
