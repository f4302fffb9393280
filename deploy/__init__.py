"""Deployment assets (Dockerfiles, docker-compose, Kubernetes) and their offline checks.

`deploy.tools` installs the real validators (kustomize, kubernetes-validate, the Compose
binary, hadolint) into a cache outside the repository; `deploy.check` runs them.
"""
