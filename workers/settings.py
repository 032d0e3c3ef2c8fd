"""Shared pieces of every command's settings (pydantic-settings, prefix SPECSPLIT_)."""

from __future__ import annotations

from typing import TypeVar

from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

S = TypeVar("S", bound=BaseSettings)


def settings_config(prog: str) -> SettingsConfigDict:
    return SettingsConfigDict(
        env_prefix="SPECSPLIT_",
        frozen=True,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name=f"specsplit {prog}",
        extra="ignore",
    )


def parse(settings_cls: type[S], argv: list[str]) -> S:
    """Command line over environment over defaults."""
    return CliApp.run(settings_cls, cli_args=argv)
