"""Runs inside slurmctld, in the interpreter the plugins embed.

Everything here is imported by libpyk8sres_core.so under slurmctld's locks:
pure policy and local files only.  Never import a network or HTTP library
here, never block (tests/unit/test_layout.py keeps this boundary).
"""
