#!/usr/bin/env bash
# Sanitizer runs; exits non-zero on any finding (a sanitizer report from any process, or a failing
# test). Its parts on 2 cores, 2026-12-06 (docs/reliability.md): the ASan suite 7 minutes, the
# TSan suite 4, each in two pytest workers with peers forked from a fork server (tests/peer.py);
# the two sanitized pip builds (the core at -O1, the bindings at -O0: CMakeLists.txt) and the C++
# programs the rest.
# Uses GCC's sanitizer runtimes (they come with g++); builds go under build/ci/.
#  1. ASan + UBSan: the core and the Python module built with PDLINK_SANITIZE=address,undefined by
#     pip (scikit-build-core) into their own virtualenv, and the default test suite run under it
#     (libasan preloaded into Python; leak detection off there, since Python itself leaks at exit).
#     The heavy (load and soak) tests are left out here: with them the run took 21 of CI's 90
#     minutes (2026-12-03); they run plain in .ci/run and, for the concurrency files, under TSan.
#     So is tests/server (a tenth of the suite's time): the REST layer is Python, and the engine
#     calls it makes are the ones every other folder makes.
#     What else it leaves out follows one rule, kept in one place (asan_leave_out, below): it needs
#     every C++ code path (every data path, every op, every hostile and fuzz-style test), not every
#     Python-level way of reaching the same C++. So (a) the test files that start no engine (the
#     drop-ins' types, configs, argument checks and their property tests, the status codes, the
#     layers' source reading: Python over the module's load, which every other test does too) and
#     (b) the drop-in layers' cpu-cma cells (tests/compat and tests/programs/test_compat_flows.py:
#     llm_datadist and hixl call the same engine methods as on cpu-tcp and ascend-fake, where they
#     stay, and the cma path itself runs every op in tests/native, tests/paths and tests/hostile),
#     (c) the benchmarks' smoke runs, (d) two of the three stream counts of the multi-stream pull.
#  2. TSan: the same with PDLINK_SANITIZE=thread, running the concurrency-heavy test files (the
#     list below says which and why); and
#     csrc/tests/concurrency_test (engines in one process, threads pulling, pushing, linking,
#     unlinking and re-registering at once) over TCP and over direct memory access; and
#     csrc/tests/path_test, the data-path conformance suite (every host path, the device paths
#     required: ipc, hccl-one-sided, hccl on the fake Ascend libraries built with the same
#     sanitizer, the ones the TSan suite built, so no rebuild; the interface's units; ucx prints
#     "skipped": .ci/ucx.sh runs it).
#  3. ASan + LeakSanitizer: concurrency_test's link/pull/unlink/finalize loop (no leak; descriptors
#     and threads back where they started) and its stress run, both transports; path_test, the
#     device paths required as under TSan (the fakes the ASan suite built); and
#     csrc/tests/unit_test (the wire decoders, the registry and the memory pool, each on its own).
# STRESS_SECONDS (default 15) sets the length of each stress run.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=common.sh
. .ci/common.sh

STRESS_SECONDS=${STRESS_SECONDS:-15}
logs="$PWD/$CI_OUT/sanitizer-logs"
rm -rf "$logs"
mkdir -p "$logs"
export CC=gcc CXX=g++
# A process that is not built with a sanitizer (Python) needs its runtime preloaded, and libstdc++
# with it: otherwise the runtime cannot find the real __cxa_throw and aborts on the first C++
# exception.
asan_lib=$(g++ -print-file-name=libasan.so)
tsan_lib=$(g++ -print-file-name=libtsan.so)
stdcxx_lib=$(g++ -print-file-name=libstdc++.so.6)
for lib in "$asan_lib" "$tsan_lib" "$stdcxx_lib"; do
  [ -f "$lib" ] || { echo "$lib not found (g++ -print-file-name)"; exit 1; }
done
# A sanitizer report in a log, whatever process wrote it.
report_pattern='ERROR: AddressSanitizer|ERROR: LeakSanitizer|WARNING: ThreadSanitizer|ThreadSanitizer: reported|: runtime error: |UndefinedBehaviorSanitizer'
# Resident memory means nothing under a sanitizer (ASan holds freed memory in quarantine, TSan
# keeps shadow memory): the test that bounds its growth skips itself when PDLINK_SANITIZER is set.
findings=0

# check LOG NAME: counts a finding when LOG, or a sanitizer log file, holds a report.
check() {
  local log=$1 name=$2 files
  files=$(find "$logs" -maxdepth 1 \( -name 'asan.*' -o -name 'tsan.*' -o -name 'ubsan.*' \) | sort)
  if grep -qE "$report_pattern" "$log" || [ -n "$files" ]; then
    echo "SANITIZER FINDING in $name:"
    grep -nE -A 30 "$report_pattern" "$log" | head -n 120 || true
    for f in $files; do
      echo "--- $f"
      head -n 80 "$f"
    done
    findings=$((findings + 1))
    mkdir -p "$logs/findings"
    # shellcheck disable=SC2086
    mv $files "$logs/findings/" 2>/dev/null || true
  fi
}

# run NAME CMD...: runs CMD with its output in a log; a failure is a finding too.
run() {
  local name=$1 log="$logs/$1.log" rc=0 start=$SECONDS
  shift
  "$@" >"$log" 2>&1 || rc=$?
  echo "$name: exit $rc, $((SECONDS - start)) s"
  # the summaries; and path_test's paths that did not run
  grep -E '^(stress|cycles): |^(path|unit)_test: |^[0-9]+ (passed|failed)|^path [a-z-]+: skipped' "$log" | tail -n 8 || true
  if [ "$rc" -ne 0 ]; then
    echo "FAILED: $name (exit $rc). Log tail:"
    tail -n 40 "$log"
    findings=$((findings + 1))
  fi
  check "$log" "$name"
}

# pip_build NAME SANITIZE: a virtualenv $CI_OUT/NAME-venv with pdlink[test] built by pip with
# PDLINK_SANITIZE=SANITIZE (its own scikit-build-core build directory, $CI_OUT/NAME-skb). The C++
# test programs are built there too, against the same sanitized core: the core is compiled once
# per sanitizer, not twice (that saved about 8 of CI's minutes). Not ucx_test: .ci/ucx.sh runs it,
# and nothing here does (PDLINK_BUILD_UCX_TEST=OFF).
pip_build() {
  local venv="$CI_OUT/$1-venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >"$logs/pip-$1.log" 2>&1
  # The sanitizer goes in as a CMake define through pip's config settings (not only the
  # environment), so nothing between pip and CMake can drop it.
  PDLINK_SANITIZE=$2 "$venv/bin/python" -m pip install -q --disable-pip-version-check ".[test]" \
    -C build-dir="$PWD/$CI_OUT/$1-skb" -C cmake.build-type=RelWithDebInfo \
    -C cmake.define.PDLINK_SANITIZE="$2" -C cmake.define.PDLINK_BUILD_TESTS=ON \
    -C cmake.define.PDLINK_BUILD_UCX_TEST=OFF >>"$logs/pip-$1.log" 2>&1 ||
    { tail -n 60 "$logs/pip-$1.log"; exit 1; }
  local runtime=libasan deps core
  [ "$2" = thread ] && runtime=libtsan
  core=$(echo "$venv"/lib/python3*/site-packages/pdlink/libpdlink_core.so)
  # ldd's output is captured first: `ldd | grep -q` under pipefail fails at random when grep exits
  # before ldd has written everything (SIGPIPE).
  deps=$(ldd "$core") || { echo "ldd $core failed"; exit 1; }
  for t in concurrency_test path_test unit_test; do
    [ -x "$CI_OUT/$1-skb/$t" ] || { echo "$CI_OUT/$1-skb/$t was not built (PDLINK_BUILD_TESTS)"; exit 1; }
  done
  if ! grep -q "$runtime" <<<"$deps"; then
    echo "the core in $venv is not built with -fsanitize=$2; ldd says:"
    echo "$deps"
    grep -n PDLINK_SANITIZE "$CI_OUT/$1-skb/CMakeCache.txt" || true
    tail -n 30 "$logs/pip-$1.log"
    exit 1
  fi
}

# ------------------------------------------------------------------------------------ 1. ASan+UBSan
step "ASan+UBSan: the module built with PDLINK_SANITIZE=address,undefined; the test suite"
pip_build asan address,undefined
# The fake Ascend libraries that the tests build (tests/fake_ascend) get the same sanitizer, so it
# sees their threads, locks and memory too (FAKE_ASCEND_CXXFLAGS, read by their build.py).
# Left out, for time: the server (its own fuzzing and hostile tests), the emulated hosts' own tests
# and the fleet (namespaces and many server processes: the C++ they reach is the suite's), and the
# two-hosts cells (the same C++ as cpu-tcp and cpu-ucx, over a veth), and the switch-under-load
# test (tests/paths/test_switch_under_load.py: the drain, fence and rollback C++ it reaches is
# test_role_epochs.py's, test_epoch_fence.py's and the round-7/8 reviews', which stay). The
# partition test (tests/paths/test_wire_faults.py) stays.
# The suite runs in two pytest workers (pyproject's addopts: -n auto), whose output, and their peers',
# does not reach this log: every sanitizer writes its reports to files under $logs instead
# (log_path), and check() counts any such file as a finding.
asan_fake_flags="-fsanitize=address,undefined -fno-omit-frame-pointer"
# The rule of the header, 1.: (a) the files that start no engine, (b) the drop-ins' cpu-cma cells
# ("compat" is a keyword of every test under tests/compat and of test_compat_flows.py's).
# Then (c) the benchmarks' smoke runs (programs over the engine calls the suite makes), and (d) the
# multi-stream pull's 1- and 4-stream cases (the 2-stream one runs the same lane code; each took 45 s
# under ASan).
asan_leave_out=(
  --ignore=tests/compat/llm_datadist/test_types.py --ignore=tests/compat/llm_datadist/test_types_validation.py
  --ignore=tests/compat/llm_datadist/test_config.py --ignore=tests/compat/llm_datadist/test_properties.py
  --ignore=tests/native/test_status.py --ignore=tests/native/test_layers.py
  --ignore=tests/programs/test_bench_smoke.py
  -k "not tcp-hosts and not ucx-hosts and not (compat and cpu-cma) and not (several_streams_land_exact_bytes and (1-cpu-tcp or 4-cpu-tcp))"
)
run pytest-asan env LD_PRELOAD="$asan_lib $stdcxx_lib" PDLINK_SANITIZER=address,undefined \
  FAKE_ASCEND_CXXFLAGS="$asan_fake_flags" \
  ASAN_OPTIONS="detect_leaks=0:log_path=$logs/asan" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan" \
  "$CI_OUT/asan-venv/bin/python" -m pytest tests --ignore=tests/server --ignore=tests/hosts --ignore=tests/fleet \
  --ignore=tests/paths/test_switch_under_load.py "${asan_leave_out[@]}" -q -p no:cacheprovider -m "not heavy"

# ------------------------------------------------------------------------------------ 2. TSan
step "TSan: the module built with PDLINK_SANITIZE=thread; the concurrency-heavy tests"
pip_build tsan thread
# .ci/tsan.supp: payload copies (ordered through the peer process, which TSan cannot see).
tsan_fake_flags=-fsanitize=thread
# The files whose engines run the most threads at once: peers killed and frozen mid-transfer, 64
# links pulling at once, async requests cancelled in flight, handoffs (leases, holds, aborts, the
# 10,000 release/claim races), role switches draining in-flight pulls, links made and dropped; heavy
# tests included. Not the two-hosts cells (the same C++ as cpu-tcp and cpu-ucx, over a veth), nor
# the 10,000 races on the two heavy Ascend cells (the offer table is the same C++ on every path;
# they run on cpu-tcp, cpu-cma and ascend-fake).
run pytest-tsan env LD_PRELOAD="$tsan_lib $stdcxx_lib" PDLINK_SANITIZER=thread FAKE_ASCEND_CXXFLAGS="$tsan_fake_flags" \
  TSAN_OPTIONS="log_path=$logs/tsan:suppressions=$PWD/.ci/tsan.supp" \
  "$CI_OUT/tsan-venv/bin/python" -m pytest tests/compat/llm_datadist/test_transfer_async.py tests/paths/test_faults.py \
  tests/paths/test_load.py tests/compat/llm_datadist/test_comm_link.py tests/paths/test_ascend_ipc.py \
  tests/paths/test_ascend_onesided.py tests/native/test_handoff.py tests/native/test_role_epochs.py \
  -k "not tcp-hosts and not ucx-hosts and not (10000_times and (ascend-ipc or ascend-onesided))" \
  -q -p no:cacheprovider -m "heavy or not heavy"

step "TSan: concurrency_test"
tsan_bin="$CI_OUT/tsan-skb"  # built by pip_build with the module
# the data-path conformance suite: the device paths on the fakes with TSan (required: a skip is a
# failure; build.py's cache holds the TSan suite's build of them, so this takes no compile)
tsan_fakes=$(FAKE_ASCEND_CXXFLAGS="$tsan_fake_flags" python3 tests/fake_ascend/build.py full)
run "tsan-path-conformance" env TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$logs/tsan" \
  "$tsan_bin/path_test" --require device --ascend-lib "$tsan_fakes"
for transport in tcp cma; do
  run "tsan-stress-$transport" env TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$logs/tsan" \
    "$tsan_bin/concurrency_test" stress --transport "$transport" --seconds "$STRESS_SECONDS"
done
# authenticated links: sealed frames and payloads (the AuthStreams' per-channel state)
run "tsan-stress-tcp-sealed" env TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$logs/tsan" \
  "$tsan_bin/concurrency_test" stress --transport tcp --secret ci-secret --integrity 1 --seconds "$STRESS_SECONDS"

# ------------------------------------------------------------------------------------ 3. ASan+LSan
step "ASan+LSan: concurrency_test"
asan_bin="$CI_OUT/asan-skb"  # built by pip_build with the module
run "asan-unit" env ASAN_OPTIONS="detect_leaks=1:log_path=$logs/asan" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" "$asan_bin/unit_test"
# the data-path conformance suite (csrc/tests/path_test.cc): every host path, the device paths on
# the fakes with ASan (required, as under TSan; the ASan suite's build of them), the interface's units
asan_fakes=$(FAKE_ASCEND_CXXFLAGS="$asan_fake_flags" python3 tests/fake_ascend/build.py full)
run "asan-path-conformance" env ASAN_OPTIONS="detect_leaks=1:log_path=$logs/asan" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" "$asan_bin/path_test" --require device --ascend-lib "$asan_fakes"
for transport in tcp cma; do
  run "lsan-cycles-$transport" env ASAN_OPTIONS="detect_leaks=1:log_path=$logs/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    "$asan_bin/concurrency_test" cycles --transport "$transport" --cycles 2000
  run "asan-stress-$transport" env ASAN_OPTIONS="detect_leaks=1:log_path=$logs/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    "$asan_bin/concurrency_test" stress --transport "$transport" --seconds "$STRESS_SECONDS"
done
run "lsan-cycles-tcp-sealed" env ASAN_OPTIONS="detect_leaks=1:log_path=$logs/asan" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  "$asan_bin/concurrency_test" cycles --transport tcp --secret ci-secret --integrity 1 --cycles 2000

step "sanitizers: $findings finding(s), $SECONDS s"
[ "$findings" -eq 0 ]
