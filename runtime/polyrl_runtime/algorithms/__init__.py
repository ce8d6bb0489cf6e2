"""Policy-gradient pieces shared by every trainer backend: the estimator table (estimators.py,
torch-free: the driver and the workflow workers read it), advantages and the clipped, IS-corrected
loss (advantages.py, losses.py). Nothing is imported here, so reading the table does not load torch."""
