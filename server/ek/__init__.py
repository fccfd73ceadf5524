"""Internals of the EK trust decision; the public API is :mod:`server.ek_trust`.

``der`` (DER reader), ``keys`` (public keys, signatures), ``certificate`` (lenient
X.509 parser), ``store`` (CA directory snapshot and chain building), ``cadir``
(reloading), ``hashes`` (hash allowlist), ``profile`` (EK certificate profile).
"""
