"""Fixtures of the store tests: one moto S3 server on loopback per test process, a bucket per
module that asks for one."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator

import pytest


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """The URL of a moto S3 server on a free loopback port (stopped at the end of the session)."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_bucket(moto_endpoint) -> Callable[[str], dict[str, str]]:
    """``s3_bucket(name)``: make bucket ``name`` on the moto server; its storage options."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )

    def make(name: str) -> dict[str, str]:
        client.create_bucket(Bucket=name)
        return {"endpoint_url": moto_endpoint, "key": "testing", "secret": "testing"}

    return make
