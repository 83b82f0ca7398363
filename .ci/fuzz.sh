#!/usr/bin/env bash
# Fuzzes the wire-protocol decoders and the serving side's access checks (csrc/fuzz/wire_fuzz.cc)
# with libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer for a bounded time
# (FUZZ_SECONDS, default 60). Exits non-zero when the fuzzer finds a crash, a sanitizer report, a
# broken invariant, a timeout or runaway memory; the input is saved under build/ci/fuzz/.
# Installs clang and its runtime libraries with apt-get when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=common.sh
. .ci/common.sh

FUZZ_SECONDS=${FUZZ_SECONDS:-60}
dir="$CI_OUT/fuzz"

step "fuzz: toolchain"
apt_install clang libclang-rt-dev
tools_venv

step "fuzz: build wire_fuzz (clang, -fsanitize=fuzzer,address,undefined)"
CC=clang CXX=clang++ configure "$dir/build" -DPDLINK_BUILD_FUZZ=ON
cmake --build "$dir/build" --target wire_fuzz make_seeds >"$dir/build.log" 2>&1 || { tail -n 60 "$dir/build.log"; exit 1; }

rm -rf "$dir/seeds" "$dir/corpus"
mkdir -p "$dir/seeds" "$dir/corpus"
"$dir/build/make_seeds" "$dir/seeds"

step "fuzz: run for ${FUZZ_SECONDS} s"
rc=0
"$dir/build/wire_fuzz" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
  -print_final_stats=1 -artifact_prefix="$dir/" "$dir/corpus" "$dir/seeds" >"$dir/fuzz.log" 2>&1 || rc=$?
grep -E 'DONE|^stat::(number_of_executed_units|new_units_added|peak_rss_mb)|^Done' "$dir/fuzz.log" || true
if [ "$rc" -ne 0 ]; then
  echo "FUZZ FAILURE (exit $rc). Log tail:"
  tail -n 60 "$dir/fuzz.log"
  for f in "$dir"/crash-* "$dir"/timeout-* "$dir"/oom-* "$dir"/leak-*; do
    [ -e "$f" ] || continue
    echo "input $f:"
    od -An -tx1 -v "$f" | head -n 40
  done
  exit 1
fi
echo "fuzz: no finding"
