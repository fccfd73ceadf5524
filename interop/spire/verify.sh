#!/bin/sh
# Run by interop/build.sh in the fresh bin folder: print both binaries' versions on one line.
set -eu
printf 'spire-server %s spire-agent %s\n' "$(./spire-server --version 2>&1)" "$(./spire-agent --version 2>&1)"
