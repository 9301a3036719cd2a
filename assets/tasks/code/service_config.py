"""Configuration objects for the Tidewell telemetry collector.

Original code written for the Page-EntroKV task set (CC0). The service and
every value in it are fictional.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV_PREFIX = "TIDEWELL_"
DEFAULT_LOG_LEVEL = "INFO"
SUPPORTED_CODECS = ("none", "gzip", "zstd")


class ConfigError(ValueError):
    """Raised when a configuration value is missing or invalid."""


@dataclass
class TLSConfig:
    """Transport security for the collector's listener."""

    enabled: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    min_version: str = "1.2"

    def __post_init__(self) -> None:
        if self.enabled and not (self.cert_file and self.key_file):
            raise ConfigError("TLS needs both cert_file and key_file")
        if self.min_version not in {"1.2", "1.3"}:
            raise ConfigError(f"unsupported TLS version {self.min_version}")


@dataclass
class RetryPolicy:
    """How the exporter retries a failed upload."""

    max_attempts: int = 6
    initial_backoff_s: float = 0.4
    backoff_multiplier: float = 2.5
    max_backoff_s: float = 30.0

    def delays(self) -> list[float]:
        """Waiting time before each retry, capped at max_backoff_s."""
        out = []
        delay = self.initial_backoff_s
        for _ in range(self.max_attempts - 1):
            out.append(min(delay, self.max_backoff_s))
            delay *= self.backoff_multiplier
        return out


@dataclass
class PoolSettings:
    """Connection pool used by the exporter."""

    max_connections: int = 16
    idle_timeout_s: float = 95.0
    connect_timeout_s: float = 4.0
    keepalive: bool = True


@dataclass
class StorageConfig:
    """Where the collector buffers data that has not been exported yet."""

    directory: str = "/var/lib/tidewell"
    max_disk_mb: int = 2048
    segment_mb: int = 64
    codec: str = "zstd"
    fsync_every: int = 500

    def __post_init__(self) -> None:
        if self.codec not in SUPPORTED_CODECS:
            raise ConfigError(f"unknown codec {self.codec!r}")
        if self.segment_mb > self.max_disk_mb:
            raise ConfigError("segment_mb cannot exceed max_disk_mb")

    def max_segments(self) -> int:
        return self.max_disk_mb // self.segment_mb


@dataclass
class ServerConfig:
    """The collector's listener."""

    host: str = "0.0.0.0"
    port: int = 7341
    workers: int = 3
    max_request_kb: int = 512
    read_timeout_s: float = 12.0
    tls: TLSConfig = field(default_factory=TLSConfig)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port {self.port} out of range")
        if self.workers < 1:
            raise ConfigError("need at least one worker")

    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class ExporterConfig:
    """Where collected data is sent."""

    endpoint: str = "https://ingest.example.invalid/v1"
    batch_size: int = 800
    flush_interval_s: float = 7.5
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    pool: PoolSettings = field(default_factory=PoolSettings)
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ConfigError("batch_size must be positive")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError("endpoint must be an http(s) URL")


@dataclass
class CollectorConfig:
    """Everything the collector needs to start."""

    server: ServerConfig = field(default_factory=ServerConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    log_level: str = DEFAULT_LOG_LEVEL
    instance_name: str = "tidewell-collector"


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"not a boolean: {text!r}")


def _env(name: str, environ: dict[str, str]) -> str | None:
    return environ.get(ENV_PREFIX + name)


def server_from_env(environ: dict[str, str]) -> ServerConfig:
    """Build the listener settings from TIDEWELL_* variables."""
    cfg = ServerConfig()
    if (host := _env("HOST", environ)) is not None:
        cfg.host = host
    if (port := _env("PORT", environ)) is not None:
        cfg.port = int(port)
    if (workers := _env("WORKERS", environ)) is not None:
        cfg.workers = int(workers)
    if (tls := _env("TLS", environ)) is not None and _parse_bool(tls):
        cfg.tls = TLSConfig(
            enabled=True,
            cert_file=_env("TLS_CERT", environ),
            key_file=_env("TLS_KEY", environ),
        )
    cfg.__post_init__()
    return cfg


def exporter_from_env(environ: dict[str, str]) -> ExporterConfig:
    """Build the exporter settings from TIDEWELL_* variables."""
    cfg = ExporterConfig()
    if (endpoint := _env("ENDPOINT", environ)) is not None:
        cfg.endpoint = endpoint
    if (batch := _env("BATCH_SIZE", environ)) is not None:
        cfg.batch_size = int(batch)
    if (attempts := _env("RETRY_ATTEMPTS", environ)) is not None:
        cfg.retry.max_attempts = int(attempts)
    if (token := _env("TOKEN", environ)) is not None:
        cfg.headers["Authorization"] = f"Bearer {token}"
    cfg.__post_init__()
    return cfg


def load_config(environ: dict[str, str] | None = None) -> CollectorConfig:
    """Read the whole configuration from the environment."""
    environ = dict(os.environ if environ is None else environ)
    cfg = CollectorConfig(
        server=server_from_env(environ),
        exporter=exporter_from_env(environ),
    )
    if (level := _env("LOG_LEVEL", environ)) is not None:
        cfg.log_level = level.upper()
    if (name := _env("INSTANCE", environ)) is not None:
        cfg.instance_name = name
    return cfg


def describe(cfg: CollectorConfig) -> list[str]:
    """Human-readable summary printed at start-up."""
    return [
        f"instance: {cfg.instance_name}",
        f"listening on {cfg.server.address()} with {cfg.server.workers} workers",
        f"TLS: {'on' if cfg.server.tls.enabled else 'off'}",
        f"exporting to {cfg.exporter.endpoint} in batches of {cfg.exporter.batch_size}",
        f"retries: {cfg.exporter.retry.max_attempts} attempts",
        f"buffer: {cfg.storage.directory} (max {cfg.storage.max_disk_mb} MB)",
    ]
