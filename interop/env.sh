# Sourced by the interop/ scripts, after they set REPO (the repository root): one Go environment for
# every peer module. The Go caches and the built peers live in the machine's cache folder
# ($NODETRUST_CACHE, default ${XDG_CACHE_HOME:-~/.cache}/nodetrust), not in the checkout: a fresh
# clone on a machine that built the peers once (CI runs on clean clones) finds them there, keyed on
# go.sum, instead of paying a cold build of 20-30 minutes again.
# shellcheck shell=sh
PATH=/usr/local/go/bin:$PATH
GOTOOLCHAIN=local
GOFLAGS="-buildvcs=false -modcacherw"
NODETRUST_CACHE=${NODETRUST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nodetrust}
GOMODCACHE=$NODETRUST_CACHE/go/mod
GOCACHE=$NODETRUST_CACHE/go/build
export PATH GOTOOLCHAIN GOFLAGS GOMODCACHE GOCACHE NODETRUST_CACHE
