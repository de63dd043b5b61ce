"""Fixtures shared by every integration test module (see conftest_kube.py)."""
from conftest_kube import kube_api_client, kube_paths, kube_server  # noqa: F401
