"""Step profiles: host sections, forward timing, traces and their gaps."""
