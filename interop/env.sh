# Sourced by the interop/ scripts, after they set REPO (the repository root): one Go environment for
# every peer module. The caches live in .cache/go (ignored by git), so a CI cache of .cache/ holds them.
# shellcheck shell=sh
PATH=/usr/local/go/bin:$PATH
GOTOOLCHAIN=local
GOFLAGS="-buildvcs=false -modcacherw"
GOMODCACHE=$REPO/.cache/go/mod
GOCACHE=$REPO/.cache/go/build
export PATH GOTOOLCHAIN GOFLAGS GOMODCACHE GOCACHE
