"""A cluster on a laptop, for trying polyrl without one: the e2e tier's pieces, left running.

    make laptop     # = PYTHONPATH=tests/support .venv/bin/python -m polyrl_testenv.laptop [--namespace NS]

starts the control plane (etcd + the Kubernetes CRD server + the shim), installs the RLJob CRD,
starts the test kubelet (pods run as local processes with the local venv) and the real operator
process, prints the `export KUBECONFIG=...` line to use with kubectl, and runs until Ctrl-C. Build
the control plane first: `make controlplane` (or `hack/controlplane/prepare.sh`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from polyrl_testenv.bad_rljobs import REPO
from polyrl_testenv.controlplane import ControlPlane
from polyrl_testenv.kubelet import TestKubelet
from polyrl_testenv.operator_proc import start_operator


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m polyrl_testenv.laptop")
    parser.add_argument("--namespace", default="default", help="namespace the operator watches")
    args = parser.parse_args()
    # One line per event (a pod slow to answer the operator's proxy, kubeproxy.py), no tracebacks.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    plane = ControlPlane.start()
    kubelet = None
    operator = None
    try:
        plane.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "polyrl.dev_rljobs.yaml"))
        plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/rljobs.polyrl.dev")
        if args.namespace != "default":
            plane.create_namespace(args.namespace)
        kubelet = TestKubelet(plane.server, [args.namespace]).start()
        settings = {"progressUrl": kubelet.progress_url(), "progressInterval": 2, "metricsPort": None,
                    "livenessPort": None}  # fmt: skip
        operator = start_operator(plane.kubeconfig, args.namespace, settings, plane.workdir, "laptop")
        sys.stdout.write(
            f"control plane up; the operator watches namespace {args.namespace!r}\n"
            f"  export KUBECONFIG={plane.kubeconfig}\n"
            f"  export PATH={plane.binaries.directory}:$PATH   # kubectl {plane.binaries.kubectl}\n"
            f"operator log: {plane.workdir}/operator-laptop.log; pod logs: {kubelet.root}/<n>/main.log\n"
            "Ctrl-C stops everything.\n"
        )
        sys.stdout.flush()
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        stop.wait()
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=30)
        if kubelet is not None:
            kubelet.stop()
        plane.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
