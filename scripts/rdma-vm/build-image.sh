#!/bin/bash
# Build (once, cached) the Debian bookworm guest that runs rdma-rpc's RDMA tests on software RDMA
# devices: Soft-RoCE (rdma_rxe, in Debian's kernel) and soft-iWARP (siw, built here out of tree,
# since Debian's kernels do not ship it).
#
#   $RDMA_VM_DIR/rootfs/      debootstrapped bookworm (kernel, rdma-core, perftest); the guest's 9p root
#   $RDMA_VM_DIR/initrd.gz    busybox initramfs: loads virtio/9p modules, switch_roots into rootfs/
#   $RDMA_VM_DIR/logs/        full logs of every step (only their tails are printed on failure)
#
# Idempotent: a step whose output exists (and whose recipe did not change) is skipped; the small
# last steps (guest init, initramfs) are redone on every run, in about a second.
# Needs root and apt (the host is Debian bookworm; the guest is debootstrapped from the host's mirror).
# Env: RDMA_VM_DIR (default /var/cache/rdma-rpc-vm), RDMA_VM_MIRROR (default: the host apt's Debian mirror)
set -euo pipefail

VM_DIR=${RDMA_VM_DIR:-/var/cache/rdma-rpc-vm}
SUITE=bookworm
GUEST_PKGS=linux-image-amd64,rdma-core,ibverbs-providers,libibverbs1,librdmacm1,ibverbs-utils,rdmacm-utils,perftest,iproute2,kmod,procps
HOST_PKGS=(qemu-system-x86 debootstrap busybox-static cpio make xz-utils)

T0=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
say() { echo "build-image: [$(( $(date +%s) - T0 ))s] $*"; }
die() { echo "build-image: ERROR: $*" >&2; exit 1; }
# logged LOGNAME CMD...: run CMD with its output in $VM_DIR/logs/LOGNAME.log; on failure print its tail
logged() {
  local log="$VM_DIR/logs/$1.log"; shift
  if ! "$@" >"$log" 2>&1; then
    echo "build-image: FAILED: $* (last lines of $log follow)" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot, apt-get)"
command -v apt-get >/dev/null || die "needs a Debian host with apt-get"
mkdir -p "$VM_DIR/logs"
cd "$VM_DIR"

# One build at a time (CI and a developer, or two checkouts, may share the cache).
exec 9>"$VM_DIR/.lock"
flock -w 3600 9 || die "timed out waiting for the lock on $VM_DIR/.lock"

APT_UPDATED=0
apt_install() { # apt_install PKG...: install the missing ones, quietly
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ $APT_UPDATED = 0 ]; then
    say "apt-get update"
    logged apt-update apt-get -o DPkg::Lock::Timeout=600 update
    APT_UPDATED=1
  fi
  say "installing host packages: ${missing[*]}"
  logged "apt-install-${missing[0]}" \
    apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "${missing[@]}"
}

# ---- 1. host tools
apt_install "${HOST_PKGS[@]}"

# ---- 2. guest root filesystem (the slow step, ~2 min)
MIRROR=${RDMA_VM_MIRROR:-}
if [ -z "$MIRROR" ]; then # the first non-security Debian mirror of the host's apt (deb822 or one-line format)
  MIRROR=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
             | awk '/^URIs:/ && $2 ~ /debian/ && $2 !~ /security/ {print $2; exit}')
fi
if [ -z "$MIRROR" ]; then
  MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
             | awk '$1 == "deb" && $0 ~ /debian/ && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}')
fi
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ROOTFS_STAMP="$SUITE $GUEST_PKGS"
if [ ! -e rootfs/.rdma-vm-rootfs ] || [ "$(cat rootfs/.rdma-vm-rootfs)" != "$ROOTFS_STAMP" ]; then
  say "debootstrap $SUITE (minbase + kernel, rdma-core, perftest) from $MIRROR; log: $VM_DIR/logs/debootstrap.log"
  rm -rf rootfs rootfs.tmp
  logged debootstrap debootstrap --variant=minbase --include="$GUEST_PKGS" "$SUITE" rootfs.tmp "$MIRROR"
  rm -f rootfs.tmp/var/cache/apt/archives/*.deb
  echo "$ROOTFS_STAMP" > rootfs.tmp/.rdma-vm-rootfs
  mv rootfs.tmp rootfs
  say "rootfs ready ($(du -sm rootfs | cut -f1) MB)"
else
  say "rootfs cached"
fi
KV=$(ls rootfs/lib/modules | sort -V | tail -n 1)
[ -n "$KV" ] && [ -e "rootfs/boot/vmlinuz-$KV" ] || die "no kernel in $VM_DIR/rootfs"

# ---- 3. soft-iWARP module, built out of tree from the linux-source package of the guest kernel's
#         exact version, against the matching linux-headers package (installed on the host)
SIW_KO="rootfs/lib/modules/$KV/updates/siw.ko"
if [ ! -e "$SIW_KO" ]; then
  KPKG_VER=$(chroot rootfs dpkg-query -W -f='${Version}' "linux-image-$KV")
  SRCPKG=linux-source-$(echo "$KV" | cut -d. -f1,2)          # e.g. linux-source-6.1
  say "building siw.ko for $KV ($SRCPKG $KPKG_VER)"
  apt_install "linux-headers-$KV"
  [ -d "/usr/src/linux-headers-$KV" ] || die "linux-headers-$KV did not install /usr/src/linux-headers-$KV"
  rm -rf siwbuild && mkdir siwbuild
  if ! (cd siwbuild && apt-get download "$SRCPKG=$KPKG_VER" >"$VM_DIR/logs/siw-download.log" 2>&1); then
    # the lists may predate the guest's kernel: refresh them once and retry
    logged apt-update apt-get -o DPkg::Lock::Timeout=600 update; APT_UPDATED=1
    (cd siwbuild && logged siw-download apt-get download "$SRCPKG=$KPKG_VER")
  fi
  dpkg-deb --fsys-tarfile siwbuild/"${SRCPKG}"_*.deb | tar -xO "./usr/src/$SRCPKG.tar.xz" \
    | tar -xJ -C siwbuild --strip-components=4 "$SRCPKG/drivers/infiniband/sw/siw"
  logged siw-make make -C "/usr/src/linux-headers-$KV" M="$VM_DIR/siwbuild/siw" CONFIG_RDMA_SIW=m modules
  mkdir -p "$(dirname "$SIW_KO")"
  strip --strip-debug -o "$SIW_KO.tmp" siwbuild/siw/siw.ko
  mv "$SIW_KO.tmp" "$SIW_KO"
  logged depmod chroot rootfs depmod -a "$KV"
  rm -rf siwbuild
  say "siw.ko installed"
else
  say "siw.ko cached"
fi

# ---- 4. guest PID 1 (stage 2, runs from the 9p root). It mounts the share (tag "share") at
#         /mnt/share, runs /mnt/share/.rdma-vm/guest-main.sh (written by run-guest.sh) with bash,
#         writes its exit status to /mnt/share/.rdma-vm/status and powers off.
say "writing guest init and initramfs"
mkdir -p rootfs/usr/local/sbin rootfs/mnt/share
cat > rootfs/usr/local/sbin/rdma-vm-init.tmp <<'GEOF'
#!/bin/bash
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
mount -t proc proc /proc; mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null; mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp; mount -t tmpfs tmpfs /run
hostname rdma-vm
ip link set lo up
ulimit -l unlimited   # memory registration pins pages
ulimit -c 0
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none share /mnt/share; then
  echo "rdma-vm: guest up after $(cut -d' ' -f1 /proc/uptime)s, kernel $(uname -r)"
  cd /mnt/share
  if [ -f /mnt/share/.rdma-vm/guest-main.sh ]; then
    bash /mnt/share/.rdma-vm/guest-main.sh </dev/null
    rc=$?
  else
    echo "rdma-vm: /mnt/share/.rdma-vm/guest-main.sh missing: interactive shell"
    bash -i </dev/console >/dev/console 2>&1; rc=$?
  fi
  echo "$rc" > /mnt/share/.rdma-vm/status.tmp && mv /mnt/share/.rdma-vm/status.tmp /mnt/share/.rdma-vm/status
  cd /
  sync
  umount /mnt/share
else
  echo "rdma-vm: cannot mount the share"
fi
echo "rdma-vm: powering off after $(cut -d' ' -f1 /proc/uptime)s"
echo o > /proc/sysrq-trigger
sleep 30
GEOF
chmod +x rootfs/usr/local/sbin/rdma-vm-init.tmp
mv rootfs/usr/local/sbin/rdma-vm-init.tmp rootfs/usr/local/sbin/rdma-vm-init

# ---- 5. stage 1: busybox initramfs that loads the virtio/9p modules and mounts the 9p root
rm -rf initramfs && mkdir -p initramfs/{bin,dev,proc,sys,newroot,lib/modules}
cp /bin/busybox initramfs/bin/busybox
for m in virtio_pci 9pnet_virtio 9p; do
  chroot rootfs modprobe -S "$KV" --show-depends "$m" | awk '/^insmod/ {print $2}'
done | awk '!seen[$0]++' > initramfs/modules.list
[ -s initramfs/modules.list ] || die "could not resolve the virtio/9p modules of $KV"
while read -r p; do cp "rootfs$p" initramfs/lib/modules/; done < initramfs/modules.list
cat > initramfs/init <<'IEOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
while read -r p; do insmod "/lib/modules/${p##*/}"; done < /modules.list
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose root /newroot; then
  echo "rdma-vm: 9p root mount failed"; echo o > /proc/sysrq-trigger; sleep 30
fi
umount /proc /sys /dev
exec switch_root /newroot /usr/local/sbin/rdma-vm-init
IEOF
chmod +x initramfs/init
(cd initramfs && find . | cpio -o -H newc --quiet | gzip -1) > initrd.gz.tmp
mv initrd.gz.tmp initrd.gz
echo "$KV" > kernel-version
say "done: guest kernel $KV, image in $VM_DIR"
