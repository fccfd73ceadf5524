"""The imager's boot environment: a kernel and an initramfs, built from pinned, signature-checked Debian
packages and one pinned PyPI wheel (blake3) through the builder's own lock and cache, with ``nodeimager``
from a clean wheel of this repository. :mod:`imagebuilder.bootenv.recipe` says what goes in,
:mod:`imagebuilder.bootenv.lock` pins it, :mod:`imagebuilder.bootenv.build` assembles it.
"""
