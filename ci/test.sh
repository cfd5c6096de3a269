#!/usr/bin/env bash
# The CI job for CI systems that look under ci/: the same as .ci/run.
set -euo pipefail
exec "$(dirname "$0")/../.ci/run"
