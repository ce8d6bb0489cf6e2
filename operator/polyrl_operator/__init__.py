"""polyrl operator: the RLJob API, CRD generation, validation and the kopf controller."""
