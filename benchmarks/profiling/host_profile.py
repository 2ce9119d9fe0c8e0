"""Python (host) time of engine passes under ``cProfile``, printed the way the step profile
reads it: where a step without CUDA graphs spends the CPU time that decides its length."""

from __future__ import annotations

import os


def host_profile(passes, top: int, dump_dir: str | None = None) -> dict:
    """Each pass (``(label, callable)``) under ``cProfile``: where the host's time goes in
    steps that run without CUDA graphs. Prints the top functions by own time, by cumulative
    time, and loraplex's by cumulative time; ``dump_dir``: also the raw stats,
    ``<label>.pstats``."""
    import cProfile
    import io
    import pstats

    out = {}
    for label, run in passes:
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            prof.dump_stats(os.path.join(dump_dir, f"{label.replace(' ', '_')}.pstats"))
        for order, only in (("tottime", None), ("cumulative", None), ("cumulative", "kernels")):
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf).sort_stats(order)
            stats.print_stats(*((only,) if only else ()), top)  # only: loraplex's functions
            what = f"{order}, loraplex's functions" if only else order
            print(f"\nhost profile, {label}, by {what}:")
            print("\n".join(buf.getvalue().splitlines()[-top - 3:]))
            out[f"{label}, {what}"] = buf.getvalue()
    return out
