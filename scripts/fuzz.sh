#!/usr/bin/env bash
# Bounded fuzzing of rpc-core with libFuzzer (fuzz/README.md says what each target checks).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      default 30; 0: build and replay only
#
# 1. builds the targets in fuzz/ with coverage instrumentation: plain `cargo build` with the
#    flags `cargo fuzz build -s none` uses (works on stable; no cargo-fuzz install needed;
#    libfuzzer-sys compiles libFuzzer itself, which needs a C++ compiler);
# 2. replays every saved regression input (fuzz/regressions/<target>/*) and the seed corpus
#    (fuzz/corpus/<target>/*) once: a crash that was found stays a test;
# 3. fuzzes each target for SECONDS_PER_TARGET, starting from the seed corpus, in libFuzzer's
#    fork mode so that a crash does not end the run early (all crashes found are reported).
#
# Exits non-zero if any input crashed, printing each crashing input's path (new ones are kept
# in fuzz/artifacts/<target>/; move one to fuzz/regressions/<target>/ to keep it as a test).
# Environment: FUZZ_TARGETS="a b" to pick targets; FUZZ_SANITIZER=address to build with
# AddressSanitizer (needs -Zsanitizer, so it sets RUSTC_BOOTSTRAP=1 on this stable toolchain).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECS=${1:-30}
[[ "$SECS" =~ ^[0-9]+$ ]] || { echo "usage: $0 [SECONDS_PER_TARGET]" >&2; exit 2; }
read -r -a TARGETS <<<"${FUZZ_TARGETS:-frame_decoder codec_messages direct_bodies rendezvous}"
SANITIZER=${FUZZ_SANITIZER:-none}
T0=$(date +%s)
stage() { echo; echo "==== fuzz [$(($(date +%s) - T0))s] $*"; }

stage "toolchain"
command -v cargo >/dev/null || { echo "fuzz.sh: cargo not found" >&2; exit 1; }
if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: installing a C++ compiler for libFuzzer (g++)"
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
  $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends g++ >/dev/null
fi
HOST=$(rustc -vV | sed -n 's/^host: //p')

stage "build (sanitizer: $SANITIZER)"
# The same flags as cargo-fuzz 0.13 (`cargo fuzz build [-s none]`), into the same target
# directory, so `cargo fuzz run -s none <target>` afterwards reuses this build. `--target`
# keeps the instrumentation off build scripts and proc macros.
RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing \
-Cllvm-args=-simplifycfg-branch-fold-threshold=0 -Cllvm-args=-sanitizer-coverage-stack-depth \
-Cdebug-assertions -Ccodegen-units=1"
if [ "$SANITIZER" != none ]; then
  RUSTFLAGS="$RUSTFLAGS -Zsanitizer=$SANITIZER"
  export RUSTC_BOOTSTRAP=1 ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_odr_violation=0"
fi
RUSTFLAGS="$RUSTFLAGS" cargo build --locked --manifest-path fuzz/Cargo.toml --target "$HOST" \
  --release --config 'profile.release.debug="line-tables-only"' --bins
BIN=fuzz/target/$HOST/release

failed=()
# Why an input makes target $1 crash: "<where>\t<message>" (the panic's location, or the
# kind of death: stack overflow, deadly signal, out of memory, ...).
why() {
  "$BIN/$1" -rss_limit_mb=1024 "$2" 2>&1 | awk '
    done { next }
    /has overflowed its stack/ { print "stack overflow\t" $0; done = 1; next }
    /panicked at/ { loc = $0; sub(/.*panicked at /, "", loc); sub(/:$/, "", loc); getline msg
                    print loc "\t" substr(msg, 1, 300); done = 1; next }
    /ERROR: (libFuzzer|AddressSanitizer)/ {
      l = $0; sub(/^==[0-9]+== /, "", l); m = l
      if (l ~ /deadly signal/) m = "no panic: killed by a signal (a stack overflow, an abort, ...)"
      else if (l ~ /stack-overflow/) { l = "AddressSanitizer: stack-overflow"; m = "" }
      print l "\t" m; done = 1; next }
    END { if (!done) print "\t" }
  ' || true
}
# (a directory that is not there has none: not a failure, which under `set -e` would end the
# listing before the next directory's)
inputs() { [ -d "$1" ] || return 0; find "$1" -maxdepth 1 -type f ! -name '.*' | sort; }

stage "replay regressions and seed corpus"
for t in "${TARGETS[@]}"; do
  n=0
  while IFS= read -r f; do
    [ -n "$f" ] || continue
    n=$((n + 1))
    if ! "$BIN/$t" "$f" >/dev/null 2>&1; then
      echo "REGRESSION FAILS: $t $f"
      echo "    $(why "$t" "$f" | tr '\t' ' ')"
      failed+=("$f")
    fi
  done < <(inputs "fuzz/regressions/$t"; inputs "fuzz/corpus/$t")
  echo "$t: $n inputs replayed"
done

total_runs=0
for t in "${TARGETS[@]}"; do
  [ "$SECS" -gt 0 ] || break
  stage "fuzz $t for ${SECS}s"
  work=fuzz/work/$t art=fuzz/artifacts/$t log=fuzz/work/$t.log
  mkdir -p "$work" "$art"
  marker=fuzz/work/.$t.start
  touch "$marker"
  t1=$(date +%s)
  # Fork mode: a crash is saved and fuzzing goes on (exit code 77 then); -timeout and
  # -rss_limit_mb turn hangs and memory blow-ups into findings too. New inputs go to the
  # scratch corpus (first directory), never into the checked-in seeds.
  set +e
  "$BIN/$t" "$work" "fuzz/corpus/$t" -max_total_time="$SECS" -fork=1 -ignore_crashes=1 \
    -timeout=10 -rss_limit_mb=1024 -artifact_prefix="$art/" >"$log" 2>&1
  rc=$?
  set -e
  el=$(($(date +%s) - t1))
  last=$(grep -E '^#[0-9]+: cov:' "$log" | tail -n1 || true)
  execs=$(sed -E 's/^#([0-9]+):.*/\1/' <<<"$last")
  echo "$t: ${last:-no stats (see $log)}"
  echo "$t: ${execs:-0} execs in ${el}s (~$(( ${execs:-0} / (el > 0 ? el : 1) )) exec/s), corpus $(inputs "$work" | wc -l) files, exit $rc"
  total_runs=$((total_runs + ${execs:-0}))
  # Only this run's findings (older ones in $art are left alone).
  mapfile -t crashes < <(find "$art" -maxdepth 1 -type f ! -name '.*' -newer "$marker" | sort)
  if [ ${#crashes[@]} -gt 0 ]; then
    echo "$t: ${#crashes[@]} crashing inputs; by cause:"
    for f in "${crashes[@]}"; do printf '%s\t%s\n' "$(why "$t" "$f")" "$f"; done \
      | awk -F'\t' '{ k = ($1 == "" ? "(did not crash again when replayed)" : $1)
                      if (!(k in n)) { order[++m] = k; msg[k] = $2 }
                      n[k]++; if (n[k] <= 3) ex[k] = ex[k] "\n      " $3 }
                    END { for (i = 1; i <= m; i++) { k = order[i]
                            printf "  %d x at %s\n      %s%s\n", n[k], k, msg[k], ex[k] } }'
    failed+=("${crashes[@]}")
  elif [ "$rc" -ne 0 ]; then
    echo "$t: libFuzzer exited $rc without a saved input; log: $log"
    tail -n 20 "$log"
    failed+=("$log")
  fi
done

stage "done: ${#TARGETS[@]} targets, $total_runs fuzz executions"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FUZZING FOUND ${#failed[@]} CRASHING INPUT(S):"
  printf '  %s\n' "${failed[@]}"
  echo "reproduce: $BIN/<target> <input>   (fuzz/README.md: keeping a crash as a regression)"
  exit 1
fi
echo "no crash"
