-- The AK's qualified name (hex) as its own TPM2_CertifyCreation names it at attestation: a TPM's
-- quotes carry it as qualifiedSigner, and the server compares them exactly.
ALTER TABLE agents ADD COLUMN ak_qualified_name TEXT NOT NULL DEFAULT '';
