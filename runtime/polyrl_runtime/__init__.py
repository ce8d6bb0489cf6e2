"""polyrl runtime: the data plane that runs inside an RLJob's pods and in `polyrl run`."""
