"""Release sets: from a verified build folder, the folder a racked server boots and joins from.

:mod:`imagebuilder.release.ipxe` renders the iPXE scripts (``ipxe/`` at the repository root holds
the canonical templates; ``templates/`` here are identical packaged copies, kept in step by a test).
"""
