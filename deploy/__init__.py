"""Deployment helpers and artifacts: SageMaker (``deploy.sagemaker``), Dockerfiles, Kubernetes, systemd."""
