"""Exceptions raised by metal-attn. Every message names the argument, its value
and what is allowed."""

from __future__ import annotations


class MetalAttnError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidInputError(MetalAttnError, ValueError):
    """An argument of a public call is malformed (shape, dtype, value). The message reads
    ``name=value (allowed: ...)``."""

    @property
    def allowed(self) -> str:
        """The message's ``(allowed: ...)`` part, for a caller that names the value its own way (a command-line
        flag); the whole message in parentheses where it has none."""
        message = str(self)
        start = message.find("(allowed")
        return message[start:] if start >= 0 else f"({message})"


class NoProviderError(MetalAttnError, RuntimeError):
    """No provider admits the request; the message holds the decision table."""


class ProviderRefusedError(NoProviderError):
    """A provider forced by argument or setting refuses the request."""


class KernelCompileError(MetalAttnError, RuntimeError):
    """A kernel specialization failed to build or load.

    Providers raise it from ``prepare``; the registry then marks that
    specialization unavailable and falls back to the next admitted provider.
    """


class ProviderContractError(MetalAttnError, RuntimeError):
    """A provider broke its contract at run time (its ``run`` returned the wrong shape, dtype or type)."""


class RegistryError(MetalAttnError, ValueError):
    """A provider could not be registered (duplicate name, bad priority, ...)."""


class SettingsError(MetalAttnError, ValueError):
    """A ``METAL_ATTN_*`` variable or a settings override has a bad value."""


class SettingsWarning(UserWarning):
    """A ``METAL_ATTN_*`` variable that is ignored, conflicts with another or has no effect. Each is also a
    log event (``unknown_setting``, ``conflicting_setting``, ``reserved_setting``), so the command line
    shows the event only."""


class CacheExhaustedError(MetalAttnError, RuntimeError):
    """The block allocator has fewer free blocks than a request needs."""


class ModelError(MetalAttnError, ValueError):
    """A model cannot be served: unknown path, unsupported architecture, bad model option."""


class ModelFetchError(MetalAttnError, RuntimeError):
    """The default model could not be fetched (no network, pip failed); the message says what to run instead."""
