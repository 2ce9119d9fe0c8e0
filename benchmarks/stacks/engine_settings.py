"""``KEY=VALUE`` engine settings from a benchmark's command line into a Serve config's engine section."""

from __future__ import annotations

import argparse


def engine_setting(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` → ``(KEY, VALUE read as YAML)``; an argparse type."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: KEY=VALUE, e.g. max_lora_rank=32")
    return key.strip(), yaml.safe_load(value)


def apply_engine_settings(engine: dict, settings: list[tuple[str, object]]) -> None:
    """``settings`` into a Serve config's engine section: EngineConfig's own fields at its top,
    anything else among the vLLM arguments passed unchanged (``extra_engine_args``)."""
    from app.config import EngineConfig

    for key, value in settings:
        if key in EngineConfig.model_fields and key != "extra_engine_args":
            engine[key] = value
        else:
            engine.setdefault("extra_engine_args", {})[key] = value
