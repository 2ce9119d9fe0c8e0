"""Host-side launch machinery: Triton variants launched without Triton's per-call work (kept launches), and the argument tracing they rely on."""
