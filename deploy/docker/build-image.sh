#!/usr/bin/env bash
# Builds the lab's container image from our release binaries, with no registry:
# the binaries, the shared libraries `ldd` lists for them, the dynamic loader,
# `sleep` (the client container's idle command), `iperf3` with its libraries
# when the host has it (Debian's iperf3; .ci/run installs it: the bench agents
# run it to cross-check the network baseline, and say so when it is missing),
# the host's CA bundle (Debian's ca-certificates: the S3 client loads the
# system's root certificates at start and warns "no native root CA
# certificates found!" without them, though the lab is plain HTTP) and an
# empty /tmp, imported as a single-layer image with `docker import`.
#
#   deploy/docker/build-image.sh [--bin-dir DIR] [--tag TAG] [--no-build]
#
#   --bin-dir DIR  where coronafs, lightningstor, plasmavmc and bench are
#                  [default: $CARGO_TARGET_DIR/release or ./target/release]
#   --tag TAG      image name [default: photoncloud-lab:latest]
#   --no-build     do not run `cargo build --release` first
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/../.."

bin_dir="${CARGO_TARGET_DIR:-target}/release"
tag="photoncloud-lab:latest"
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bin-dir) bin_dir="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,17p' "$self"; exit 0 ;;
    *) echo "build-image: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
bins=(coronafs lightningstor plasmavmc bench)
command -v docker >/dev/null || { echo "build-image: docker is not installed" >&2; exit 1; }
if [ "$build" = 1 ]; then
  args=(); for b in "${bins[@]}"; do args+=(-p "$b"); done
  cargo build --release "${args[@]}"
fi

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr/local/bin" "$root/bin" "$root/tmp" "$root/etc" "$root/var/lib"
chmod 1777 "$root/tmp"
files=()
for b in "${bins[@]}"; do
  [ -x "$bin_dir/$b" ] || { echo "build-image: $bin_dir/$b is missing (build with cargo build --release)" >&2; exit 1; }
  cp "$bin_dir/$b" "$root/usr/local/bin/$b"
  # Debug info is most of a release binary's size; the image does not need it.
  if command -v strip >/dev/null; then strip --strip-debug "$root/usr/local/bin/$b"; fi
  files+=("$bin_dir/$b")
done
sleep_bin="$(command -v sleep)"
cp "$sleep_bin" "$root/bin/sleep"
files+=("$sleep_bin")
if iperf3_bin="$(command -v iperf3)"; then
  cp "$iperf3_bin" "$root/bin/iperf3"
  files+=("$iperf3_bin")
else
  echo "build-image: iperf3 is not installed here; the image has none (the agents' baseline goes without its iperf3 cross-check)" >&2
fi
# Every library (and the loader) the binaries link, at the same path as here.
for f in "${files[@]}"; do
  ldd "$f" | awk '/=> \//{print $3} /^\t\//{print $1}'
done | sort -u | while read -r lib; do
  cp -L --parents "$lib" "$root"
done
ca_bundle=/etc/ssl/certs/ca-certificates.crt
if [ -s "$ca_bundle" ]; then
  mkdir -p "$root/etc/ssl/certs"
  cp -L "$ca_bundle" "$root$ca_bundle"
else
  echo "build-image: $ca_bundle is missing here (apt-get install ca-certificates); the services in the image will warn \"no native root CA certificates found!\" at start" >&2
fi
printf 'root:x:0:0:root:/root:/bin/sleep\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"

commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/bin:/bin' \
  --change "ENV BENCH_COMMIT=$commit" \
  --change 'ENV RUST_LOG=info' \
  --change 'WORKDIR /tmp' \
  --message "photoncloud lab image from $commit" \
  - "$tag" >/dev/null
echo "built image $tag ($(du -sh "$root" | cut -f1) of files)"
