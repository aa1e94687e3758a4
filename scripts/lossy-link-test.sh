#!/bin/bash
# rdma-rpc over a slow, lossy link (issue 5): calls complete with the right bytes or fail as
# their deadlines say (or with a clear connection error); none hangs, none returns wrong data.
#
# The host's kernel has no sch_netem, so this runs in the project's QEMU guest (Debian's kernel,
# scripts/rdma-vm/): it builds examples/lossy-link.rs on the host (release, default features,
# so with RDMA), boots the guest with the binary shared in, and there:
#   - TCP and soft-iWARP: network namespaces `srv` and `cli` joined by a veth pair
#     (veth-s 10.98.0.1/24 in srv, veth-c 10.98.0.2/24 in cli) with `tc netem` on both ends;
#     siw devices siw_s/siw_c on the two ends; the server runs in srv, the driver in cli;
#   - Soft-RoCE: Debian 6.1's rdma_rxe has no network-namespace support (its UDP socket and
#     its route lookups are in the initial namespace only: rdma_cm across namespaces answers
#     RDMA_CM_EVENT_UNREACHABLE), so its veth pair (veth-xs 10.98.2.1, veth-xc 10.98.2.2) stays
#     in the initial namespace, and policy routing (local table moved behind rules for
#     locally generated traffic, static neighbours, accept_local) sends traffic between the
#     two local addresses across the veth, through netem, instead of through `lo`; rxe devices
#     rxe_xs/rxe_xc on the two ends;
#   - on each of the three, the server (`lossy-link --serve`) and the driver (`--connect`, mixed
#     0 B..4 MiB calls both ways, every byte checked, generous and tight deadlines) for
#     LOSSY_SECS seconds; the driver's own watchdog, `timeout` around it and the guest's hard
#     timeout bound everything.
# Prints a summary (netem settings, per transport: calls ok / deadline exceeded / connection
# errors / wrong data / late / hung, and what netem dropped) and exits non-zero on any wrong
# answer, other error, late or hung call, a server that found a wrong request or died, a run
# with no successful call, or a setup failure.
#
# Usage: scripts/lossy-link-test.sh
# Env: LOSSY_SECS (seconds of calls per transport, default 20), LOSSY_TRANSPORTS (default
#      "tcp siw rxe"), LOSSY_NETEM (netem for TCP and siw, default below), LOSSY_NETEM_RXE
#      (netem for rxe), LOSSY_CLIENT_ARGS (driver arguments, default below),
#      LOSSY_CLIENT_ARGS_RXE (more driver arguments on rxe, default none), LOSSY_RXE_OPTS (more
#      endpoint options for both rxe ends, default none), CARGO_TARGET_DIR,
#      LOSSY_OUT (shared folder, default $CARGO_TARGET_DIR/lossy-link-test), LOSSY_TIMEOUT
#      (guest hard timeout, s, default 900), RDMA_VM_DIR (image cache). RUST_LOG is passed on.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VM="$ROOT/scripts/rdma-vm"
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
OUT=${LOSSY_OUT:-$TARGET_DIR/lossy-link-test}
SECS=${LOSSY_SECS:-20}
TRANSPORTS=${LOSSY_TRANSPORTS:-tcp siw rxe}
# Both directions get this (it applies on each veth end's egress). Jitter reorders packets.
NETEM=${LOSSY_NETEM:-delay 10ms 2ms loss 1% duplicate 0.5% corrupt 0.1% limit 20000}
# RoCE RC has go-back-N recovery (a lost or reordered packet costs the rest of the window, a
# lost tail a retransmission timeout), so rxe gets a gentler link: no jitter, a fifth of the loss.
# Measured in this guest with perftest at 10 ms delay and 1 % loss each way: ib_send_lat's
# rdma_cm connect failed, ib_write_bw (200 x 64 KiB) and ib_read_bw (100 x 1 MiB) did not finish
# in 35 s, ib_read_bw 64 KiB ran at 0.86 MB/s: rxe's retransmission timeouts dominate. Soft-RoCE
# drops every READ response packet after a missing one and asks again only when the queue
# pair's local ACK timeout runs out; with rdma_cm's (2.1 s) one 3 MiB call could hold a
# connection for 20 s. rdma-rpc's default, ~67 ms (RdmaOptions::ack_timeout), carried 62-69
# calls in 20 s over this link (docs/rdma-history.md, "A lossy RoCE link").
NETEM_RXE=${LOSSY_NETEM_RXE:-delay 5ms loss 0.2% duplicate 0.2% reorder 0.5% corrupt 0.05% limit 20000}
# The link is shared by the callers: few of them, and deadlines that allow for that.
CLIENT_ARGS=${LOSSY_CLIENT_ARGS:---concurrency 4 --deadline-ms 3000 --deadline-rate 0.15}
CLIENT_ARGS_RXE=${LOSSY_CLIENT_ARGS_RXE:-}
# more endpoint options for both rxe ends (e.g. ack_timeout_ms=0 for rdma_cm's timeout)
RXE_OPTS=${LOSSY_RXE_OPTS:-}
case "${1:-}" in -h|--help) sed -n '2,34p' "$0"; exit 0 ;; "") ;; *) echo "lossy-link-test: unknown argument $1" >&2; exit 2 ;; esac
T0=$(date +%s)
say() { echo "lossy-link-test: [$(( $(date +%s) - T0 ))s] $*"; }

# ---- 1. build dependencies, guest image, the example
bash "$ROOT/scripts/install-build-deps.sh"
bash "$VM/build-image.sh"
rm -rf "$OUT"
mkdir -p "$OUT/logs"
say "building examples/lossy-link.rs (release)"
if ! cargo build --manifest-path "$ROOT/Cargo.toml" --release --example lossy-link \
       --message-format=json-render-diagnostics >"$OUT/logs/build.json" 2>"$OUT/logs/build.log"; then
  echo "lossy-link-test: building the example FAILED; last lines of $OUT/logs/build.log:" >&2
  tail -n 40 "$OUT/logs/build.log" >&2
  exit 1
fi
exe=$(grep '"reason":"compiler-artifact"' "$OUT/logs/build.json" | grep '"kind":\["example"\]' \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
[ -n "$exe" ] || { echo "lossy-link-test: no executable for the example" >&2; exit 1; }
cp "$exe" "$OUT/lossy-link"

# ---- 2. what runs in the guest
{
  printf 'SECS=%q\nTRANSPORTS=%q\nNETEM=%q\nNETEM_RXE=%q\nCLIENT_ARGS=%q\nCLIENT_ARGS_RXE=%q\nRXE_OPTS=%q\n' \
    "$SECS" "$TRANSPORTS" "$NETEM" "$NETEM_RXE" "$CLIENT_ARGS" "$CLIENT_ARGS_RXE" "$RXE_OPTS"
  [ -n "${RUST_LOG:-}" ] && printf 'export RUST_LOG=%q\n' "$RUST_LOG"
} > "$OUT/guest-env.sh"
cat > "$OUT/guest-lossy.sh" <<'GEOF'
#!/bin/bash
# runs in the guest, from the share (/mnt/share); written by scripts/lossy-link-test.sh
cd /mnt/share
. ./guest-env.sh
SUM=/mnt/share/summary.txt; : > "$SUM"
FAILED=0; PASSED=0; PROBLEMS=0
note() { echo "$*" | tee -a "$SUM"; }
problem() { note "FAIL: $*"; PROBLEMS=$((PROBLEMS+1)); }
try() { "$@" || { problem "setup: $*"; return 1; }; }
NS_S="ip netns exec srv"; NS_C="ip netns exec cli"

# -- the namespaced link (TCP, siw)
setup_ns() {
  try modprobe veth && try modprobe sch_netem || return 1
  try ip netns add srv && try ip netns add cli || return 1
  try ip -n srv link set lo up; try ip -n cli link set lo up
  try ip link add veth-s type veth peer name veth-c || return 1
  try ip link set veth-s netns srv && try ip link set veth-c netns cli || return 1
  try ip -n srv addr add 10.98.0.1/24 dev veth-s && try ip -n srv link set veth-s up || return 1
  try ip -n cli addr add 10.98.0.2/24 dev veth-c && try ip -n cli link set veth-c up || return 1
  # per-packet loss for TCP rather than per 64 KiB GSO chunk (best effort)
  ip -n srv link set veth-s gso_max_size 1500 2>/dev/null || true
  ip -n cli link set veth-c gso_max_size 1500 2>/dev/null || true
}
# -- the initial-namespace link for rxe (see the host script's header)
setup_rxe_link() {
  try modprobe veth && try modprobe sch_netem && try modprobe rdma_rxe || return 1
  try sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0 \
      net.ipv4.conf.all.accept_local=1 net.ipv4.conf.default.accept_local=1 || return 1
  try ip link add veth-xs type veth peer name veth-xc || return 1
  try ip addr add 10.98.2.1/24 dev veth-xs && try ip addr add 10.98.2.2/24 dev veth-xc || return 1
  local d
  for d in veth-xs veth-xc; do
    try sysctl -qw net.ipv4.conf.$d.rp_filter=0 net.ipv4.conf.$d.accept_local=1 && try ip link set $d up || return 1
  done
  try ip neigh replace 10.98.2.2 lladdr "$(cat /sys/class/net/veth-xc/address)" dev veth-xs nud permanent || return 1
  try ip neigh replace 10.98.2.1 lladdr "$(cat /sys/class/net/veth-xs/address)" dev veth-xc nud permanent || return 1
  # local delivery after the rules that send locally generated traffic to the peer's address out
  try ip rule add pref 1000 lookup local && try ip rule del pref 0 lookup local || return 1
  try ip route add 10.98.2.2 dev veth-xs src 10.98.2.1 table 100 || return 1
  try ip route add 10.98.2.1 dev veth-xc src 10.98.2.2 table 101 || return 1
  try ip rule add pref 100 iif lo to 10.98.2.2 lookup 100 && try ip rule add pref 101 iif lo to 10.98.2.1 lookup 101 || return 1
  local r; r=$(ip route get 10.98.2.1 2>&1)
  [[ "$r" == *"dev veth-xc"* ]] || { problem "setup: 10.98.2.1 is not routed over veth-xc: $r"; return 1; }
}
# netem_on NS_PREFIX DEV SPEC: fresh qdisc (so its counters are this run's)
netem_on() {
  $1 tc qdisc del dev "$2" root 2>/dev/null
  try $1 tc qdisc add dev "$2" root netem $3
}
# netem_stats NS_PREFIX DEV: "sent N pkt, dropped M"
netem_stats() {
  $1 tc -s qdisc show dev "$2" | awk '/Sent/ {gsub(/[(,]/, " "); print "sent " $4 " pkt, dropped " $7; exit}'
}
now() { date +%s%N; }
el() { local d=$(( ($(now) - $1) / 1000000 )); printf '%d.%03ds' $((d/1000)) $((d%1000)); }

# run NAME SRV_NS CLI_NS SRV_EP CLI_EP DEV_S DEV_C SPEC [DRIVER_ARGS]
run() {
  local name=$1 sns=$2 cns=$3 sep=$4 cep=$5 ds=$6 dc=$7 spec=$8 args="$CLIENT_ARGS ${9:-}" t; t=$(now)
  local slog=logs/$name-server.log clog=logs/$name-client.log
  echo "=================== $name: $cep, netem \"$spec\" on both ends"
  netem_on "$sns" "$ds" "$spec" && netem_on "$cns" "$dc" "$spec" || return
  $sns ./lossy-link --serve --endpoint "$sep" > "$slog" 2>&1 & local sp=$!
  local i up=0
  for i in $(seq 300); do
    grep -q 'serving on' "$slog" && { up=1; break; }
    kill -0 $sp 2>/dev/null || break
    sleep 0.1
  done
  if [ $up = 0 ]; then
    problem "$name: the server did not start"; cat "$slog"; kill -9 $sp 2>/dev/null; wait $sp 2>/dev/null; return
  fi
  # the driver's watchdog fires well before this; this only catches a driver that cannot start
  # shellcheck disable=SC2086
  $cns timeout -k 5 $((SECS + 240)) ./lossy-link --connect --endpoint "$cep" --duration "$SECS" $args > "$clog" 2>&1
  local rc=$?
  grep -v '^lossy-link: \(connection error\|LATE\|WRONG\|HUNG\|OTHER\)' "$clog" | head -n 40
  local sline; sline=$(grep '^LOSSY-SUMMARY' "$clog" | tail -n 1)
  local alive=1; kill -0 $sp 2>/dev/null || alive=0
  kill -TERM $sp 2>/dev/null
  for i in $(seq 100); do kill -0 $sp 2>/dev/null || break; sleep 0.1; done
  local stopped=1; if kill -0 $sp 2>/dev/null; then stopped=0; kill -9 $sp 2>/dev/null; fi
  wait $sp 2>/dev/null
  local srvline; srvline=$(grep '^LOSSY-SERVER' "$slog" | tail -n 1)
  local ok=1
  [ $rc = 0 ] || ok=0
  [ -n "$sline" ] || { ok=0; sline="(no summary: driver exit $rc)"; }
  [ $alive = 1 ] || { ok=0; note "    the server died during the run:"; tail -n 20 "$slog" | sed 's/^/      /' | tee -a "$SUM"; }
  [[ "$srvline" == *"bad_requests=0"* ]] || { [ $alive = 1 ] && [ $stopped = 1 ] && ok=0; }
  if [ $ok = 1 ]; then PASSED=$((PASSED+1)); else FAILED=$((FAILED+1)); fi
  note "$( [ $ok = 1 ] && echo PASS || echo "FAIL (driver exit $rc)" ): $name ($cep), $(el $t)"
  local shown; shown=$(echo $args)
  note "    netem: $spec; driver: --duration $SECS ${shown}"
  note "    ${sline#LOSSY-SUMMARY }"
  note "    server: ${srvline:-(no report)}$( [ $stopped = 1 ] || echo '; did not exit within 10 s of SIGTERM (killed)')"
  note "    netem server->client: $(netem_stats "$sns" "$ds"); client->server: $(netem_stats "$cns" "$dc")"
  grep -E '^lossy-link:   (WRONG|HUNG|LATE|OTHER|connection error)' "$clog" | head -n 5 | sed 's/^lossy-link: */      /' >> "$SUM"
  grep -E 'WARN|ERROR' "$clog" "$slog" | head -n 5 | sed 's/^/      /' >> "$SUM"
  # the RDMA devices' retransmission counters (rxe has them; siw has none)
  local dev st
  for dev in $(printf '%s\n%s\n' "$sep" "$cep" | sed -n 's/.*[?&]device=\([^&]*\).*/\1/p'); do
    st=$(rdma statistic show link "$dev/1" 2>/dev/null | grep -oE '(rcvd_seq_err|out_of_seq_request|duplicate_request|completer_retry_err|retry_exceeded_err) [0-9]+' | tr '\n' ' ')
    [ -z "$st" ] || note "    $dev: $st"
  done
  grep -E 'BAD REQUEST' "$slog" | head -n 5 | sed 's/^/      /' >> "$SUM"
  netem_on "$sns" "$ds" "delay 0ms" >/dev/null; netem_on "$cns" "$dc" "delay 0ms" >/dev/null
}

CEP_OPTS="connect_timeout_ms=30000"
NS_OK=0; RXE_OK=0
if [[ " $TRANSPORTS " == *" tcp "* || " $TRANSPORTS " == *" siw "* ]]; then setup_ns && NS_OK=1; fi
if [[ " $TRANSPORTS " == *" siw "* ]] && [ $NS_OK = 1 ]; then
  try $NS_S rdma link add siw_s type siw netdev veth-s && try $NS_C rdma link add siw_c type siw netdev veth-c || NS_OK=0
fi
if [[ " $TRANSPORTS " == *" rxe "* ]]; then
  setup_rxe_link && try rdma link add rxe_xs type rxe netdev veth-xs && try rdma link add rxe_xc type rxe netdev veth-xc && RXE_OK=1
fi
echo "lossy-link: RDMA links:"; rdma link show | sed 's/^/  /'
for tr in $TRANSPORTS; do
  case $tr in
    tcp) [ $NS_OK = 1 ] && run tcp "$NS_S" "$NS_C" tcp://10.98.0.1:7600 "tcp://10.98.0.1:7600?$CEP_OPTS" veth-s veth-c "$NETEM" ;;
    siw) [ $NS_OK = 1 ] && run siw "$NS_S" "$NS_C" "rdma://10.98.0.1:7601?device=siw_s" \
           "rdma://10.98.0.1:7601?device=siw_c&$CEP_OPTS" veth-s veth-c "$NETEM" ;;
    rxe) [ $RXE_OK = 1 ] && run rxe "" "" "rdma://10.98.2.1:7602?device=rxe_xs${RXE_OPTS:+&$RXE_OPTS}" \
           "rdma://10.98.2.1:7602?device=rxe_xc&$CEP_OPTS${RXE_OPTS:+&$RXE_OPTS}" veth-xs veth-xc "$NETEM_RXE" "$CLIENT_ARGS_RXE" ;;
    *) problem "unknown transport $tr" ;;
  esac
done
if [ $FAILED -gt 0 ] || [ $PROBLEMS -gt 0 ]; then
  echo "===== dmesg (tail)"; dmesg | grep -v 'speed is unknown' | tail -n 30
fi
echo "$PASSED $FAILED $PROBLEMS" > /mnt/share/counts
[ $FAILED = 0 ] && [ $PROBLEMS = 0 ] && [ $PASSED -gt 0 ]
GEOF

say "booting the guest (TCG): transports: $TRANSPORTS, $SECS s each"
set +e
bash "$VM/run-guest.sh" --share "$OUT" --timeout "${LOSSY_TIMEOUT:-900}" -- bash guest-lossy.sh
rc=$?
set -e

echo
echo "===================== lossy-link summary ====================="
cat "$OUT/summary.txt" 2>/dev/null || echo "(no summary: the guest did not get that far)"
read -r PASSED FAILED PROBLEMS < "$OUT/counts" 2>/dev/null || { PASSED=0; FAILED=0; PROBLEMS=1; }
[ "$rc" = 0 ] || [ "$FAILED" -gt 0 ] || [ "$PROBLEMS" -gt 0 ] || FAILED=1
say "guest exit status $rc; logs in $OUT/logs"
echo "lossy-link-test: $PASSED passed, $FAILED failed, $PROBLEMS setup problems"
exit "$rc"
