"""polyrl operator: RLJob API, CRD generation, validation and (later) the kopf controller."""
