"""The driver's metrics: per-step records, the series files, the optional sinks, and the log that
sends each record to all of them."""
