"""The agent's TPM 2.0 side of the ``tpm`` node attestor, through tpm2-pytss.

:class:`agent.tpm.attestor.TpmAttestor` is the whole flow: read the EK (and its
certificate), make an AK under the SRK and certify its creation, then answer a
credential challenge with TPM2_ActivateCredential. Every transient object and
session it creates is flushed when it closes.
"""
