#!/bin/sh
# Build the pinned upstream test peers (never shipped) into $NODETRUST_CACHE/peers/<module>-<version>-<key>/bin/
# (NODETRUST_CACHE defaults to ~/.cache/nodetrust; see env.sh).
#
#   interop/build.sh [MODULE...]     build each module (default: every interop/*/peer.conf), or do nothing
#                                    when the binaries for the same go.mod, go.sum and peer.conf are present
#   interop/build.sh --bin MODULE    print the bin folder of MODULE's current build; exit 1 if not built
#
# <key> is the first 12 hex digits of the SHA-256 of the module's go.mod, go.sum and peer.conf and the Go
# version, so a change of pins or flags builds into a new folder and an old build is never mistaken for it.
# Builds are -trimpath, stripped, with a fixed build date (peer.conf), so they are byte-identical run to
# run. A module's peer.conf sets VERSION, CGO_ENABLED, LDFLAGS, optionally RENAME ("from=to ...") and
# VERIFY / VERIFY_OUTPUT (a command run in the bin folder and the first line it must print).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
# shellcheck source=interop/env.sh
. "$HERE/env.sh"
PEERS=$NODETRUST_CACHE/peers
if ! command -v go >/dev/null 2>&1; then
  echo "interop/build.sh: no Go toolchain: Go 1.26 must be installed in /usr/local/go (interop/README.md)" >&2
  exit 1
fi

key_of() {  # module dir -> key
  { cat "$1/go.mod" "$1/go.sum" "$1/peer.conf"; go env GOVERSION; } | sha256sum | cut -c1-12
}

tools_of() {  # module dir -> the tool packages of its go.mod
  awk '$1=="tool" && $2!="(" {print $2} $1=="tool" && $2=="(" {f=1; next} f && $1==")" {f=0} f {print $1}' "$1/go.mod"
}

out_of() {  # module name -> folder of its current build (need not exist)
  # shellcheck source=/dev/null
  (. "$HERE/$1/peer.conf"; echo "$PEERS/$1-$VERSION-$(key_of "$HERE/$1")")
}

if [ "${1:-}" = --bin ]; then
  if [ $# -ne 2 ] || [ ! -f "$HERE/$2/peer.conf" ]; then
    echo "usage: interop/build.sh --bin MODULE   (a folder of interop/ with a peer.conf)" >&2
    exit 2
  fi
  out=$(out_of "$2")
  if [ ! -f "$out/.complete" ]; then
    echo "interop/build.sh: the $2 peers for this go.sum are not built ($out): run \`make peers\`" >&2
    exit 1
  fi
  echo "$out/bin"
  exit 0
fi

if [ $# -eq 0 ]; then
  set --
  for conf in "$HERE"/*/peer.conf; do set -- "$@" "$(basename "$(dirname "$conf")")"; done
fi

build_one() {
  m=$1
  dir=$HERE/$m
  [ -f "$dir/peer.conf" ] || { echo "interop/build.sh: no module $m (no $dir/peer.conf)" >&2; return 2; }
  out=$(out_of "$m")
  rel=${out#"$REPO"/}
  if [ -f "$out/.complete" ]; then
    echo "peers: $m present in $rel (nothing to build)"
    return 0
  fi
  (
    unset RENAME VERIFY VERIFY_OUTPUT
    # shellcheck source=/dev/null
    . "$dir/peer.conf"
    tools=$(tools_of "$dir")
    mkdir -p "$PEERS"
    tmp=$(mktemp -d "$PEERS/.build-$m.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    start=$(date +%s)
    echo "peers: building $m $VERSION ($(echo "$tools" | sed 's#.*/##' | tr '\n' ' ' | sed 's/ $//')) into $rel"
    cd "$dir"
    go mod download
    fetched=$(date +%s)
    echo "peers: $m modules ready in $((fetched - start)) s; compiling (nice -n 19; minutes when the build cache is cold)"
    # shellcheck disable=SC2086 # $tools is a list of package paths
    CGO_ENABLED=$CGO_ENABLED nice -n 19 go build -trimpath -ldflags "$LDFLAGS" -o "$tmp/bin/" $tools
    for r in ${RENAME:-}; do mv "$tmp/bin/${r%%=*}" "$tmp/bin/${r#*=}"; done
    if [ -n "${VERIFY:-}" ]; then
      got=$(cd "$tmp/bin" && $VERIFY | head -n 1)
      if [ "$got" != "$VERIFY_OUTPUT" ]; then
        echo "interop/build.sh: $m: \`$VERIFY\` printed '$got', expected '$VERIFY_OUTPUT'" >&2
        exit 1
      fi
    fi
    (cd "$tmp/bin" && sha256sum -- *) > "$tmp/SHA256SUMS"
    touch "$tmp/.complete"
    rm -rf "$out"
    mv "$tmp" "$out"
    trap - EXIT
    end=$(date +%s)
    echo "peers: built $m in $((end - start)) s ($((end - fetched)) s compiling): $(du -sh "$out/bin" | cut -f1) in $rel/bin"
  )
}

# One build of a module at a time on this machine (two `make peers` at once wait for each other).
mkdir -p "$PEERS"
for m in "$@"; do
  (
    flock 9
    build_one "$m"
  ) 9>"$PEERS/.lock-$m"
done
