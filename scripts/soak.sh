#!/usr/bin/env bash
# The long soak (examples/soak.rs): mixed small and large calls (64 B..1 MiB, every byte
# verified) from several clients while the servers are killed and restarted at random; fails on
# any wrong answer, any hang, any unclear error, a client that does not reconnect by itself, or
# RSS that is not flat after warm-up. scripts/test.sh runs the 60 s CI form.
#
#   scripts/soak.sh                      # 600 s
#   scripts/soak.sh 3600                 # an hour
#   scripts/soak.sh 600 --servers 4 --clients 4 --max-size 4m   # more options: see the example
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs="${1:-600}"
shift || true
exec cargo run --locked --release --example soak -- --secs "$secs" "$@"
