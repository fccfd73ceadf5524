"""The node agent (``nodeagent``): attests the node's TPM, verifies its GPUs and
readiness, and only then asks for kubeadm join credentials."""
