#!/usr/bin/env bash
# Install a working CRIU 4.x into a private prefix on Debian 12 (bookworm) or a Dockerfile built
# on it, without touching the system's apt configuration or its libc.
#
#   sudo infra/install-criu.sh                  # -> /opt/snapfn-criu/bin/criu
#   infra/install-criu.sh --prefix DIR [--force] [--capabilities]
#
# Why: bookworm's criu 3.17 fails on 6.x kernels ("Unexpected rt vDSO area bounds"); Debian 13
# (trixie) ships criu 4.1.1, which needs glibc >= 2.38. So this script downloads trixie's `criu`
# .deb and its whole dependency closure (libc6 included) with `apt-get download` against a private
# trixie sources list (every apt state path pointed into a temporary directory), unpacks them under
# $PREFIX/root, and writes $PREFIX/bin/criu: a wrapper that runs the real binary through trixie's
# own loader (`ld-linux --library-path`), so the host keeps its glibc and nothing else sees the
# trixie libraries. Only the criu process itself uses them; what it executes (iptables, ip, …)
# runs with the host's libraries.
#
# --capabilities (as root; what infra/Dockerfile runs): $PREFIX/bin/criu is then the criu binary
# itself, its loader and library path written into it (trixie's patchelf), carrying the file
# capabilities CAP_SYS_ADMIN, CAP_SYS_PTRACE and CAP_SETPCAP, so that a non-root user whose
# container grants those three runs criu --unprivileged (docs/deploy.md). All three: the kernel
# refuses to run a binary whose file capabilities the bounding set would cut (EPERM).
# The prefix is then no longer relocatable: it must stay at $PREFIX.
#
# Idempotent: a prefix whose criu already reports the wanted major version is left alone unless
# --force. Environment: SNAPFN_CRIU_PREFIX (default /opt/snapfn-criu), SNAPFN_CRIU_MIRROR
# (default: the host's Debian mirror, else http://deb.debian.org/debian), SNAPFN_CRIU_SUITE
# (default trixie), SNAPFN_CRIU_KEYRING (default Debian's archive keyring).
set -euo pipefail

prefix=${SNAPFN_CRIU_PREFIX:-/opt/snapfn-criu}
suite=${SNAPFN_CRIU_SUITE:-trixie}
keyring=${SNAPFN_CRIU_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
mirror=${SNAPFN_CRIU_MIRROR:-}
want_major=4
force=0
capabilities=0

say() { echo "install-criu: $*"; }
die() {
    echo "install-criu: error: $*" >&2
    exit 1
}

while [ $# -gt 0 ]; do
    case $1 in
    --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
    --prefix=*) prefix=${1#--prefix=}; shift ;;
    --force) force=1; shift ;;
    --capabilities) capabilities=1; shift ;;
    -h | --help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (try --help)" ;;
    esac
done
case $prefix in /*) ;; *) prefix=$PWD/$prefix ;; esac

start_s=$(date +%s.%N)
elapsed() { awk -v a="$start_s" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# 1. already there?
if [ "$force" = 0 ] && [ -x "$prefix/bin/criu" ]; then
    have=$("$prefix/bin/criu" --version 2>/dev/null | sed -n 's/^Version: *//p' || true)
    if [ "${have%%.*}" = "$want_major" ]; then
        say "criu $have already installed at $prefix/bin/criu (--force reinstalls)"
        exit 0
    fi
    say "found '$prefix/bin/criu' reporting '${have:-nothing}'; reinstalling"
fi

# 2. what this needs from the host
for tool in apt-get apt-cache dpkg-deb dpkg awk; do
    command -v "$tool" >/dev/null || die "'$tool' not found: this script needs a Debian-based host"
done
arch=$(dpkg --print-architecture)
case $arch in
amd64) triplet=x86_64-linux-gnu loader=ld-linux-x86-64.so.2 ;;
arm64) triplet=aarch64-linux-gnu loader=ld-linux-aarch64.so.1 ;;
*) die "architecture '$arch' is not supported (amd64 or arm64)" ;;
esac
[ -r "$keyring" ] || die "Debian archive keyring '$keyring' not readable
  (apt-get install debian-archive-keyring, or set SNAPFN_CRIU_KEYRING)"
if [ -z "$mirror" ]; then
    mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null | grep -v '^ *#' |
        grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n 1 | tr -d ' ' || true)
    mirror=${mirror%/}
    mirror=${mirror:-http://deb.debian.org/debian}
fi
mkdir -p "$prefix" 2>/dev/null && [ -w "$prefix" ] ||
    die "cannot write to '$prefix' (run as root or pass --prefix)"

# 3. a private apt: its own sources list, package lists, cache and (empty) dpkg status
work=$(mktemp -d "${TMPDIR:-/tmp}/snapfn-criu.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/etc/sources.list.d" "$work/etc/preferences.d" "$work/lists/partial" \
    "$work/cache/archives/partial" "$work/debs"
echo "deb [signed-by=$keyring] $mirror $suite main" >"$work/etc/sources.list"
: >"$work/status"
apt_opts=(
    -o "Dir::Etc::SourceList=$work/etc/sources.list"
    -o "Dir::Etc::SourceParts=$work/etc/sources.list.d"
    -o "Dir::Etc::Preferences=$work/etc/preferences"
    -o "Dir::Etc::PreferencesParts=$work/etc/preferences.d"
    -o "Dir::State::Lists=$work/lists"
    -o "Dir::State::status=$work/status"
    -o "Dir::Cache=$work/cache"
    -o "APT::Architecture=$arch"
    -o "APT::Sandbox::User=root"
)
say "reading $suite package lists from $mirror (private apt dir $work)"
apt-get "${apt_opts[@]}" -q update >"$work/update.log" 2>&1 ||
    die "apt-get update against '$mirror $suite' failed (SNAPFN_CRIU_MIRROR picks another" \
        "mirror): $(grep -E '^(E|W):' "$work/update.log" | head -n 2 | tr '\n' ' ')"

# the dependency closure of criu (Depends + Pre-Depends only; virtual packages skipped), and of
# the two tools --capabilities runs
wanted=(criu)
[ "$capabilities" = 0 ] || wanted+=(patchelf libcap2-bin)
mapfile -t packages < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends \
    --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances "${wanted[@]}" 2>/dev/null |
    grep -E '^[a-z0-9]' | sort -u)
[[ " ${packages[*]} " == *" criu "* && " ${packages[*]} " == *" libc6 "* ]] ||
    die "could not resolve criu's dependencies in $suite (got: ${packages[*]:-nothing})"
version=$(apt-cache "${apt_opts[@]}" show criu | sed -n 's/^Version: *//p' | head -n 1)
[ "${version%%.*}" = "$want_major" ] || die "$suite offers criu '$version', not $want_major.x"

say "downloading criu $version and ${#packages[@]} packages: ${packages[*]}"
(cd "$work/debs" && apt-get "${apt_opts[@]}" -q download "${packages[@]}" >"$work/download.log" 2>&1) ||
    die "apt-get download failed: $(grep -E '^(E|W):' "$work/download.log" | head -n 2 | tr '\n' ' ')"

# 4. unpack into a fresh tree next to the old one, then swap it in
rm -rf "$prefix/root.new"
mkdir -p "$prefix/root.new"
for deb in "$work"/debs/*.deb; do
    dpkg-deb -x "$deb" "$prefix/root.new"
done
root=$prefix/root
libdirs='$root'/usr/lib/$triplet # expanded by the wrapper, not here
if [ -d "$prefix/root.new/lib/$triplet" ] && [ ! -L "$prefix/root.new/lib" ]; then
    libdirs=$libdirs:'$root'/lib/$triplet
fi
[ -x "$prefix/root.new/usr/lib/$triplet/$loader" ] || die "trixie's libc6 has no $loader"
[ -x "$prefix/root.new/usr/sbin/criu" ] || die "the criu package has no usr/sbin/criu"
rm -rf "$prefix/root.old"
[ -e "$root" ] && mv "$root" "$prefix/root.old"
mv "$prefix/root.new" "$root"
rm -rf "$prefix/root.old"
(cd "$work/debs" && ls) >"$prefix/packages.txt"

# 5. the wrapper: the real binary through trixie's loader (`--argv0`: criu sees itself as criu).
#    It finds root/ beside its own bin/ (symlinks resolved), so the prefix can be copied
#    elsewhere, e.g. from one Docker build stage to another.
mkdir -p "$prefix/bin"
cat >"$prefix/bin/criu.tmp" <<EOF
#!/bin/sh
# Written by snapfn's infra/install-criu.sh: Debian $suite criu $version, run through $suite's
# own glibc loader so that the host's libc is untouched. Packages: ../packages.txt
root=\$(dirname "\$(dirname "\$(readlink -f "\$0")")")/root
exec "\$root/usr/lib/$triplet/$loader" --argv0 criu --library-path "$libdirs" \\
    "\$root/usr/sbin/criu" "\$@"
EOF
chmod 755 "$prefix/bin/criu.tmp"
if [ "$capabilities" = 1 ]; then
    # the binary itself, so that its file capabilities apply (a capability on a script or on a
    # loader that runs it would not, or would apply to anything that loader runs)
    libpath=$root/usr/lib/$triplet
    [ ! -d "$root/lib/$triplet" ] || [ -L "$root/lib" ] || libpath=$libpath:$root/lib/$triplet
    private() { "$root/usr/lib/$triplet/$loader" --library-path "$libpath" "$@"; }
    cp "$root/usr/sbin/criu" "$prefix/bin/criu.tmp"
    # NOTE: --force-rpath: DT_RPATH covers the libraries' own dependencies too (RUNPATH would not)
    private "$root/usr/bin/patchelf" --set-interpreter "$root/usr/lib/$triplet/$loader" --force-rpath \
        --set-rpath "$libpath" "$prefix/bin/criu.tmp" || die "patchelf failed"
    # criu-setcap: (re)apply the capabilities, e.g. after a Dockerfile's COPY --from, which
    # need not keep extended attributes
    cat >"$prefix/bin/criu-setcap" <<EOF
#!/bin/sh
# Written by snapfn's infra/install-criu.sh: give $prefix/bin/criu the capabilities an
# unprivileged criu needs (run as root), with $suite's own setcap and getcap.
set -e
run() { "$root/usr/lib/$triplet/$loader" --library-path "$libpath" "\$@"; }
run "$root/usr/sbin/setcap" cap_sys_admin,cap_sys_ptrace,cap_setpcap+ep "\${1:-$prefix/bin/criu}"
run "$root/usr/sbin/getcap" "\${1:-$prefix/bin/criu}"
EOF
    chmod 755 "$prefix/bin/criu-setcap"
    caps=$("$prefix/bin/criu-setcap" "$prefix/bin/criu.tmp") || die "setcap failed (run as root)"
    say "criu carries the file capabilities: $caps"
fi
mv "$prefix/bin/criu.tmp" "$prefix/bin/criu"

have=$("$prefix/bin/criu" --version 2>&1 | sed -n 's/^Version: *//p' || true)
[ "${have%%.*}" = "$want_major" ] ||
    die "the installed wrapper does not run: $("$prefix/bin/criu" --version 2>&1 | head -n 1)"
say "installed criu $have at $prefix/bin/criu ($(du -sh "$root" | cut -f1) under $root) in $(elapsed) s"

# 6. whether this kernel and these privileges let it work (informational: a `docker build` step
#    lacks the capabilities criu needs, yet the install is fine)
if check=$("$prefix/bin/criu" check 2>&1); then
    say "criu check: ok"
else
    say "criu check failed here (needs root + CAP_SYS_ADMIN at run time):" \
        "$(echo "$check" | grep -v '^Warn' | tr '\n' ' ')"
fi
