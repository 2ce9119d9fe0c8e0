"""Serve configs, Dockerfiles, the Helm chart."""
