#!/bin/bash
# The per-call code footprint of rdma-rpc's busy-poll small call and of the connection layer's
# ping-pong (and of its lean loops, `verbs-pingpong --lean`), on a real verbs device in the QEMU guest: how many distinct instructions each
# process runs on every call (callgrind; scripts/callgrind-footprint.py), client and server.
#
# Under TCG the kernel's work in `ibv_post_send` takes longer the more distinct user-space code
# ran since the last post (docs/latency.md, "Code between two posts"), so this figure, which
# does not depend on the host's load, is the steady measure of a change to the hot path; the
# round trip itself moves by tens of percent between runs here.
#
# Usage: scripts/rdma-footprint.sh
# Env: FOOTPRINT_DEVICES (default "rxe0"; "rxe0 siw0" for both), FOOTPRINT_FLOOR (default 1;
#      0 measures rdma-rpc alone, without the connection layer's ping-pongs), CARGO_TARGET_DIR,
#      RDMA_VM_DIR (image cache). Needs valgrind on the host (installed if missing); the guest
#      runs the host's callgrind from the shared folder.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VM="$ROOT/scripts/rdma-vm"
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=$TARGET_DIR/rdma-footprint
DEVICES=${FOOTPRINT_DEVICES:-rxe0}
FLOOR=${FOOTPRINT_FLOOR:-1}

bash "$ROOT/scripts/install-build-deps.sh"
bash "$VM/build-image.sh"
if ! command -v valgrind >/dev/null; then
  echo "rdma-footprint: installing valgrind"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq valgrind >/dev/null
fi

rm -rf "$OUT"
mkdir -p "$OUT/vg" "$OUT/cg"
cargo build --manifest-path "$ROOT/Cargo.toml" --release --example rpc-perf --features rdma-rpc/rdma
cp "$TARGET_DIR/release/examples/rpc-perf" "$OUT/"
if [ "$FLOOR" = 1 ]; then
  cargo build --manifest-path "$ROOT/Cargo.toml" --release -p transport-rdma --example verbs-pingpong
  cp "$TARGET_DIR/release/examples/verbs-pingpong" "$OUT/"
fi
# valgrind's launcher and tools (the guest runs the same Debian release as the host's image)
cp "$(dirname "$(readlink -f "$(command -v valgrind)")")/valgrind.bin" "$OUT/vg/" 2>/dev/null \
  || cp "$(readlink -f "$(command -v valgrind)")" "$OUT/vg/valgrind.bin"
cp -r /usr/libexec/valgrind "$OUT/vg/lib"

cat > "$OUT/guest.sh" <<'EOF'
#!/bin/bash
# in the guest: each program twice under callgrind, a short and a long run; the difference is
# the per-call work
declare -A IP=([rxe0]=10.99.0.1 [siw0]=10.99.1.1)
export VALGRIND_LIB=$PWD/vg/lib
VG=(./vg/valgrind.bin --tool=callgrind --dump-instr=yes --compress-pos=no --compress-strings=no)
port=31000
up() { for _ in $(seq 600); do grep -q "serving on" "$1" && return 0; sleep 0.1; done; return 1; }
# stops a server under callgrind: SIGINT first (callgrind writes its output as the process
# ends), SIGTERM if it is still there after 10 s
stop() { kill -INT "$1" 2>/dev/null; for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
         kill "$1" 2>/dev/null; wait "$1" 2>/dev/null; }
calls() { awk '/bytes +calls/ {on=1; next} on && NF == 7 {print $2}' "$1"; }
for d in $DEVICES; do
  for t in 2 8; do
    # rdma-rpc, busy-poll small call (as scripts/rdma-test.sh runs it), the client under
    # callgrind, then the server
    port=$((port+1)); ep="rdma://${IP[$d]}:$port?device=$d&busy_poll_us=2000&poll_burst_us=200"
    ./rpc-perf --server --runtime current --endpoint "$ep" > srv.log 2>&1 & srv=$!
    up srv.log
    timeout 600 "${VG[@]}" --callgrind-out-file=cg/rpc-client-$d-$t.out ./rpc-perf --client \
      --endpoint "$ep" --runtime current --op echo --sizes 0 --concurrency 1 --duration $t \
      --warmup 0 > cli.log 2> cli.err
    echo "rpc-client $d $t $(calls cli.log)" >> cg/calls.txt
    kill $srv; wait $srv 2>/dev/null
    port=$((port+1)); ep="rdma://${IP[$d]}:$port?device=$d&busy_poll_us=2000&poll_burst_us=200"
    "${VG[@]}" --callgrind-out-file=cg/rpc-server-$d-$t.out ./rpc-perf --server --runtime current \
      --endpoint "$ep" > srv.log 2>&1 & srv=$!
    up srv.log
    timeout 600 ./rpc-perf --client --endpoint "$ep" --runtime current --op echo --sizes 0 \
      --concurrency 1 --duration $t --warmup 0 > cli.log 2> cli.err
    echo "rpc-server $d $t $(calls cli.log)" >> cg/calls.txt
    stop $srv
  done
  [ "$FLOOR" = 1 ] || continue
  for n in 2000 4000; do
    # the connection layer's ping-pong (n rounds after a warm-up of n/10), and its lean loops
    # (--lean; with --borrow, each message borrowed from its slot: the connection layer's floor)
    for mode in vpp vpp-lean vpp-lean-borrow; do
      lean=()
      case $mode in vpp-lean) lean=(--lean);; vpp-lean-borrow) lean=(--lean --borrow);; esac
      for side in client server; do
        port=$((port+1))
        a=(--runtime current --addr "${IP[$d]}:$port" --device "$d" --busy-poll-us 2000 "${lean[@]}")
        if [ $side = server ]; then
          "${VG[@]}" --callgrind-out-file=cg/$mode-server-$d-$n.out ./verbs-pingpong --server "${a[@]}" > vs.log 2>&1 & srv=$!
          up vs.log
          timeout 600 ./verbs-pingpong --client "${a[@]}" --rounds $n > vc.log 2>&1
          stop $srv
        else
          ./verbs-pingpong --server "${a[@]}" > vs.log 2>&1 & srv=$!
          up vs.log
          timeout 600 "${VG[@]}" --callgrind-out-file=cg/$mode-client-$d-$n.out ./verbs-pingpong --client "${a[@]}" --rounds $n > vc.log 2>&1
          kill $srv; wait $srv 2>/dev/null
        fi
        echo "$mode-$side $d $n $((n + n / 10))" >> cg/calls.txt
      done
    done
  done
done
EOF

bash "$VM/run-guest.sh" --share "$OUT" --timeout 1800 -- env DEVICES="$DEVICES" FLOOR="$FLOOR" bash guest.sh

rc=0
for d in $DEVICES; do
  whats=(rpc-client rpc-server)
  [ "$FLOOR" = 1 ] && whats+=(vpp-client vpp-server vpp-lean-client vpp-lean-server
    vpp-lean-borrow-client vpp-lean-borrow-server)
  for what in "${whats[@]}"; do
    # the pair of runs, the one with fewer calls first (under callgrind the rate varies)
    read -r s short l long < <(awk -v w="$what" -v d="$d" '$1 == w && $2 == d {print $4, $3}' \
      "$OUT/cg/calls.txt" | sort -n | awk '{printf "%s %s ", $2, $1} END {print ""}') || true
    a="$OUT/cg/$what-$d-${s:-x}.out" b="$OUT/cg/$what-$d-${l:-x}.out"
    echo "=================== $what on $d"
    if [ -z "${long:-}" ] || [ "$long" -le $(( ${short:-0} * 5 / 4 )) ] || [ ! -s "$a" ] || [ ! -s "$b" ]; then
      echo "rdma-footprint: no usable pair of runs for $what on $d (calls: '${short:-}' '${long:-}')"; rc=1; continue
    fi
    # rpc-perf's two runs last $s and $l seconds: calls made at rates far apart took different
    # paths (how often a spin found its completion), so their difference is not the per-call work
    case $what in rpc-*)
      if [ $(( long * s * 2 )) -gt $(( short * l * 3 )) ] || [ $(( long * s * 3 )) -lt $(( short * l * 2 )) ]; then
        echo "rdma-footprint: no usable pair of runs for $what on $d: $short calls in $s s and $long in $l s, rates more than 1.5x apart"
        rc=1; continue
      fi;;
    esac
    python3 "$ROOT/scripts/callgrind-footprint.py" "$a" "$b" $((long - short)) 20
  done
done
exit $rc
