"""kubeadm bootstrap tokens and the backends that make them valid in a cluster.

``token`` (the token, its Secret manifest), ``backend`` (the interface and the
``token_backend`` configuration), ``filebackend`` (manifests in a private folder),
``kubernetes`` and ``kubeconfig`` (Secrets through the API server over HTTPS).
"""
