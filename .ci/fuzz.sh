#!/usr/bin/env bash
# Fuzzes the wire-protocol decoders, the serving side's access checks, the real serving loop
# (Engine::serveStream against a real Engine) and the requester's checks of the answers it reads
# (csrc/fuzz/wire_fuzz.cc) with libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer for a
# bounded time (FUZZ_SECONDS, default 60). Exits non-zero when the fuzzer finds a crash, a sanitizer
# report, a broken invariant, a timeout or runaway memory; the input is saved under build/ci/fuzz/.
#
# The seeds include real UCX worker addresses (kModeUcxAddress: ucx::checkWorkerAddress against a
# model of UCX's own reader), and those get a run of their own, FUZZ_UCX_SECONDS (default 30), from
# their seeds alone.
#
# Then, to show the fuzzer finds what it is there to find, it runs three more targets of the same
# build, each with one deliberate bug compiled in (core/seeded_bug.h: an unbounded reserve, an
# unchecked flag, an unchecked reply span), and fails unless each is found within
# FUZZ_SEEDED_SECONDS (default 60). FUZZ_SEEDED=0 skips that part. The core is compiled once for all
# four targets and the seed generator; only the sources that include seeded_bug.h are compiled per
# target (CMakeLists.txt).
# Installs clang and its runtime libraries with apt-get when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=common.sh
. .ci/common.sh

FUZZ_SECONDS=${FUZZ_SECONDS:-60}
FUZZ_SEEDED_SECONDS=${FUZZ_SEEDED_SECONDS:-60}
FUZZ_SEEDED=${FUZZ_SEEDED:-1}
FUZZ_UCX_SECONDS=${FUZZ_UCX_SECONDS:-30}
dir="$CI_OUT/fuzz"
mkdir -p "$dir"

step "fuzz: toolchain"
apt_install clang libclang-rt-dev
tools_venv

# build TARGETS...: those targets of the fuzz build ($dir/build): wire_fuzz, the fuzz target;
# wire_fuzz_<bug>, the seeded ones; make_seeds, the seed generator.
build() {
  local out="$dir/build"
  [ -f "$out/build.ninja" ] || CC=clang CXX=clang++ configure "$out" -DPDLINK_BUILD_FUZZ=ON
  cmake --build "$out" --target "$@" >>"$out.log" 2>&1 || { tail -n 60 "$out.log"; exit 1; }
}

# fuzz BINARY SECONDS WORKDIR [SEED GLOB]: runs it on fresh seeds (those matching the glob, default
# all); leaves the exit code in $rc.
fuzz() {
  local bin=$1 seconds=$2 work=$3 only=${4:-*}
  rm -rf "$work"
  mkdir -p "$work/seeds" "$work/corpus" "$work/all"
  "$dir/build/make_seeds" "$work/all" >/dev/null
  # shellcheck disable=SC2086
  cp "$work"/all/$only "$work/seeds/"
  rc=0
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 \
    -artifact_prefix="$work/" "$work/corpus" "$work/seeds" >"$work/fuzz.log" 2>&1 || rc=$?
}

step "fuzz: build wire_fuzz (clang, -fsanitize=fuzzer,address,undefined)"
rm -rf "$dir/build" "$dir/build.log"
build wire_fuzz make_seeds

# report WORKDIR: the run's figures; on a finding, the log tail and the inputs, and exit 1.
report() {
  local work=$1
  grep -E 'DONE|^stat::(number_of_executed_units|new_units_added|peak_rss_mb)|^Done' "$work/fuzz.log" || true
  if [ "$rc" -ne 0 ]; then
    echo "FUZZ FAILURE (exit $rc). Log tail:"
    tail -n 60 "$work/fuzz.log"
    for f in "$work"/crash-* "$work"/timeout-* "$work"/oom-* "$work"/leak-*; do
      [ -e "$f" ] || continue
      echo "input $f:"
      od -An -tx1 -v "$f" | head -n 40
    done
    exit 1
  fi
  echo "fuzz: no finding"
}

step "fuzz: run for ${FUZZ_SECONDS} s"
fuzz "$dir/build/wire_fuzz" "$FUZZ_SECONDS" "$dir/run"
report "$dir/run"

step "fuzz: UCX worker addresses (ucx::checkWorkerAddress) for ${FUZZ_UCX_SECONDS} s"
fuzz "$dir/build/wire_fuzz" "$FUZZ_UCX_SECONDS" "$dir/run-ucx-address" 'ucx-address-*'
[ "$(ls "$dir/run-ucx-address/seeds" | wc -l)" -ge 5 ] || { echo "fuzz: the UCX address seeds are missing"; exit 1; }
report "$dir/run-ucx-address"

[ "$FUZZ_SEEDED" = 1 ] || exit 0
missed=0
for kind in reserve flag offset; do
  step "fuzz: seeded bug '$kind' must be found within ${FUZZ_SEEDED_SECONDS} s"
  build "wire_fuzz_$kind"
  start=$SECONDS
  fuzz "$dir/build/wire_fuzz_$kind" "$FUZZ_SEEDED_SECONDS" "$dir/seeded-$kind-run"
  took=$((SECONDS - start))
  what=$(grep -m1 -E 'ERROR: libFuzzer|ERROR: AddressSanitizer|runtime error|invariant violated|wire_fuzz: ' \
    "$dir/seeded-$kind-run/fuzz.log" || true)
  if [ "$rc" -ne 0 ] && [ -n "$what" ]; then
    echo "found in ${took} s: $what"
  else
    echo "NOT FOUND within ${FUZZ_SEEDED_SECONDS} s (exit $rc)"
    tail -n 20 "$dir/seeded-$kind-run/fuzz.log"
    missed=$((missed + 1))
  fi
done
[ "$missed" -eq 0 ]
