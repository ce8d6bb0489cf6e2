"""Test environment helpers for polyrl: the control-plane tier (real CRD server + shim).

Public API: ``ControlPlane`` (start/stop, kubeconfig, kubectl, api_client), ``find_binaries``,
``Binaries``, ``ControlPlaneError``, ``cache_dir``. See ``controlplane`` for details.
"""

from polyrl_testenv.controlplane import Binaries, ControlPlane, ControlPlaneError, cache_dir, find_binaries

__all__ = ["Binaries", "ControlPlane", "ControlPlaneError", "cache_dir", "find_binaries"]
