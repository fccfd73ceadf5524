"""Programs the builder hands to a guest or to QEMU, never imported by the builder itself.

* :mod:`imagebuilder.guest.boottest_check`: the boot test's checker, run by the booted image's
  own ``python3`` (standard library only) from the NoCloud seed;
* :mod:`imagebuilder.guest.relay`: the per-connection relay QEMU runs for a guest forward.

They run outside the builder's process (in the guest, or as QEMU's user), so they are standalone
scripts that start their own processes; the builder's one subprocess chokepoint
(:mod:`imagebuilder.run`) is for the build host's commands.
"""
