"""A real Confluent-compatible schema registry for the tests: AxonOps Schema Registry, built with Go.

The registry is a Go server (Apache-2.0) implementing the Confluent Schema Registry REST API. It is
built once from the Go module proxy by a wrapper module that requires
`github.com/axonops/axonops-schema-registry` at `REGISTRY_VERSION` and runs `go build` on its
`cmd/schema-registry` package (`go install ...@version` is refused: the proxy does not list the
module's versions). The binary is kept in `~/.cache/stepstream/schema-registry-<version>/`
(`STEPSTREAM_REGISTRY_CACHE` moves it), built under a file lock and renamed into place, so
concurrent test runs and an interrupted build are safe; Go's module and build caches make a rebuild
quick. It runs with in-memory storage on a free loopback port and starts in milliseconds.

It stands in for the registries production uses (Confluent Schema Registry, Karapace, Apicurio,
Redpanda's); nothing in stepstream depends on anything but the Confluent REST API.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepstream.embedded.apache_kafka import locked, user_cache

from processes import free_port, running

REGISTRY_MODULE = 'github.com/axonops/axonops-schema-registry'
REGISTRY_VERSION = 'v0.2.1'
HOST = '127.0.0.1'


def cache_dir() -> Path:
    """Where the wrapper module and the built binary are kept between runs."""
    return user_cache(f'schema-registry-{REGISTRY_VERSION}', override='STEPSTREAM_REGISTRY_CACHE')


def registry_binary() -> Path:
    """The registry's binary, built with the machine's Go the first time; skips the test without Go."""
    target = cache_dir()
    binary = target / 'schema-registry'
    if binary.exists():
        return binary
    go = shutil.which('go')
    if go is None:
        pytest.skip(
            f'Go is not installed, and the schema registry ({REGISTRY_MODULE} {REGISTRY_VERSION}) is '
            f'not built in {target} yet: install Go (https://go.dev/dl/) to run the registry tests'
        )
    target.mkdir(parents=True, exist_ok=True)
    with locked(target / '.lock'):
        if binary.exists():  # another process built it while this one waited
            return binary
        module = target / 'module'
        module.mkdir(exist_ok=True)
        (module / 'go.mod').write_text('module stepstream.test/schemaregistry\n\ngo 1.24\n')
        staged = target / f'schema-registry.{os.getpid()}'
        env = {**os.environ, 'GOFLAGS': '-mod=mod', 'CGO_ENABLED': '0'}
        for command in (
            [go, 'get', f'{REGISTRY_MODULE}/cmd/schema-registry@{REGISTRY_VERSION}'],
            [go, 'build', '-trimpath', '-o', str(staged), f'{REGISTRY_MODULE}/cmd/schema-registry'],
        ):
            result = subprocess.run(
                command, cwd=module, env=env, capture_output=True, text=True, timeout=900, check=False
            )
            if result.returncode != 0:
                output = (result.stdout + result.stderr).strip().splitlines()[-15:]
                raise RuntimeError(
                    f'building the schema registry failed (exit {result.returncode}): {" ".join(command)}\n'
                    + '\n'.join(output)
                )
        staged.rename(binary)
    return binary


@contextlib.contextmanager
def running_registry(
    log_path: Path, *, config: str | None = None, env: dict[str, str] | None = None, tls: bool = False
) -> Iterator[str]:
    """A registry on a free loopback port, with in-memory storage; yields its URL.

    `config` is the YAML of a configuration file (TLS, authentication), `env` more variables.
    """
    binary = registry_binary()
    port = free_port()
    command = [str(binary)]
    if config is not None:
        config_path = log_path.with_suffix('.yaml')
        config_path.write_text(config)
        command += ['-config', str(config_path)]
    environ = {**os.environ, **(env or {}), 'SCHEMA_REGISTRY_HOST': HOST, 'SCHEMA_REGISTRY_PORT': str(port)}
    with running(command, log_path, port=port, env=environ):
        yield f'{"https" if tls else "http"}://{HOST}:{port}'
