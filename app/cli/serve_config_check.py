"""What ``loraplex serve`` checks in a Serve config before it starts Ray: Serve itself takes a
config whose application cannot be built, logs the error in its controller's log and serves
nothing, while ``serve run`` keeps running; these mistakes end the command at once instead.

Checked for every application of ``app.main:build_app``: its ``args`` validate against
``AppConfig`` (strict), and its per-deployment ``deployments:`` overrides name deployments that
the chosen topology makes (``app.config.DEPLOYMENTS``). ``largest_header_bytes`` reads the
header limit the data path in front of the gateways must let through.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from app.config import AppConfig

IMPORT_PATH = "app.main:build_app"


def _validation_lines(exc: ValidationError) -> list[str]:
    return [f"{'.'.join(str(x) for x in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()]


def config_problems(cfg: dict[str, Any]) -> list[str]:
    """One line per problem (empty: nothing found), each naming the application and the key."""
    problems: list[str] = []
    for app in cfg.get("applications") or []:
        if app.get("import_path") != IMPORT_PATH:
            continue
        name = app.get("name", "?")
        try:
            args = AppConfig.model_validate(app.get("args") or {})
        except ValidationError as exc:
            problems += [f"application {name!r}: args.{line}" for line in _validation_lines(exc)]
            continue
        names = args.deployment_names()
        unknown = [d.get("name") for d in app.get("deployments") or [] if d.get("name") not in names]
        if unknown:
            problems.append(
                f"application {name!r}: deployments: overrides for {', '.join(map(repr, unknown))}, which topology "
                f"{args.topology!r} does not deploy (it deploys {', '.join(map(repr, names))}); put these options "
                "under args.engine_deployment or args.gateway_deployment, which follow the topology")
    return problems


def largest_header_bytes(cfg: dict[str, Any]) -> int:
    """The largest ``max_header_bytes`` of the config's loraplex applications (``AppConfig``'s
    default where none sets it); the config must have passed :func:`config_problems`."""
    apps = [a for a in cfg.get("applications") or [] if a.get("import_path") == IMPORT_PATH]
    return max((AppConfig.model_validate(a.get("args") or {}).max_header_bytes for a in apps),
               default=AppConfig.model_fields["max_header_bytes"].default)
