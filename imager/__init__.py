"""``nodeimager``: the program of the boot environment that writes a verified node image to the right disk.

A racked server boots the release's iPXE script, which loads the imager kernel and initramfs; the
initramfs runs ``nodeimager run``, which

1. reads its parameters from the kernel command line (:mod:`imager.params`);
2. fetches the release's signature over HTTP(S) only and verifies it with a trusted key before it
   trusts any digest (:mod:`imager.http`, :mod:`imager.source`, :mod:`protocol.release`);
3. picks the target disk by stable identity, exactly one or a refusal (:mod:`imager.inventory`,
   :mod:`imager.hints`, :mod:`imager.select`);
4. streams the image, hashing it as it comes, and writes it so that the disk is bootable only
   once every byte is verified (:mod:`imager.write`, :mod:`imager.qcow2`, :mod:`imager.wipe`);
5. reads the disk back, repairs the backup GPT, checks the partitions resolve on the target only
   (:mod:`imager.gpt`, :mod:`imager.check`), writes the node-pool cloud-init seed
   (:mod:`imager.seed`), creates the UEFI boot entry (:mod:`imager.efi`), reports
   (:mod:`imager.events`) and reboots.

docs/bare-metal.md is the operator's guide. This package imports :mod:`protocol` and nothing else
of the project.
"""
