"""The coordinator: the Ray driver that runs an RLJob (in a pod or under `polyrl run`)."""
