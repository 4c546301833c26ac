"""What users run beside training: the ``offload`` CLI, ``offload report``, ``offload probe``, model presets,
the meta-device tracer, the baseline policies and step timelines."""
