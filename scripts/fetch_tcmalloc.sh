#!/usr/bin/env bash
# Puts Debian's or Ubuntu's libtcmalloc_minimal.so.4 (gperftools) into DIR, where jaxserve/allocator.py
# finds it and preloads it. Best effort: without apt, or when the download fails, it says so and exits 0
# (a system-wide gperftools is found too; otherwise glibc's malloc serves, only slower on CPUs).
set -uo pipefail
dest=${1:?usage: fetch_tcmalloc.sh DIR}
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "tcmalloc: no apt-get here; install gperftools' libtcmalloc_minimal for faster CPU steps"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Debian 13 and Ubuntu 24.04 name it libtcmalloc-minimal4t64 (64-bit time_t); older releases without t64.
if (cd "$work" && { apt-get download libtcmalloc-minimal4t64 || apt-get download libtcmalloc-minimal4; } \
      >/dev/null 2>&1) \
    && dpkg-deb -x "$work"/libtcmalloc-minimal4*.deb "$work/root" \
    && mkdir -p "$dest" && cp -L "$work"/root/usr/lib/*/libtcmalloc_minimal.so.4 "$dest/"; then
  echo "tcmalloc: $dest/libtcmalloc_minimal.so.4"
else
  echo "tcmalloc: apt-get could not fetch libtcmalloc-minimal4; glibc's malloc serves"
fi
exit 0
