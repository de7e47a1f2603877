"""The `ftrain` command line: run the service (`up`, `serve`, `node`) and talk to it."""

from __future__ import annotations

import ipaddress
import logging
import os
import sys

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """ftrain: elastic, fault-tolerant PyTorch training as a service."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@main.command()
@click.option("--etcd", "etcd_endpoints", envvar="FTRAIN_ETCD_ENDPOINTS", required=True,
              help="etcd v3 endpoints, http://HOST:PORT[,...].")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--token", envvar="FTRAIN_USER_TOKEN", help="User bearer token.")
@click.option("--node-token", envvar="FTRAIN_NODE_TOKEN", help="Node bearer token.")
@click.option("--snapshot-root", envvar="FTRAIN_SNAPSHOT_ROOT",
              help="Directory every node sees; jobs snapshot under <root>/<job id>.")
def serve(etcd_endpoints: str, host: str, port: int, token: str | None, node_token: str | None,
          snapshot_root: str | None) -> None:
    """Run only the control plane, against an existing etcd."""
    import uvicorn

    from service.app import create_app
    from service.settings import Settings

    if not _is_loopback(host) and not (token and node_token):
        raise click.UsageError(f"refusing to listen on {host} without tokens: set --token and "
                               "--node-token (or FTRAIN_USER_TOKEN and FTRAIN_NODE_TOKEN)")
    settings = Settings(etcd_endpoints=etcd_endpoints, user_token=token, node_token=node_token,
                        snapshot_root=snapshot_root)
    logging.basicConfig(level=os.environ.get("FTRAIN_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
