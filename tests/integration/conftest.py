"""Fixtures shared by every integration test module (see conftest_kube.py)."""
from conftest_kube import kube_api_client, kube_binaries, kube_server  # noqa: F401
