#!/usr/bin/env bash
# The whole test suite: unit and property tests, kernel tests and traffic tests in network
# namespaces (needs root). The nftproxy binary is built first because the traffic tests run it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --bins
cargo test --workspace -- --test-threads=2
