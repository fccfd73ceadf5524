"""DevIDs: SPIRE's ``tpm_devid`` attestor (:mod:`server.devid.attestor`), nodeserver's own DevID CA
(:mod:`server.devid.ca`) and the enrolment that issues LDevIDs after an EK proof
(:mod:`server.devid.enrol_service`). docs/attestation.md, "DevID enrolment", has the trust argument."""
