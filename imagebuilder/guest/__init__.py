"""Programs the builder hands to a guest or to QEMU, never imported by the builder itself.

* :mod:`imagebuilder.guest.boottest_check`: the boot test's checker, run by the booted image's
  own ``python3`` (standard library only) from the NoCloud seed.

They run outside the builder's process (in the guest), so they are standalone
scripts that start their own processes; the builder's one subprocess chokepoint
(:mod:`imagebuilder.run`) is for the build host's commands.
"""
