#!/usr/bin/env bash
# The CI job: make sure a Rust toolchain is there, then run the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
if ! command -v cargo >/dev/null 2>&1; then
    echo "ci: cargo is not installed" >&2
    exit 1
fi
cargo --version
time cargo xtask test
