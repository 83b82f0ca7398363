#!/usr/bin/env bash
# The connector job (tests/programs/test_vllm_ascend_connector.py), in the CI virtualenv (.ci/run activates
# it): vllm-ascend's LLMDataDistCMgrConnector, its own source from the vllm-ascend 0.11.0 wheel,
# run on pdlink between two processes. Installs only what the connector imports for real: torch
# (the CPU wheel, about 190 MB), msgspec and pyzmq; vLLM and torch_npu are stood in for
# (tests/connector_shims/). PDLINK_REQUIRE_CONNECTOR=1 makes a missing dependency a failure, not a
# skip. About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=common.sh
. .ci/common.sh

step "connector: installing torch (CPU), msgspec and pyzmq"
python -m pip install --quiet "torch==2.13.0+cpu" msgspec pyzmq
step "connector: vllm-ascend's LLMDataDistCMgrConnector on pdlink"
# -n 0: one test at a time. The connector binds its metadata socket at the KV port plus one, so two
# tests side by side (pytest-xdist workers) could each take the other's port.
PDLINK_REQUIRE_CONNECTOR=1 PDLINK_TEST_CACHE="$CI_OUT/test-cache" python -m pytest -q -p no:cacheprovider -n 0 \
  tests/programs/test_vllm_ascend_connector.py
