#!/usr/bin/env bash
# Runs here, before tools/gpu_check.sh is run on a GPU machine that has no internet
# and may lack Debian's Highway: fills .deps/ with Highway (libhwy-dev, libhwy1),
# GoogleTest (libgtest-dev) and pkgconf, downloaded with apt-get and unpacked with
# dpkg -x under .deps/root (nothing is installed). gpu_check.sh uses them only where
# the machine has no libhwy / GTest / pkg-config of its own. Pass .deps to the GPU
# run (it is git-ignored, so it travels only when named).
set -euo pipefail
cd "$(dirname "$0")/.."

DEPS=.deps
PACKAGES=(libhwy-dev libhwy1 libgtest-dev pkgconf pkgconf-bin libpkgconf3)

download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
# A fresh image has empty package lists: fill them where allowed (as root).
if [ "$(id -u)" = 0 ]; then apt-get update -qq; fi
# apt-get download writes to the current directory; as root it warns that the
# download is unsandboxed, which is harmless here.
(cd "$download" && apt-get download "${PACKAGES[@]}")

rm -rf "$DEPS"
mkdir -p "$DEPS/root"
for deb in "$download"/*.deb; do
  dpkg -x "$deb" "$DEPS/root"
  basename "$deb" >> "$DEPS/PACKAGES"
done
# The unpacked files only work on this architecture.
dpkg --print-architecture > "$DEPS/ARCH"
rm -rf "$DEPS/root/usr/share/doc" "$DEPS/root/usr/share/man"

echo "filled $DEPS ($(du -sh "$DEPS" | cut -f1), $(cat "$DEPS/ARCH")):"
sed 's/^/  /' "$DEPS/PACKAGES"
