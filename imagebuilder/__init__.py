"""The image builder (``imagebuilder``): the Ubuntu installer under libvirt to a pinned node QCOW2.

It imports none of the other packages of this repository: it installs the node
agent into the image as a built wheel.
"""
