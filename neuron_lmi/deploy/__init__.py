"""Deployment code shipped with the package: ``neuron-lmi deploy`` (SageMaker). The Dockerfiles,
Kubernetes manifests and systemd unit live in the repository's ``deploy/`` folder."""
