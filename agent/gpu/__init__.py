"""GPU checks: PCI inventory (pyudev), kernel driver (/proc, /sys, /dev), NVML (pynvml), kernel-log XIDs.

:func:`agent.gpu.observe.collect` gathers every GPU observation; the rules in
:mod:`protocol.rules` judge them. Nothing here imports pyudev or pynvml at
module import time.
"""
