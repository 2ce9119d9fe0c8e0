"""The vLLM releases loraplex touches the internals of, one row per platform, checked here only.

Every integration (the CUDA kernels' patches, the CPU expert-LoRA path, the serving layer's
use of vLLM's OpenAI objects) was written against one release series and refuses another at
engine start with ``UnsupportedVLLMError``: a changed internal fails loudly instead of serving
wrong outputs.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not the release an integration was written for, or a vLLM internal
    it patches is not where (or what) that release has it."""


@dataclass(frozen=True)
class SupportedVLLM:
    """One platform's supported vLLM release series (``0.24`` admits ``0.24.x``)."""

    platform: str
    series: str

    def supports(self, version: str) -> bool:
        return version == self.series or version.startswith(self.series + ".")

    def __str__(self) -> str:
        return f"vLLM {self.series}.x ({self.platform})"


CUDA = SupportedVLLM("CUDA", "0.24")
CPU = SupportedVLLM("CPU", "0.32")
SUPPORTED = (CUDA, CPU)
SWITCH_HINT = "set LORAPLEX_MOE_LORA=0 to run vLLM's own kernels"


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def require(target: SupportedVLLM, what: str, hint: str = SWITCH_HINT,
            version: str | None = None) -> str:
    """The installed (or given) vLLM version; raises ``UnsupportedVLLMError`` naming ``what``
    needs ``target`` unless it is a release of ``target``'s series."""
    version = version or installed_version()
    if not target.supports(version):
        raise UnsupportedVLLMError(f"{what} supports {target}, found vLLM {version}"
                                   + (f"; {hint}" if hint else ""))
    return version


def require_any(what: str, version: str | None = None) -> SupportedVLLM:
    """The table's row of the installed (or given) vLLM; raises ``UnsupportedVLLMError`` when
    no row admits it."""
    version = version or installed_version()
    for row in SUPPORTED:
        if row.supports(version):
            return row
    raise UnsupportedVLLMError(f"{what} supports {' and '.join(map(str, SUPPORTED))}, "
                               f"found vLLM {version}")
